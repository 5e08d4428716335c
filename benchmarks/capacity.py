"""Capacity for agents: what a large `max_tokens` costs when KV cells are reserved up front
(`admission: reserve`), charged by the answers' likely length (`admission: estimate`), or allocated
as tokens come (llama.cpp's server).

16 streaming clients, closed loop, distinct prompts whose answers end by themselves (greedy, a
repetition penalty of 1.1), the
same requests at each `max_tokens` cap; `magnitude serve --parallel 16 --ctx-size 8192` in each mode
and `llama-server -np 16 --kv-unified -c 8192`, alternating. Then the estimate made wrong on
purpose: a history of short answers, then answers that run to a long cap (`ignore_eos`), to show the
preemptions it takes, that no request fails, and what they cost against `reserve` on the same load.

    python benchmarks/capacity.py [--caps 256,4096,32000] [--requests 48] [--clients 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, TOKEN, LlamaServer, MagnitudeServer, find_llama_server, run_sessions, table

from magnitude_jupyter.models.registry import bundled_model_path

CTX = 8192
MODES = {
    "magnitude reserve": "engine:\n  admission: reserve\n",
    "magnitude estimate": "engine:\n  admission: estimate\n",
}


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    errors: int = 0
    preemptions: int | None = None
    longest: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def p50(self, values: list[float]) -> float:
        return statistics.median(values) * 1000 if values else float("nan")


WORD_LIMITS = (60, 70, 80, 90, 100)
# Greedy answers of the bundled model loop until the cap on about a third of these prompts; with
# this penalty (llama.cpp's, over the last 64 tokens, the same on every server) all of them end.
REPEAT_PENALTY = 1.1


def distinct_prompts(n: int, offset: int = 0) -> list[str]:
    """`n` prompts no two alike (none a cache hit of another's), answers that mostly end by themselves
    (a word limit: without one the bundled model runs most of them to the cap)."""
    return [
        f"{PROMPTS[i % len(PROMPTS)]} Keep it under {WORD_LIMITS[(i // len(PROMPTS)) % len(WORD_LIMITS)]} words."
        for i in range(offset, offset + n)
    ]


def one_request(http: httpx.Client, url: str, prompt: str, max_tokens: int, ignore_eos: bool, run: Run) -> None:
    # llama-server (cpp-httplib) closes a kept-alive connection after a few requests; a request sent on
    # one it has just closed gets no response at all, and is sent again on a fresh connection.
    for attempt in range(3):
        try:
            return _one_request(http, url, prompt, max_tokens, ignore_eos, run)
        except httpx.RemoteProtocolError:
            if attempt == 2:
                run.errors += 1


def _one_request(http: httpx.Client, url: str, prompt: str, max_tokens: int, ignore_eos: bool, run: Run) -> None:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "repeat_penalty": REPEAT_PENALTY,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
            if r.status_code != 200:
                r.read()
                run.errors += 1
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"usage"' in line and '"completion_tokens"' in line:
                    usage = json.loads(line[6:]).get("usage") or usage
                elif ttft is None and '"content"' in line:
                    ttft = time.perf_counter() - start
    except httpx.RemoteProtocolError:
        if ttft is not None:  # it broke mid-answer: an error, not a connection to try again
            run.errors += 1
            return
        raise
    except httpx.HTTPError:
        run.errors += 1
        return
    n = (usage or {}).get("completion_tokens", 0)
    run.tokens += n
    run.longest = max(run.longest, n)
    run.ttfts.append(ttft if ttft is not None else time.perf_counter() - start)
    run.e2es.append(time.perf_counter() - start)


def closed_loop(url: str, prompts: list[str], clients: int, max_tokens: int, ignore_eos: bool = False) -> Run:
    run = Run()
    work = list(reversed(prompts))
    lock = threading.Lock()

    def client(_: int) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            while True:
                with lock:
                    if not work:
                        return
                    prompt = work.pop()
                one_request(http, url, prompt, max_tokens, ignore_eos, run)

    run.seconds = run_sessions(clients, client)
    return run


def preemptions(server: MagnitudeServer | None) -> int | None:
    return int(server.client.status().get("preemptions", 0)) if server is not None else None


def measure(name: str, args: argparse.Namespace, caps: list[int]) -> dict[int, Run]:
    ours = (
        MagnitudeServer(MODES[name], parallel=args.clients, ctx_size=CTX, threads=args.threads)
        if name in MODES
        else None
    )
    peer = LlamaServer(args.binary, args.clients, CTX, args.threads) if ours is None else None
    url = ours.url if ours is not None else peer.url  # type: ignore[union-attr]
    try:
        closed_loop(url, [f"Say hello to {name}." for name in range(args.clients)], args.clients, 32)
        results = {}
        for cap in caps:
            before = preemptions(ours)
            run = closed_loop(url, distinct_prompts(args.requests), args.clients, cap)
            after = preemptions(ours)
            run.preemptions = after - before if after is not None and before is not None else None
            results[cap] = run
        return results
    finally:
        if ours is not None:
            ours.close()
        if peer is not None:
            peer.close()


def wrong_estimate(name: str, args: argparse.Namespace) -> tuple[Run, Run]:
    """A history of short answers, then long ones: (the history's run, the long answers' run)."""
    with MagnitudeServer(MODES[name], parallel=args.clients, ctx_size=CTX, threads=args.threads) as ours:
        short = closed_loop(ours.url, distinct_prompts(32), args.clients, 16)
        before = preemptions(ours)
        long = closed_loop(ours.url, distinct_prompts(args.clients, 32), args.clients, args.long_tokens, True)
        after = preemptions(ours)
        long.preemptions = (after or 0) - (before or 0)
        return short, long


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="256,4096,32000")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument(
        "--long-tokens", type=int, default=640, help="the wrong estimate's answers: 16 of them overflow the cache"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of each server; the median counts")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--skip-wrong-estimate", action="store_true")
    ap.add_argument("--only-wrong-estimate", action="store_true")
    args = ap.parse_args()
    args.binary = find_llama_server(args.llama_server)
    if args.binary is None:
        raise SystemExit("llama-server not found: run ../shared/tools/build-llama-server.sh first")
    caps = [int(c) for c in args.caps.split(",")]
    if not args.only_wrong_estimate:
        caps_table(args, caps)
    if not args.skip_wrong_estimate:
        wrong_estimate_table(args)


def caps_table(args: argparse.Namespace, caps: list[int]) -> None:
    names = ["llama-server", *MODES]
    runs: dict[str, dict[int, list[Run]]] = {name: {cap: [] for cap in caps} for name in names}
    for _ in range(args.repeats):
        for name in names:
            for cap, run in measure(name, args, caps).items():
                runs[name][cap].append(run)

    def median_run(values: list[Run]) -> Run:
        return sorted(values, key=lambda r: r.tokens_per_s)[len(values) // 2]

    rows = []
    for cap in caps:
        peer = median_run(runs["llama-server"][cap])
        own_256 = {name: median_run(runs[name][caps[0]]) for name in names}
        for name in names:
            run = median_run(runs[name][cap])
            rows.append(
                [
                    cap,
                    name,
                    f"{run.tokens_per_s:.1f}",
                    f"{run.p50(run.ttfts):.0f}",
                    f"{run.p50(run.e2es):.0f}",
                    run.longest,
                    run.errors,
                    "-" if run.preemptions is None else run.preemptions,
                    f"{run.tokens_per_s / peer.tokens_per_s:.2f}×",
                    f"{run.p50(run.ttfts) / peer.p50(peer.ttfts):.2f}×",
                    f"{run.tokens_per_s / own_256[name].tokens_per_s:.2f}×",
                    f"{run.p50(run.ttfts) / own_256[name].p50(own_256[name].ttfts):.2f}×",
                ]
            )
    print(
        f"model: {bundled_model_path().name}, {args.clients} clients, {args.requests} distinct prompts per cap, "
        f"greedy with repeat_penalty {REPEAT_PENALTY}, answers end by themselves, ctx {CTX}, {args.threads} "
        f"threads; median of {args.repeats} alternating runs"
    )
    print(
        table(
            [
                "max_tokens",
                "server",
                "output tok/s",
                "TTFT p50 ms",
                "e2e p50 ms",
                "longest answer",
                "errors",
                "preemptions",
                "tok/s vs llama-server",
                "TTFT vs llama-server",
                f"tok/s vs its own at {caps[0]}",
                f"TTFT vs its own at {caps[0]}",
            ],
            rows,
        )
    )


def wrong_estimate_table(args: argparse.Namespace) -> None:
    rows = []
    for name in MODES:
        short, long = wrong_estimate(name, args)
        rows.append(
            [
                name,
                f"{short.tokens_per_s:.1f}",
                f"{long.tokens_per_s:.1f}",
                f"{long.p50(long.ttfts):.0f}",
                f"{long.p50(long.e2es):.0f}",
                long.errors,
                long.preemptions,
                long.tokens,
            ]
        )
    print(
        f"\nthe estimate made wrong: 32 answers of at most 16 tokens, then {args.clients} answers of "
        f"{args.long_tokens} tokens (ignore_eos), {args.clients} clients"
    )
    print(
        table(
            [
                "server",
                "history tok/s",
                "long answers tok/s",
                "TTFT p50 ms",
                "e2e p50 ms",
                "errors",
                "preemptions",
                "tokens",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
