"""Does the calibration sweep measure what an independent load client measures?

Runs `magnitude serve`, then, for each concurrency level: the sweep's closed-loop level, and right
after it an independent closed-loop client (asyncio + httpx, none of our client code) sending the
same kind of requests (a shared system prompt and distinct user text; no run repeats another's
prompts, on either side). Prints both output tok/s and their ratio; they should agree within 15%.

    python benchmarks/calibration_check.py [--levels 1,4,8] [--requests 16] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TOKEN, MagnitudeServer, table

from magnitude_jupyter.calibrate.sweep import SweepConfig, messages_for, run_closed_level


async def independent_level(url: str, concurrency: int, config: SweepConfig, offset: int) -> float:
    """The same level's load from a client of its own, with distinct prompts of its own (the sweep's default),
    numbered from `offset`."""
    remaining = [config.requests_per_level]
    tokens = [0]
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:

        async def client() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                body = {
                    "messages": messages_for(config, offset + remaining[0]),
                    "max_tokens": config.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk.get("usage") and chunk.get("choices"):
                                tokens[0] += chunk["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return tokens[0] / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    config = SweepConfig(requests_per_level=args.requests, max_tokens=args.max_tokens)
    server = MagnitudeServer(parallel=8)
    rows = []
    worst = 0.0
    try:
        url = f"http://127.0.0.1:{server.port}"
        asyncio.run(independent_level(url, 1, SweepConfig(requests_per_level=2, max_tokens=8), 0))  # warm-up
        # Every run its own prompts, on both sides, as `calibrate` gives every level its own: a prompt
        # sent again is a prefix-cache hit, and its greedy answer is remembered (drafts), which flatters.
        offsets = itertools.count(1_000_000, 1_000_000)
        for c in (int(x) for x in args.levels.split(",")):
            # Alternate the two, best of `repeats` each: noise on a shared machine only slows a run down.
            sweeps, others = [], []
            for _ in range(args.repeats):
                level = run_closed_level(server.client, config, c, threading.Event(), next(offsets))
                sweeps.append(level.output_tokens_per_s)
                others.append(asyncio.run(independent_level(url, c, config, next(offsets))))
            sweep, other = max(sweeps), max(others)
            worst = max(worst, abs(sweep / other - 1))
            rows.append([c, f"{sweep:.1f}", f"{other:.1f}", f"{sweep / other:.3f}"])
    finally:
        server.close()
    print(f"{args.requests} requests per level, {args.max_tokens} tokens each, magnitude serve (parallel 8)")
    print(table(["concurrency", "sweep tok/s", "independent client tok/s", "ratio"], rows))
    print(f"largest difference: {worst:.1%} ({'within' if worst <= 0.15 else 'OUTSIDE'} the 15% bound)")
    sys.exit(0 if worst <= 0.15 else 1)


if __name__ == "__main__":
    main()
