"""Server throughput: closed-loop streaming clients against `magnitude serve`, llama.cpp's own
`llama-server` (the peer that counts; built by ../shared/tools/build-llama-server.sh) and
llama-cpp-python's server.

The servers run as separate processes with the same model and threads, alternating, best of two
runs each (`--repeats`); each level sends at least 32 chat requests (64 new tokens, greedy), their prompts cycled
from 16 distinct ones, from `c` concurrent streaming clients, each sending its next request when
its last answer is complete. llama-server runs as the conversation benchmark runs it (`-np` the
largest level, `--kv-unified -c 8192`).

Output tokens come from the stream's usage where the server reports it (magnitude, llama-server),
else from the number of content chunks (llama-cpp-python's server sends one per token). The work
each server did is counted as in conversations.py: rows decoded = prompt tokens not taken from a
cache (its own usage.prompt_tokens_details.cached_tokens) + one per answer token but the last +
guessed tokens refused (our /status), and rows/s; for our server, its engine thread's time per
llama_decode call (/status steps): inside the call, and the rest of the step.

    pip install -e ".[bench]"
    python benchmarks/server_throughput.py [--levels 1,4,16] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
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
from _common import (
    FLASH_ATTENTION,
    NO_DRAFTS,
    NO_SPILL,
    PEER_NO_FLASH_ATTENTION,
    PROMPTS,
    SERVERS_HELP,
    TOKEN,
    LlamaServer,
    MagnitudeServer,
    cached_of,
    chosen,
    find_llama_server,
    free_port,
    refused_drafts,
    rows_decoded,
    step_split,
    stop_process,
    table,
)

from magnitude_jupyter.models.registry import bundled_model_path


@dataclass
class Level:
    tokens: int
    seconds: float
    ttfts: list[float]
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    refused: int = 0  # guessed tokens decoded and refused (ours; the peers draft none)
    steps: str = "-"  # our engine thread per llama_decode call (/status steps)

    @property
    def rows(self) -> int:
        return rows_decoded(self.prompt_tokens, self.cached_tokens, self.tokens, self.answers, self.refused)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_pct(self, q: float) -> float:
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] * 1000


def start_llama_cpp_server(model: Path, port: int, threads: int) -> subprocess.Popen:
    # `python -m llama_cpp.server`, after loading weights in the layout ours uses (use_our_weight_layout)
    start = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
        "from _common import use_our_weight_layout; use_our_weight_layout(); "
        "import runpy; runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"
    )
    cmd = [sys.executable, "-c", start, "--model", str(model), "--port", str(port)]
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


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[int, float, dict]:
    # llama-server (cpp-httplib) closes a kept-alive connection after a few requests; a request sent on
    # one it has just closed gets no response at all, and is sent again on a fresh connection.
    for attempt in range(3):
        try:
            return await _one_request(http, url, prompt, max_tokens)
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[int, float, dict]:
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
    return tokens, ttft if ttft is not None else time.perf_counter() - start, usage or {}


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> Level:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    tokens, ttfts, usages = [], [], []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, limits=limits) as http:

        async def client() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                n, ttft, usage = await one_request(http, url, prompt, max_tokens)
                tokens.append(n)
                ttfts.append(ttft)
                usages.append(usage)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        level = Level(sum(tokens), time.perf_counter() - start, ttfts, answers=len(tokens))
    level.prompt_tokens = sum(u.get("prompt_tokens", 0) for u in usages)
    level.cached_tokens = sum(cached_of(u) for u in usages)
    return level


def our_status(server: MagnitudeServer | None) -> dict | None:
    """Our server's /status (its draft and step counts); None for the peers."""
    return server.client.status() if server is not None else None


# Our server as it ships, and without each of three mechanisms, to show what each brings in the same run.
OURS = {
    "magnitude serve": "",
    "magnitude, no drafts": NO_DRAFTS,
    "magnitude, no spill": NO_SPILL,
    "magnitude, flash attention": FLASH_ATTENTION,
}
# llama-server as the issue runs it (the ratios' base), and with flash attention off as ours runs.
PEERS = {"llama-server": (), "llama-server -fa off": PEER_NO_FLASH_ATTENTION}


