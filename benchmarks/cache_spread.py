"""What a prefix cache spread over the KV buffer costs one stream's decode.

llama.cpp attends over every KV cell up to the last one in use at every decode step, so cache entries
kept all over the buffer slow every sequence down, even those that share nothing with them. In one
engine (parallel 16, 8,192 cells, 2 threads): one stream decodes 128 tokens on a fresh engine, then
the prefix cache is filled with short distinct prompts until it holds most of the buffer, then the
same kind of stream decodes again. Each side: the median of three streams.

    python benchmarks/cache_spread.py [--fill 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import PROMPTS, table

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams


def decode_rate(engine: Engine, prompt: str) -> float:
    request = engine.submit(prompt, params=SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    while not request.is_finished:
        time.sleep(0.001)
    return request.timings().decode_tokens_per_s or 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fill", type=int, default=60, help="distinct prompts of about 130 tokens left in the cache")
    args = ap.parse_args()
    engine = Engine(settings=Settings(), parallel=16, ctx_size=8192, threads=2).start()
    try:
        fresh = [decode_rate(engine, PROMPTS[i]) for i in range(3)]
        for i in range(args.fill):
            filler = " ".join(f"item{i}x{j}" for j in range(60))
            request = engine.submit(filler, params=SamplingParams(max_tokens=2, temperature=0))
            while not request.is_finished:
                time.sleep(0.001)
        cells = engine.stats().scheduler.prefix_cache_cells
        full = [decode_rate(engine, PROMPTS[3 + i]) for i in range(3)]
    finally:
        engine.shutdown()
    rows = [
        ["fresh engine", "0", f"{statistics.median(fresh):.1f}", "1.00"],
        [
            "after the fill",
            str(cells),
            f"{statistics.median(full):.1f}",
            f"{statistics.median(full) / statistics.median(fresh):.2f}",
        ],
    ]
    print("one stream, 128 tokens, greedy; engine parallel 16, 8,192 cells, 2 threads; median of 3")
    print(table(["engine", "prefix-cache cells", "decode tok/s", "ratio"], rows))


if __name__ == "__main__":
    main()
