"""Engine throughput: aggregate output tok/s at concurrency 1..16, in-process, against a baseline.

The baseline is llama-cpp-python's own high-level API (`Llama.create_completion`) serving the same
prompts one after another, with the same model and threads, measured in the same run (before and
after the engine levels) because this machine is shared and noisy. Each figure is the best of its
runs (like `timeit`): noise only ever slows a run down, and both sides get the same treatment.

The baseline runs in a child process: llama.cpp's OpenMP keeps a worker pool per calling thread,
and a pool left behind by the main thread competes with the engine thread's pool for the cores
(measured here: the engine then runs at a third of its speed).

    python benchmarks/engine_throughput.py [--requests 16] [--max-tokens 64] [--levels 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, closed_loop, table, use_our_weight_layout

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams
from magnitude_jupyter.models.registry import bundled_model_path


def run_baseline(model_path: Path, prompts: list[str], max_tokens: int, threads: int) -> tuple[int, float]:
    import llama_cpp._logger  # noqa: F401  (quiet llama.cpp's log)
    from llama_cpp import Llama

    use_our_weight_layout()
    llm = Llama(str(model_path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_completion("Hello", max_tokens=4, temperature=0.0)  # warm-up
    tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
        tokens += out["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - start
    llm.close()
    return tokens, elapsed


def run_isolated(fn, *args):
    """Run `fn(*args)` in a fresh child process and return its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine level (the best counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    model_path = bundled_model_path()
    assert model_path is not None, "the bundled model is not installed"

    base_before = run_isolated(run_baseline, model_path, prompts, args.max_tokens, args.threads)
    engine = Engine(settings=Settings(), parallel=max(levels), ctx_size=8192, threads=args.threads).start()
    engine.generate("Hello", params=SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = {}
    for c in levels:
        runs = [closed_loop(engine, prompts, params, c) for _ in range(args.repeats)]
        results[c] = max(runs, key=lambda run: run[0] / run[1])
    engine.shutdown()
    base_after = run_isolated(run_baseline, model_path, prompts, args.max_tokens, args.threads)

    base_tps = [t / s for t, s in (base_before, base_after)]
    baseline = max(base_tps)
    best_base = max((base_before, base_after), key=lambda run: run[0] / run[1])
    rows = [
        [
            "baseline (create_completion, sequential)",
            args.requests,
            best_base[0],
            f"{best_base[1]:.2f}",
            f"{baseline:.1f}",
            "1.00×",
        ]
    ]
    for c, (tokens, secs) in results.items():
        rows.append(
            [
                f"engine, concurrency {c}",
                args.requests,
                tokens,
                f"{secs:.2f}",
                f"{tokens / secs:.1f}",
                f"{tokens / secs / baseline:.2f}×",
            ]
        )
    print(
        f"model: {model_path.name}, {args.requests} requests per level, {args.max_tokens} new tokens, greedy, "
        f"{args.threads} threads; baseline tok/s before/after: {base_tps[0]:.1f}/{base_tps[1]:.1f}"
    )
    print(table(["run", "requests", "output tokens", "seconds", "output tok/s", "vs baseline"], rows))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "baseline_tokens_per_s": baseline,
                    "levels": {
                        c: {"tokens": t, "seconds": s, "tokens_per_s": t / s, "ratio": t / s / baseline}
                        for c, (t, s) in results.items()
                    },
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