async def measure(kind: str, args: argparse.Namespace, levels: list[int]) -> dict[int, Level]:
    server = None
    if kind in OURS:
        server = MagnitudeServer(OURS[kind], parallel=max(levels), threads=args.threads)  # returns once loaded
        url, stop = server.url, server.close
    elif kind in PEERS:
        peer = LlamaServer(args.llama_server, max(levels), 8192, args.threads, extra_args=PEERS[kind])
        url, stop = peer.url, peer.close
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_llama_cpp_server(bundled_model_path(), port, args.threads)
        stop = functools.partial(stop_process, proc)
    try:
        if kind == "llama_cpp":
            await wait_up(url, proc)
        await run_level(url, 1, 1, 8)  # warm-up
        results = {}
        for c in levels:
            before = our_status(server)
            results[c] = await run_level(url, c, args.requests, args.max_tokens)
            after = our_status(server)
            if before is not None and after is not None:
                results[c].refused = refused_drafts(after) - refused_drafts(before)
                results[c].steps = step_split(before["steps"], after["steps"])
        return results
    finally:
        stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each server; the best counts")
    ap.add_argument("--llama-server", default=None, help="path (default: the shared build's cache)")
    ap.add_argument("--no-llama-cpp-python", action="store_true", help="skip llama-cpp-python's server")
    ap.add_argument("--servers", nargs="+", default=None, help=SERVERS_HELP)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    args.llama_server = find_llama_server(args.llama_server)
    if args.llama_server is None:
        raise SystemExit("llama-server not found: run ../shared/tools/build-llama-server.sh first")

    # Alternating, best of `--repeats` per level: on a shared machine whichever server runs first or
    # second would otherwise carry the machine's drift as its own.
    kinds = chosen(dict.fromkeys((*PEERS, *OURS)), args.servers)
    best: dict[str, dict[int, Level]] = {kind: {} for kind in kinds}
    runs: dict[str, dict[int, list[Level]]] = {kind: {c: [] for c in levels} for kind in kinds}
    for _ in range(args.repeats):
        for kind, kept in best.items():
            for c, level in asyncio.run(measure(kind, args, levels)).items():
                runs[kind][c].append(level)
                if c not in kept or level.tokens_per_s > kept[c].tokens_per_s:
                    kept[c] = level
    peer = best["llama-server"]
    theirs = {}
    if not args.no_llama_cpp_python:
        # Its server needs the [bench] extra (fastapi and more): without it, say so and go on.
        if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("sse_starlette") is None:
            print('llama_cpp.server skipped: pip install -e ".[bench]" for it', flush=True)
        else:
            theirs = asyncio.run(measure("llama_cpp", args, levels))
    rows = []
    for c in levels:
        results = [(kind, kept[c]) for kind, kept in best.items()]
        if theirs:
            results.insert(0, ("llama_cpp.server", theirs[c]))
        for name, result in results:
            rows.append(
                [
                    c,
                    name,
                    args.requests,
                    result.tokens,
                    f"{result.seconds:.1f}",
                    f"{result.tokens_per_s:.1f}",
                    f"{result.rows:,}" if result.prompt_tokens else "-",
                    f"{result.rows / result.seconds:.1f}" if result.prompt_tokens else "-",
                    f"{result.ttft_pct(50):.0f}",
                    f"{result.ttft_pct(95):.0f}",
                    result.steps,
                    f"{result.tokens_per_s / peer[c].tokens_per_s:.2f}×",
                    f"{result.ttft_pct(50) / peer[c].ttft_pct(50):.2f}×",
                ]
            )
    print(
        f"model: {bundled_model_path().name}, {args.requests} requests per level, {args.max_tokens} new tokens, "
        f"greedy, streaming, {args.threads} threads; best of {args.repeats} alternating runs"
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
                "rows decoded",
                "rows/s",
                "TTFT p50 ms",
                "TTFT p95 ms",
                "our llama_decode + rest per call",
                "tok/s vs llama-server",
                "TTFT p50 vs llama-server",
            ],
            rows,
        )
    )
    # Each alternating pair on its own: the median of the pairs' ratios, beside the best-of table.
    ours = "magnitude serve"
    if ours in runs and "llama-server" in runs:
        for c in levels:
            pairs = list(zip(runs[ours][c], runs["llama-server"][c], strict=True))
            tok = sorted(o.tokens_per_s / p.tokens_per_s for o, p in pairs)
            ttft = sorted(o.ttft_pct(50) / p.ttft_pct(50) for o, p in pairs)
            print(
                f"{c:>2} clients, {ours} vs llama-server, each pair: tok/s "
                + " ".join(f"{r:.2f}" for r in tok)
                + f" (median {statistics.median(tok):.2f}x); TTFT p50 "
                + " ".join(f"{r:.2f}" for r in ttft)
                + f" (median {statistics.median(ttft):.2f}x)"
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
                    for name, res in (*best.items(), ("llama_cpp", theirs))
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
