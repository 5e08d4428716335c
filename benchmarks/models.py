"""Many models in one server: the cost of a cold model, memory against the plan, sharing the CPU.

The second model is the bundled one re-encoded as Q8_0 (made in seconds, nothing downloaded). The
pool runs in this process, as `magnitude serve` runs it, so that its RSS is measured directly:

1. Time to first token of a request to a model that is not resident (its load included), and to a
   resident one, for each model.
2. RSS growth with one and with two resident models (each having served a full batch, so that its
   buffers are touched) against the sum of their plans from GGUF metadata (target: within 10%).
3. Throughput of closed-loop clients sending alternately to two resident models, against the same
   clients on one model alone (ratio).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import PROMPTS, table

from magnitude_jupyter.config import EngineSettings, Settings
from magnitude_jupyter.engine import SamplingParams
from magnitude_jupyter.engine.pool import ModelPool
from magnitude_jupyter.engine.runner import requantize
from magnitude_jupyter.models.registry import bundled_model_path

SECOND = "smollm2-135m-q8_0"
MiB = 2**20


def ask(pool: ModelPool, model: str | None, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT ms including any load, tokens) of one request, waited for."""
    started = time.monotonic()
    with pool.use(model) as (engine, load_ms):
        request = engine.submit(
            prompt,
            params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            arrival_time=started,
            load_ms=load_ms,
        )
    while not request.is_finished:
        time.sleep(0.002)
    ttft = request.timings().ttft_ms
    return (ttft or 0.0), len(request.output_tokens)


def warm(pool: ModelPool, model: str | None, parallel: int) -> None:
    """A prompt as long as one batch, then `parallel` requests at once: every buffer is touched."""
    ask(pool, model, " ".join(f"w{i}" for i in range(400)), 4)
    closed_loop(pool, [model], parallel, 2, 16)


def closed_loop(pool: ModelPool, models: list[str | None], clients: int, rounds: int, max_tokens: int) -> float:
    """Tokens/s of `clients` threads, each sending `rounds` requests, alternating over `models`."""
    tokens = [0] * clients

    def client(i: int) -> None:
        for r in range(rounds):
            model = models[(i + r) % len(models)]
            tokens[i] += ask(pool, model, PROMPTS[(i * rounds + r) % len(PROMPTS)], max_tokens)[1]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.monotonic() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    process = psutil.Process()

    with tempfile.TemporaryDirectory() as folder:
        requantize(bundled_model_path(), Path(folder) / f"{SECOND}.gguf")
        engine = EngineSettings(parallel=args.parallel, ctx_size=args.ctx_size, prefix_cache_ram_mib=0)
        pool = ModelPool(Settings(models_dir=Path(folder), engine=engine, max_loaded_models=2))
        names = [pool.default_model, SECOND]
        plans = {name: pool.plan(pool.resolve(name)) for name in names}
        rss_base = process.memory_info().rss

        ttft_rows = []
        rss_rows = []
        planned = 0
        for name in names:
            cold, _ = ask(pool, name, "Name a colour.", 8)
            warm_ttft, _ = ask(pool, name, "Name a colour.", 8)
            ttft_rows.append([name, f"{cold:.0f} ms", f"{warm_ttft:.0f} ms", f"{cold / warm_ttft:.1f}x"])
            warm(pool, name, args.parallel)
            planned += plans[name].resident
            grown = process.memory_info().rss - rss_base
            rss_rows.append(
                [
                    f"{len(rss_rows) + 1} resident (+{name})",
                    f"{grown / MiB:.0f} MiB",
                    f"{planned / MiB:.0f} MiB",
                    f"{grown / planned:.2f}",
                ]
            )

        alone = closed_loop(pool, [names[0]], args.clients, args.rounds, args.max_tokens)
        both = closed_loop(pool, names, args.clients, args.rounds, args.max_tokens)
        alone_second = closed_loop(pool, [names[1]], args.clients, args.rounds, args.max_tokens)
        pool.shutdown()

    print(f"engine: parallel {args.parallel}, ctx_size {args.ctx_size}, {psutil.cpu_count()} CPUs")
    print(table(["model", "TTFT cold (load included)", "TTFT warm", "cold / warm"], ttft_rows))
    print()
    print(table(["models in memory", "RSS growth", "planned (GGUF arithmetic)", "measured / planned"], rss_rows))
    print()
    print(
        table(
            ["workload", "tok/s", "ratio to one model alone"],
            [
                [f"{args.clients} clients, {names[0]} alone", f"{alone:.1f}", "1.00"],
                [f"{args.clients} clients, {names[1]} alone", f"{alone_second:.1f}", f"{alone_second / alone:.2f}"],
                [f"{args.clients} clients alternating over both", f"{both:.1f}", f"{both / alone:.2f}"],
            ],
        )
    )


if __name__ == "__main__":
    main()
