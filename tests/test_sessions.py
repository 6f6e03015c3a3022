"""Sessions: a conversation's state kept across requests and restarts.

The model is test_serve's 1-layer MAC of width 32 in float64 with fresh weights. The references
are the Python `Generator` run in this process on the whole transcript; the server runs as a
subprocess on 127.0.0.1 (a free port) with a sessions directory, and every client call has a
timeout; the servers are stopped at the end.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import titanc
from titanc.errors import TitancError
from titanc.runtime.serve.generate import Generator, Sampling, load_session, save_session
from titanc.tools.cli import main
from tests.test_serve import MODEL, ROOT, SETS, TIMEOUT, Server

openai = pytest.importorskip("openai")

GREEDY = Sampling(0.0)
TURNS = ["Hello there, how", " are you", " doing today? I am fine, thanks for the",
         "?", " And the memory of the world is long, is it not, my friend?"]


@pytest.fixture(scope="module")
def gen(artifact: Path) -> Generator:
    return Generator(titanc.load(artifact))


@pytest.fixture(scope="module")
def other() -> Generator:
    """Another model: a smaller MAC."""
    return Generator(titanc.compile(str(ROOT / "examples/tiny.yaml"), **{
        "model.n_layers": 1, "model.seq_len": 8, "model.d_model": 8,
        "model.attention.segment": 4, "model.attention.window": 4, "model.attention.heads": 2,
        "model.memory.chunk_size": 2, "train.batch_size": 1, "train.dtype": "float64",
        "compile.target": "cpu"}))


@pytest.fixture(scope="module")
def sessions_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sessions_dir")


@pytest.fixture(scope="module")
def server(artifact: Path, sessions_dir: Path) -> Iterator[Server]:
    s = Server(artifact, "--slots", "4", "--max-sessions", "4", "--sessions-dir",
               str(sessions_dir))
    yield s
    s.stop()


@pytest.fixture()
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=TIMEOUT,
                         max_retries=0)


def _new(server: Server) -> str:
    status, _, body = server.request("POST", "/v1/sessions")
    assert status == 200 and body["tokens"] == 0 and body["bytes"] > 0, body
    return body["id"]


def _turn(client: Any, sid: str, prompt: str, max_tokens: int = 8, **kw: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"session": sid}, **kw)


def _reference(gen: Generator, turns: list[str], max_tokens: int = 8) -> tuple[list[int], list[str]]:
    """Each turn as one request with the whole transcript so far: (transcript, outputs)."""
    transcript: list[int] = []
    outs = []
    for t in turns:
        prompt = transcript + list(t.encode())
        out = gen.generate([prompt], max_tokens, GREEDY)[0]
        transcript = prompt + out
        outs.append(bytes(out).decode("utf-8", errors="replace"))
    return transcript, outs


# -- Python ---------------------------------------------------------------------------------------

def test_generator_conversation_equals_the_whole_transcript(gen: Generator, tmp_path: Path) -> None:
    st = gen.new_state(1)
    outs = [gen.generate([list(t.encode())], 8, GREEDY, state=st)[0] for t in TURNS]
    transcript, want = _reference(gen, TURNS)
    assert [bytes(o).decode("utf-8", errors="replace") for o in outs] == want
    assert st.tokens == [len(transcript)] and st.unfed == [transcript[-1:]]
    # state_dict and a session file restore the state bit for bit
    nxt = torch.tensor([[7]])
    want_logits = gen.step(st.take(0), nxt).clone()
    back = gen.load_state_dict(gen.state_dict(st))
    assert torch.equal(gen.step(back, nxt), want_logits)
    path = save_session(tmp_path / "conv.safetensors", gen, st)
    assert torch.equal(gen.step(load_session(path, gen), nxt), want_logits)
    # a stream closed early leaves the conversation as it was
    before = gen.state_dict(st)
    it = gen.stream([list(b"more")], 8, GREEDY, state=st)
    next(it)
    it.close()
    assert all(torch.equal(before[k], v) for k, v in gen.state_dict(st).items())


def test_session_files_of_another_model_or_damaged_are_one_line_errors(
        gen: Generator, other: Generator, tmp_path: Path) -> None:
    st = gen.new_state(1)
    gen.generate([list(b"abc")], 3, GREEDY, state=st)
    good = save_session(tmp_path / "good.safetensors", gen, st)
    data = good.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:len(data) // 2])
    (tmp_path / "flipped.safetensors").write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    cases = [(other, good, "not of this model"),
             (gen, tmp_path / "short.safetensors", "truncated"),
             (gen, tmp_path / "flipped.safetensors", "damaged"),
             (gen, tmp_path / "missing.safetensors", "does not exist")]
    for g, path, words in cases:
        with pytest.raises(TitancError) as err:
            load_session(path, g)
        msg = str(err.value)
        assert words in msg and str(path) in msg and "\n" not in msg, msg
    other_file = save_session(tmp_path / "other.safetensors", other, other.new_state(1))
    with pytest.raises(TitancError, match="not of this model"):
        load_session(other_file, gen)
    sd = gen.state_dict(st)
    sd["state.W1"] = sd["state.W1"][..., :1]
    with pytest.raises(TitancError, match="'state.W1' is"):
        gen.load_state_dict(sd)


def test_generate_cli_session_file(artifact: Path, gen: Generator, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    conv = tmp_path / "conv.safetensors"
    for t in TURNS[:2]:
        assert main(["generate", str(artifact), "--prompt", t, "--max-new-tokens", "8",
                     "--temperature", "0", "--session", str(conv)]) == 0
    transcript, want = _reference(gen, TURNS[:2])
    assert capsys.readouterr().out == "".join(f"{t}{w}\n" for t, w in zip(TURNS[:2], want))
    assert load_session(conv, gen).tokens == [len(transcript)]
    assert main(["generate", str(artifact), "--prompt", "a", "--prompt", "b",
                 "--session", str(conv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanc: error: --session continues one conversation") \
        and err.count("\n") == 1


# -- the server -----------------------------------------------------------------------------------

def test_a_session_over_5_turns_equals_one_request_with_the_transcript(
        server: Server, client: Any, gen: Generator) -> None:
    sid = _new(server)
    got = []
    for t in TURNS:
        res = _turn(client, sid, t)
        assert res.usage.prompt_tokens == len(t.encode())          # only the new turn
        got.append(res.choices[0].text)
    transcript, want = _reference(gen, TURNS)
    assert got == want
    info = server.request("GET", f"/v1/sessions/{sid}")[2]
    assert info["tokens"] == len(transcript) and info["bytes"] > 0 and not info["busy"]
    # a conversation's state does not grow: its bytes are a new session's, plus its one unfed
    # token (they grew 8 bytes a token of the transcript before: a count taken for storage)
    fresh = server.request("POST", "/v1/sessions")[2]
    assert fresh["bytes"] <= info["bytes"] <= fresh["bytes"] + 8, (fresh, info)
    # the same as one request with the whole transcript, through the server
    last = len(transcript) - 8
    whole = client.completions.create(model=MODEL, prompt=transcript[:last], max_tokens=8,
                                      temperature=0)
    assert whole.choices[0].text == got[-1]


def test_concurrent_sessions_do_not_leak(server: Server, gen: Generator) -> None:
    """Four conversations, two turns each, all at once (with other traffic): each equals its
    own transcript run alone; a second completion on a busy session gets 409."""
    convs = [[f"Conversation {i}: " + "abcdefgh"[i] * (3 + 5 * i), f" and then {i}?"]
             for i in range(4)]
    sids = [_new(server) for _ in convs]

    def run(i: int) -> list[str]:
        c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=TIMEOUT,
                          max_retries=0)
        return [_turn(c, sids[i], t, 12).choices[0].text for t in convs[i]]

    with ThreadPoolExecutor(5) as pool:
        noise = pool.submit(lambda: server.post({"prompt": "noise " * 9, "max_tokens": 40}))
        got = list(pool.map(run, range(4), timeout=300))
        assert noise.result(timeout=300)[0] == 200
    assert got == [_reference(gen, c, 12)[1] for c in convs]

    from tests.test_serve import Stream
    long = Stream(server, {"prompt": "x", "max_tokens": 2000, "session": sids[0]})
    next(long.events())
    status, _, body = server.post({"prompt": "y", "max_tokens": 2, "session": sids[0]})
    assert status == 409 and body["error"]["code"] == "session_busy"
    assert server.request("DELETE", f"/v1/sessions/{sids[0]}")[0] == 409
    long.close()
    server.wait_for(lambda h: h["active"] == 0, "the cancelled turn")
    # the cancelled turn left the session as it was
    tokens = server.request("GET", f"/v1/sessions/{sids[0]}")[2]["tokens"]
    assert tokens == len(_reference(gen, convs[0], 12)[0])


def test_bad_session_requests_get_4xx(server: Server, sessions_dir: Path) -> None:
    sid = _new(server)
    unknown = "sess_" + "0" * 32
    cases = [("GET", "/v1/sessions/nope", None, 400, "invalid_session_id"),
             ("GET", f"/v1/sessions/{unknown}", None, 404, "session_not_found"),
             ("DELETE", f"/v1/sessions/{unknown}", None, 404, "session_not_found"),
             ("POST", f"/v1/sessions/{unknown}/snapshot", None, 404, "session_not_found"),
             ("POST", "/v1/sessions", {"prompt": "x"}, 400, None),
             ("POST", "/v1/completions", {"prompt": "a", "session": "../../etc"}, 400,
              "invalid_session_id"),
             ("POST", "/v1/completions", {"prompt": "a", "session": 7}, 400,
              "invalid_session_id"),
             ("POST", "/v1/completions", {"prompt": "a", "session": unknown}, 404,
              "session_not_found"),
             ("POST", "/v1/completions", {"prompt": "a", "n": 2, "session": sid}, 400, None),
             ("POST", "/v1/completions", {"prompt": ["a", "b"], "session": sid}, 400, None)]
    for method, path, body, status, code in cases:
        data = json.dumps(body).encode() if body is not None else None
        got, _, err = server.request(method, path, data, {"Content-Type": "application/json"})
        assert got == status, (method, path, body, err)
        assert err["error"]["message"] and "\n" not in err["error"]["message"]
        if code is not None:
            assert err["error"]["code"] == code, err
    assert server.request("DELETE", f"/v1/sessions/{sid}")[2]["deleted"] is True
    assert server.request("GET", f"/v1/sessions/{sid}")[0] == 404
    assert not (sessions_dir / f"{sid}.safetensors").exists()


def test_sessions_beyond_the_limit_are_evicted_to_disk(server: Server,
                                                       sessions_dir: Path) -> None:
    ids = [_new(server) for _ in range(5)]                     # --max-sessions 4
    evicted = [s for s in ids if (sessions_dir / f"{s}.safetensors").exists()]
    assert ids[0] in evicted
    assert server.post({"prompt": "back", "max_tokens": 2, "session": ids[0]})[0] == 200
    assert server.request("GET", f"/v1/sessions/{ids[0]}")[2]["tokens"] == 4 + 2
    for s in ids:
        assert server.request("DELETE", f"/v1/sessions/{s}")[0] == 200
        assert not (sessions_dir / f"{s}.safetensors").exists()


def test_full_store_without_a_directory_refuses_with_429(gen: Generator) -> None:
    from titanc.runtime.serve.completions import ApiError
    from titanc.runtime.serve.sessions import SessionStore

    store = SessionStore(gen, 2)
    store.create(), store.create()
    with pytest.raises(ApiError) as err:
        store.create()
    assert err.value.status == 429 and "--sessions-dir" in err.value.message
    with pytest.raises(ApiError) as err:
        store.snapshot(next(iter(store._live)))
    assert err.value.status == 400


def test_snapshot_restart_restore_is_bit_identical(artifact: Path, server: Server,
                                                   client: Any, sessions_dir: Path,
                                                   other: Generator) -> None:
    """Snapshot on one server; a new server process on the same directory continues the
    session with the same next-token log-probabilities (float for float) and tokens; a
    snapshot of another model and a truncated one are 400s naming the file."""
    sid = _new(server)
    _turn(client, sid, TURNS[0])
    status, _, snap = server.request("POST", f"/v1/sessions/{sid}/snapshot")
    assert status == 200 and Path(snap["path"]) == sessions_dir / f"{sid}.safetensors"
    assert snap["file_bytes"] > 0 and snap["tokens"] > 0
    want = _turn(client, sid, TURNS[1], logprobs=5)
    # files the new server will find: another model's state, a truncated snapshot
    other_id, short_id = "sess_" + "a" * 32, "sess_" + "b" * 32
    save_session(sessions_dir / f"{other_id}.safetensors", other, other.new_state(1))
    data = Path(snap["path"]).read_bytes()
    (sessions_dir / f"{short_id}.safetensors").write_bytes(data[:len(data) - 100])
    server.stop()

    again = Server(artifact, "--slots", "4", "--sessions-dir", str(sessions_dir))
    try:
        c2 = openai.OpenAI(base_url=again.base + "/v1", api_key="unused", timeout=TIMEOUT,
                           max_retries=0)
        assert again.request("GET", f"/v1/sessions/{sid}")[2]["tokens"] == snap["tokens"]
        got = _turn(c2, sid, TURNS[1], logprobs=5)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
        assert got.choices[0].logprobs.top_logprobs == want.choices[0].logprobs.top_logprobs
        for bad, words in ((other_id, "not of this model"), (short_id, "truncated")):
            status, _, err = again.request("GET", f"/v1/sessions/{bad}")
            msg = err["error"]["message"]
            assert status == 400 and words in msg and bad in msg and "\n" not in msg, err
            assert err["error"]["code"] == "invalid_session_file"
    finally:
        again.stop()
