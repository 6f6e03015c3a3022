"""A 20-turn conversation served with a session vs re-sending the transcript every turn.

    .venv/bin/python benchmarks/sessions.py                  # 20 turns, 32 new tokens a turn
    .venv/bin/python benchmarks/sessions.py --turns 5 --max-tokens 8

Starts the real server (`titanc serve`, one torch thread, one slot, a subprocess on a free
port) on examples/tiny.yaml compiled with fresh weights, and plays the same conversation
twice, greedily: user turns of 40 to 120 bytes, `--max-tokens` new tokens a turn. `session`:
POST /v1/sessions, then each completion sends only the new turn with `"session": ID`.
`resend`: each completion's prompt is the whole transcript so far (the user turns and the
model's replies, as text), as a chat client without sessions does. Reported per mode: prompt
tokens the server prefilled in total (the usage of every turn; a session also feeds each
turn's carried last token), wall time, server CPU seconds, and the last turn's latency.
Prints JSON, then a table.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serve import TEXT, Server, compile_artifact   # benchmarks/serve.py, beside this file


def post(port: int, path: str, body: dict | None) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        c.request("POST", path, json.dumps(body or {}).encode(),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        return data
    finally:
        c.close()


def conversation(port: int, turns: int, max_tokens: int, session: bool) -> dict[str, Any]:
    sid = post(port, "/v1/sessions", None)["id"] if session else None
    transcript, prefilled, last = "", 0, 0.0
    t0 = time.perf_counter()
    for i in range(turns):
        user = TEXT[(i * 53) % 200:][:40 + (i * 37) % 80]
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
        body.update({"prompt": user, "session": sid} if session else
                    {"prompt": transcript + user})
        t = time.perf_counter()
        out = post(port, "/v1/completions", body)
        last = time.perf_counter() - t
        prefilled += out["usage"]["prompt_tokens"] + (1 if session and i else 0)
        transcript += user + out["choices"][0]["text"]
    return {"mode": "session" if session else "resend", "turns": turns,
            "prefill_tokens": prefilled, "wall_s": round(time.perf_counter() - t0, 2),
            "last_turn_s": round(last, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per turn")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(tmp) / "tiny"
        compile_artifact(artifact)
        server = Server(artifact, 1, 4, "--max-prompt-tokens", "100000")
        try:
            for session in (True, False):
                cpu0 = server.cpu_s()
                row = conversation(server.port, args.turns, args.max_tokens, session)
                row["server_cpu_s"] = round(server.cpu_s() - cpu0, 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            server.stop()
    load = os.getloadavg()
    print(json.dumps({"benchmark": "sessions", "spec": "examples/tiny.yaml (fresh weights)",
                      "max_tokens": args.max_tokens, "torch_threads": 1,
                      "loadavg": [round(x, 2) for x in load], "rows": rows}, indent=2))
    print("\n| mode | turns | prefill tokens | wall | server CPU | last turn |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['turns']} | {r['prefill_tokens']} | {r['wall_s']:.1f} s | "
              f"{r['server_cpu_s']:.1f} s | {r['last_turn_s'] * 1000:.0f} ms |")
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
