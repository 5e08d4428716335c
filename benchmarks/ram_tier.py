"""When does the prefix cache's RAM tier pay? Restoring a saved sequence against computing it again.

For a few history lengths: the time to compute the tokens (prefill, as a request that finds no
cache would), to save the sequence's state to bytes, and to restore it into an empty sequence;
best of three, the bundled model, this machine's threads.

    python benchmarks/ram_tier.py [--lengths 128,512,2048]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from _common import table

from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.runner import LlamaRunner
from magnitude_jupyter.models.registry import bundled_model_path


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    runner = LlamaRunner(bundled_model_path(), n_ctx=8192, n_seq_max=4, n_batch=512, n_threads=args.threads)
    vocab = range(1000, 20000)
    rows = []
    for length in lengths:
        tokens = [random.Random(length).choice(vocab) for _ in range(length)]

        def compute(tokens: list[int] = tokens) -> None:
            runner.end_sequence(0)
            for start in range(0, len(tokens), 512):
                runner.decode([DecodeItem(0, tokens[start : start + 512], start, False)])

        computed = best_of(3, compute)
        saved: list[bytes] = []
        save = best_of(3, lambda saved=saved: saved.append(runner.save_sequence(0)))

        def restore(state: bytes = saved[-1]) -> None:
            runner.end_sequence(1)
            assert runner.restore_sequence(1, state)

        restored = best_of(3, restore)
        rows.append(
            [
                length,
                f"{len(saved[-1]) / 2**20:.1f}",
                f"{computed * 1000:.0f}",
                f"{save * 1000:.1f}",
                f"{restored * 1000:.1f}",
                f"{computed / restored:.0f}×",
            ]
        )
    runner.close()
    print(f"bundled model, {args.threads} threads, best of 3")
    print(table(["tokens", "state MiB", "compute ms", "save ms", "restore ms", "restore vs compute"], rows))


if __name__ == "__main__":
    main()
