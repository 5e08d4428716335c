"""Idle cache entries in KV cells or in host RAM: the same engine with and without the move, paired.

`engine.prefix_cache_spill_rows` moves a cache entry nobody used while that many rows were decoded
to the RAM tier, and the tail of one that running requests share only in part (a prompt asked again
shares the prompt, not the answer cached after it); benchmarks/idle_cells.py measures why: idle
cells slow every row. Three engines: as it ships, moving whole entries only, never moving. This runs the
server_throughput workload in-process (no HTTP, so only the engine differs): closed-loop clients,
chat prompts cycled from 16 distinct ones (so half the requests repeat one), 64 greedy tokens each.
Both engines are loaded at once and run in turns, level by level, so each pair of runs sees the
same moment of this shared machine; the ratio of each pair, and their median, is the figure.

    python benchmarks/spill.py [--levels 1,4,16] [--pairs 4] [--requests 32] [--spill-rows 16,32]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _common import PROMPTS, closed_loop, table

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS


def tokens_per_s(engine: Engine, concurrency: int, requests: int, max_tokens: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, seconds = closed_loop(engine, prompts, params, concurrency, chat=True)
    return tokens / seconds


def after(rows: int) -> str:
    return f"after {rows} row{'s' if rows != 1 else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--spill-rows", default=None, help="compare with these engine.prefix_cache_spill_rows instead (e.g. 16,32)"
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    variants = {after(SPILL_AFTER_ROWS): (SPILL_AFTER_ROWS, True)}  # name: (spill rows, tails too)
    if args.spill_rows:
        variants |= {after(n): (n, True) for n in (int(x) for x in args.spill_rows.split(","))}
    else:
        variants |= {"whole entries only": (SPILL_AFTER_ROWS, False), "never": (0, False)}
    engines = {
        name: Engine(
            settings=Settings(), parallel=16, ctx_size=8192, threads=args.threads, prefix_cache_spill_rows=rows
        )
        for name, (rows, _) in variants.items()
    }
    runs: dict[tuple[str, int], list[float]] = {}
    try:
        for name, engine in engines.items():
            engine.start()
            assert engine.scheduler is not None and engine.scheduler.cache is not None
            engine.scheduler.cache.spill_tails = variants[name][1]
            tokens_per_s(engine, 4, 16, args.max_tokens)  # warm-up
        for _ in range(args.pairs):
            for name, engine in engines.items():
                for c in levels:
                    runs.setdefault((name, c), []).append(tokens_per_s(engine, c, args.requests, args.max_tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    shipped, *others = variants
    rows = []
    for c in levels:
        row = [c, *(f"{statistics.median(runs[(name, c)]):.1f}" for name in variants)]
        for other in others:
            ratios = [a / b for a, b in zip(runs[(shipped, c)], runs[(other, c)], strict=True)]
            row += [" ".join(f"{r:.2f}" for r in ratios), f"{statistics.median(ratios):.2f}×"]
        rows.append(row)
    print(
        f"in-process engine, {args.requests} chat requests per run ({len(PROMPTS)} prompts cycled), "
        f"{args.max_tokens} greedy tokens, {args.threads} threads, parallel 16, 8,192 cells; {args.pairs} pairs"
    )
    headers = ["clients", *(f"tok/s, {name}" for name in variants)]
    for other in others:
        headers += [f"vs {other}, each pair", "median"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
