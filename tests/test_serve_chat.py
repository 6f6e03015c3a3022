"""POST /v1/chat/completions (runtime/serve/chat.py): a run's chat template rendered in jinja2's
sandbox, the chat request and response shapes through the official `openai` client
(streaming and not, logprobs, n, stop), the 404 without a template, a malicious template
refused by the sandbox while the server keeps serving, and where a run's template is found.

The model is tests/conftest.py's `artifact` (a 1-layer MAC of width 32, float64, fresh
weights, byte tokenizer); servers run in-process (uvicorn in a thread on 127.0.0.1, a free
port), every client call has a timeout and every server stops at the end.
"""
from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from titanc.errors import TitancError
from titanc.runtime.serve.chat import ChatTemplate, load_chat_template
from titanc.runtime.serve.completions import Limits
from titanc.runtime.serve.engine import Engine
from titanc.runtime.serve.generate import Generator
from titanc.tools.cli import main
from tests.helpers import generator_and_codec, start_server

openai = pytest.importorskip("openai")

MODEL = "tiny-mac"
TIMEOUT = 60.0
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] "
            "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class Live:
    """The real app on uvicorn in a thread (127.0.0.1, a free port), with its engine."""

    def __init__(self, gen: Generator, codec: Any, chat: ChatTemplate | None):
        from titanc.runtime.serve.server import Metrics, create_app

        ref: list[Engine] = []
        self.engine = Engine(gen, codec, 2, 16)
        ref.append(self.engine)
        app = create_app(self.engine, codec, MODEL, Limits(max_tokens=64), Metrics(ref),
                         chat=chat)
        self.engine.start()
        self.server, self.thread, port = start_server(app)
        self.port = port
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    timeout=TIMEOUT, max_retries=0)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            c.request("POST", path, json.dumps(body).encode(),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.stop()


@pytest.fixture(scope="module")
def parts(artifact: Path) -> tuple[Generator, Any]:
    return generator_and_codec(artifact)


@pytest.fixture(scope="module")
def live(parts: Any) -> Iterator[Live]:
    s = Live(*parts, ChatTemplate(TEMPLATE, "test.jinja", bos_token="<s>"))
    yield s
    s.close()


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "<s><|system|>Be brief.\n<|user|>Hi there\n<|assistant|>"


def test_chat_through_the_openai_client_is_the_rendered_completion(live: Live) -> None:
    kw = dict(model=MODEL, max_tokens=8, temperature=0.8, seed=5)
    res = live.client.chat.completions.create(messages=MESSAGES, **kw)
    assert res.object == "chat.completion" and res.id.startswith("chatcmpl-")
    choice = res.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    plain = live.client.completions.create(prompt=RENDERED, **kw)
    assert choice.message.content == plain.choices[0].text
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(RENDERED.encode()), 8)

    chunks = list(live.client.chat.completions.create(messages=MESSAGES, stream=True, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    # max_completion_tokens, n, logprobs with top_logprobs
    lp = live.client.chat.completions.create(messages=MESSAGES, model=MODEL, seed=5,
                                             temperature=0.8, max_completion_tokens=8, n=2,
                                             logprobs=True, top_logprobs=2)
    assert [c.index for c in lp.choices] == [0, 1]
    assert lp.choices[0].message.content == choice.message.content
    content = lp.choices[0].logprobs.content
    want = live.client.completions.create(prompt=RENDERED, logprobs=2, **kw).choices[0].logprobs
    assert [e.token for e in content] == want.tokens
    assert [e.logprob for e in content] == pytest.approx(want.token_logprobs)
    assert all(len(e.top_logprobs) == 2 and e.bytes for e in content)


def test_stop_and_bad_chat_fields_are_400s_naming_them(live: Live) -> None:
    full = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                               temperature=0.0).choices[0].message.content
    stop = next((ch for ch in full[3:] if ch.isascii() and ch.isprintable()), None)
    if stop is not None:
        cut = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                  temperature=0.0, stop=[stop])
        assert cut.choices[0].message.content == full[:full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    bad = [({"messages": []}, "messages"),
           ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
           ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
           ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
           ({"messages": MESSAGES, "max_completion_tokens": 10**6}, "max_completion_tokens"),
           ({"messages": MESSAGES, "temperature": 9}, "temperature"),
           ({"messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
           ({"messages": {"role": "user"}}, "messages"),
           ({"messages": [{"content": "no role"}]}, "messages"),
           ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
           ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
           ({"messages": MESSAGES, "add_generation_prompt": "yes"}, "add_generation_prompt"),
           ({"messages": MESSAGES, "logprobs": 3}, "logprobs"),
           ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty")]
    for body, param in bad:
        status, reply = live.post("/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == param, (body, reply)
        assert "\n" not in reply["error"]["message"], reply


def test_without_a_template_the_chat_route_is_a_404_naming_the_fix(parts: Any) -> None:
    s = Live(*parts, None)
    try:
        with pytest.raises(openai.NotFoundError) as nf:
            s.client.chat.completions.create(model=MODEL, messages=MESSAGES)
        msg = nf.value.body["message"]
        assert "no chat template" in msg and "--chat-template" in msg, msg
        assert "POST /v1/chat/completions" in msg and "POST /v1/completions" in msg, msg
        assert nf.value.body["code"] == "not_found"
    finally:
        s.close()


EVIL = ("{% set c = messages[0]['content'] %}"
        "{% if c == 'mro' %}{{ messages.__class__.__mro__[1].__subclasses__() }}"
        "{% elif c == 'globals' %}{{ raise_exception.__globals__['os'].system('touch {p}') }}"
        "{% elif c == 'cycler' %}{{ cycler.__init__.__globals__.os.popen('touch {p}') }}"
        "{% elif c == 'mutate' %}{{ messages.append(1) }}"
        "{% elif c == 'refuse' %}{{ raise_exception('roles must alternate') }}"
        "{% else %}{{ c }}{% endif %}")


def test_a_malicious_template_is_refused_by_the_sandbox(parts: Any, tmp_path: Path) -> None:
    witness = tmp_path / "pwned"
    s = Live(*parts, ChatTemplate(EVIL.replace("{p}", str(witness)), "evil.jinja"))
    try:
        for attack in ("mro", "globals", "cycler", "mutate"):
            status, reply = s.post("/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": attack}],
                                    "max_tokens": 2})
            msg = reply["error"]["message"]
            assert status == 500 and "the sandbox forbids" in msg and "unsafe" in msg, reply
            assert reply["error"]["code"] == "chat_template_error", reply
            assert "\n" not in msg and "Traceback" not in msg, msg
        status, reply = s.post("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "refuse"}]})
        assert status == 400 and "roles must alternate" in reply["error"]["message"], reply
        assert not witness.exists()
        ok = s.client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": "still serving"}])
        assert ok.usage.completion_tokens == 3 and ok.usage.prompt_tokens == len("still serving")
    finally:
        s.close()


def test_a_runs_template_is_found_and_a_bad_one_is_one_line(tmp_path: Path, artifact: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert load_chat_template(run) is None
    (run / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    t = load_chat_template(run)
    assert t is not None and (t.bos_token, t.eos_token) == ("<s>", "</s>")
    assert t.render(MESSAGES) == RENDERED
    (run / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}{{ eos_token }}")
    t = load_chat_template(run / "checkpoint.safetensors")
    assert t.render(MESSAGES, add_generation_prompt=False) == "Hi there</s>"
    flag = tmp_path / "other.jinja"
    flag.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(TitancError, match=r"other\.jinja: the chat template does not parse"):
        load_chat_template(run, flag)
    assert main(["serve", str(artifact), "--port", "0", "--chat-template",
                 str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "missing.jinja" in err and err.count("\n") == 1, err

