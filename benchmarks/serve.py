"""Serving throughput and time to first token: continuous batching vs one request at a time.

    .venv/bin/python benchmarks/serve.py                       # slots 1, 8, 32; 1, 8, 32 clients
    .venv/bin/python benchmarks/serve.py --quick               # fewer, shorter requests
    .venv/bin/python benchmarks/serve.py --slots 1,8 --clients 1,8 --max-tokens 32

For each slot count it starts the real server (`titanc serve`, one torch thread, a subprocess
on a free port) on examples/tiny.yaml compiled with fresh weights (speed does not depend on
the weights), then for each client count runs that many concurrent streaming clients, each
sending `--requests` completions (prompts of 10 to 200 bytes, `--max-tokens` new tokens each,
temperature 0.8). `--slots 1` is one-at-a-time serving: requests queue for the single slot.
Reported per (slots, clients): generated tokens/s over the whole run (wall clock), tokens per
CPU second of the server process (steadier than wall clock on a shared machine), p50 / p99
time to first token (from sending the request to the first streamed token, queueing
included), and the engine's batched decode steps. The clients run as threads of this process
and share the machine with the server. Prints JSON, then a table.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("Titans learn to memorize at test time: a neural memory takes gradient steps on its "
        "own surprise while attention keeps a sliding window over the recent past. ") * 4


def compile_artifact(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "titanc", "compile", str(ROOT / "examples/tiny.yaml"),
                    "-o", str(out), "--set", "train.batch_size=1", "--set", "compile.target=cpu"],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


class Server:
    def __init__(self, artifact: Path, slots: int, max_queue: int, *extra: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titanc", "serve", str(artifact), "--port", "0", "--threads",
             "1", "--slots", str(slots), "--max-queue", str(max_queue), *extra],
            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout],  # type: ignore
                         daemon=True).start()
        while True:
            line = lines.get(timeout=300)
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                return

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def get(self, path: str) -> Any:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            c.request("GET", path)
            return json.loads(c.getresponse().read())
        finally:
            c.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def one_request(port: int, prompt: str, max_tokens: int, seed: int) -> tuple[float, int]:
    """Stream one completion; returns (time to first token, tokens generated)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        ttft, tokens = None, 0
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and ttft is None:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        assert ttft is not None
        return ttft, tokens
    finally:
        c.close()


def run_clients(port: int, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    def client(k: int) -> list[tuple[float, int]]:
        out = []
        for j in range(requests):
            i = k * requests + j
            out.append(one_request(port, TEXT[:10 + (i * 47) % 190], max_tokens, i))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1,
                                                  int(0.99 * len(ttfts)))], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", default="1,8,32", help="slot counts to compare (1 = one at a time)")
    ap.add_argument("--clients", default="1,8,32", help="concurrent client counts")
    ap.add_argument("--requests", type=int, default=2, help="completions per client")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion")
    ap.add_argument("--quick", action="store_true", help="--requests 1 --max-tokens 16")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 1, 16
    slots = [int(x) for x in args.slots.split(",")]
    clients = [int(x) for x in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        artifact = Path(tmp) / "tiny"
        compile_artifact(artifact)
        for n in slots:
            server = Server(artifact, n, max_queue=max(clients) * 2)
            try:
                for c in clients:
                    steps0, cpu0 = server.get("/health")["steps"], server.cpu_s()
                    row = {"slots": n, "mode": "one-at-a-time" if n == 1 else
                           "continuous batching", **run_clients(server.port, c, args.requests,
                                                                args.max_tokens)}
                    cpu = server.cpu_s() - cpu0
                    row["decode_steps"] = server.get("/health")["steps"] - steps0
                    row["server_cpu_s"] = round(cpu, 2)
                    row["tokens_per_server_cpu_s"] = round(row["tokens"] / max(cpu, 1e-9), 1)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                server.stop()
    load = os.getloadavg()
    result = {"benchmark": "serve", "spec": "examples/tiny.yaml (fresh weights, float32)",
              "max_tokens": args.max_tokens, "requests_per_client": args.requests,
              "torch_threads": 1, "loadavg": [round(x, 2) for x in load], "rows": rows}
    print(json.dumps(result, indent=2))
    print()
    print("| mode | slots | clients | tokens/s | tokens per server CPU-s | TTFT p50 | TTFT p99 "
          "| decode steps |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['slots']} | {r['clients']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_server_cpu_s']:.0f} | {r['ttft_p50_ms']:.0f} ms | "
              f"{r['ttft_p99_ms']:.0f} ms | {r['decode_steps']} |")
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
