"""Server throughput: closed-loop streaming clients against `magnitude serve` and llama-cpp-python's server.

Both servers run as separate processes with the same model and threads, one after the other in the
same run; each level sends at least 32 chat requests (64 new tokens, greedy) from `c` concurrent
streaming clients, each sending its next request when its last answer is complete.

Output tokens come from the stream's usage where the server reports it (magnitude), else from the
number of content chunks (llama-cpp-python's server sends one per token).

    pip install -e ".[bench]"
    python benchmarks/server_throughput.py [--levels 1,4,16] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, TOKEN, MagnitudeServer, free_port, stop_process, table

from magnitude_jupyter.models import bundled_model_path


@dataclass
class Level:
    tokens: int
    seconds: float
    ttfts: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_pct(self, q: float) -> float:
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] * 1000


def start_llama_cpp_server(model: Path, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port)]
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048"]
    cmd += ["--interrupt_requests", "False", "--verbose", "False"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_up(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                r = await http.get(url + "/v1/models", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server did not come up")


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    async with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage else chunks
    return tokens, ttft if ttft is not None else time.perf_counter() - start


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> Level:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    tokens, ttfts = [], []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                n, ttft = await one_request(http, url, prompt, max_tokens)
                tokens.append(n)
                ttfts.append(ttft)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return Level(sum(tokens), time.perf_counter() - start, ttfts)


async def measure(kind: str, args: argparse.Namespace, levels: list[int]) -> dict[int, Level]:
    if kind == "magnitude":
        server = MagnitudeServer(parallel=max(levels), threads=args.threads)  # returns once the model is loaded
        url, stop = server.url, server.close
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_llama_cpp_server(bundled_model_path(), port, args.threads)
        stop = functools.partial(stop_process, proc)
    try:
        if kind != "magnitude":
            await wait_up(url, proc)
        await run_level(url, 1, 1, 8)  # warm-up
        return {c: await run_level(url, c, args.requests, args.max_tokens) for c in levels}
    finally:
        stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    ours = asyncio.run(measure("magnitude", args, levels))
    theirs = asyncio.run(measure("llama_cpp", args, levels))
    rows = []
    for c in levels:
        for name, result in (("llama_cpp.server", theirs[c]), ("magnitude serve", ours[c])):
            rows.append(
                [
                    c,
                    name,
                    args.requests,
                    result.tokens,
                    f"{result.seconds:.1f}",
                    f"{result.tokens_per_s:.1f}",
                    f"{result.ttft_pct(50):.0f}",
                    f"{result.ttft_pct(95):.0f}",
                    f"{result.tokens_per_s / theirs[c].tokens_per_s:.2f}×",
                ]
            )
    print(
        f"model: {bundled_model_path().name}, {args.requests} requests per level, {args.max_tokens} new tokens, "
        f"greedy, streaming, {args.threads} threads"
    )
    print(
        table(
            [
                "concurrency",
                "server",
                "requests",
                "output tokens",
                "seconds",
                "output tok/s",
                "TTFT p50 ms",
                "TTFT p95 ms",
                "vs llama_cpp.server",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    name: {
                        c: {
                            "tokens_per_s": r.tokens_per_s,
                            "ttft_p50_ms": r.ttft_pct(50),
                            "ttft_p95_ms": r.ttft_pct(95),
                            "ttft_mean_ms": statistics.mean(r.ttfts) * 1000,
                        }
                        for c, r in res.items()
                    }
                    for name, res in (("magnitude", ours), ("llama_cpp", theirs))
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
