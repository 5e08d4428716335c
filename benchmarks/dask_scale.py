"""Scoring on a Dask cluster, on this machine: one worker with every core, or a worker per core.

1. The same 128-row DataFrame batch (a one-word classification, 8 new tokens, greedy) scored by a
   `LocalCluster` of one worker (llama.cpp on 2 threads) and of two workers (1 thread each): rows/s
   and the efficiency of the second (rows/s of two / (2 x rows/s of one worker with one thread)).
2. The two-worker cluster calibrated at once (`calibrate_cluster`) against the sum of its workers
   calibrated one at a time: what a cluster of N machines would give if its workers shared nothing
   (target: within 15%). On one machine the workers share its cores' caches and memory bandwidth;
   on N machines they share only the scheduler, so the per-worker sum is the prediction to check.

    pip install -e ".[dask]"
    python benchmarks/dask_scale.py [--rows 128]
"""

from __future__ import annotations

import argparse
import time

import dask.dataframe as dd
import pandas as pd
from _common import table
from distributed import Client, LocalCluster

from magnitude_jupyter.batch.dask import ClusterCalibration, EnginePlugin, calibrate_cluster, score_dask_dataframe
from magnitude_jupyter.calibrate.sweep import SweepConfig

TEMPLATE = "Is this review positive or negative? Answer with one word. Review: {{ review }}"


def reviews(rows: int) -> pd.DataFrame:
    moods = ["great", "terrible", "fine", "broken", "lovely", "slow", "perfect", "noisy"]
    texts = [f"Review {i}: the {moods[i % 8]} kettle arrived on day {i % 9 + 1}." for i in range(rows)]
    return pd.DataFrame({"review": texts})


def sweep_prompts(tag: str, n: int = 256) -> tuple[str, ...]:
    """Distinct prompts of about 40 words, unlike those of any other tag."""
    words = ["kettle", "river", "ledger", "copper", "orchard", "signal", "harbor", "lantern", "meadow", "engine"]
    return tuple(
        f"Summarize note {tag}-{i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] + str(j) for j in range(38))
        for i in range(n)
    )


def cluster(workers: int, threads: int) -> tuple[LocalCluster, Client]:
    local = LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=":0")
    client = Client(local)
    client.register_plugin(EnginePlugin(parallel=8, ctx_size=4096, threads=threads))
    return local, client


def rows_per_s(df: pd.DataFrame, partitions: int) -> float:
    ddf = dd.from_pandas(df, npartitions=partitions, sort=False)
    warm = dd.from_pandas(df.head(8), npartitions=2, sort=False)
    score_dask_dataframe(warm, TEMPLATE, max_tokens=8).compute()
    started = time.perf_counter()
    out = score_dask_dataframe(ddf, TEMPLATE, max_tokens=8, concurrency=8).compute()
    seconds = time.perf_counter() - started
    assert out["error"].isna().all(), out["error"].dropna().head()
    return len(out) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    df = reviews(args.rows)

    rates = {}
    for workers, threads in ((1, 2), (1, 1), (2, 1)):
        local, client = cluster(workers, threads)
        try:
            rates[(workers, threads)] = rows_per_s(df, partitions=8)
        finally:
            client.close()
            local.close()

    local, client = cluster(2, 1)
    try:
        # Warm both engines first (the sweeps share a system prompt: whoever runs second would find it cached).
        calibrate_cluster(client, SweepConfig(concurrency=(2,), requests_per_level=4, max_tokens=8))
        # Alternating, best of two; every sweep with prompts of its own, or a later sweep would find
        # an earlier one's prompts in the prefix cache and flatter whichever mode runs second.
        runs: dict[bool, list[ClusterCalibration]] = {True: [], False: []}
        for k, one_at_a_time in enumerate((True, False, True, False)):
            config = SweepConfig(
                concurrency=(1, 4, 8), requests_per_level=24, max_tokens=32, prompts=sweep_prompts(f"run{k}")
            )
            runs[one_at_a_time].append(calibrate_cluster(client, config, one_at_a_time=one_at_a_time))
        alone = max(runs[True], key=lambda r: sum(lv.output_tokens_per_s for lv in r.aggregate.levels))
        together = max(runs[False], key=lambda r: sum(lv.output_tokens_per_s for lv in r.aggregate.levels))
    finally:
        client.close()
        local.close()
    one = rates[(1, 1)]
    print(f"{args.rows} rows, 8 new tokens each, greedy, 8 partitions, engines with parallel 8")
    print(
        table(
            ["cluster", "rows/s", "vs 1 worker x 2 threads", "efficiency per worker"],
            [
                ["1 worker, 2 threads", f"{rates[(1, 2)]:.2f}", "1.00", "-"],
                ["1 worker, 1 thread", f"{one:.2f}", f"{one / rates[(1, 2)]:.2f}", "1.00"],
                [
                    "2 workers, 1 thread each",
                    f"{rates[(2, 1)]:.2f}",
                    f"{rates[(2, 1)] / rates[(1, 2)]:.2f}",
                    f"{rates[(2, 1)] / (2 * one):.2f}",
                ],
            ],
        )
    )
    print()
    rows = []
    for level in together.aggregate.levels:
        per_worker = level.concurrency // 2 if level.concurrency else None
        found = [
            lv.output_tokens_per_s for p in alone.workers.values() for lv in p.levels if lv.concurrency == per_worker
        ]
        if len(found) != len(alone.workers):
            continue  # a worker alone stopped before this level (over-saturated): nothing to compare
        summed = sum(found)
        rows.append(
            [
                level.concurrency,
                f"{summed:.1f}",
                f"{level.output_tokens_per_s:.1f}",
                f"{level.output_tokens_per_s / summed:.2f}",
            ]
        )
    print(
        "2 workers x 1 thread, calibrated one at a time (summed) and at once (the cluster); 24 requests, "
        "32 tokens; distinct prompts per sweep, best of 2 alternating"
    )
    print(table(["clients (cluster)", "sum of workers alone tok/s", "cluster at once tok/s", "ratio"], rows))


if __name__ == "__main__":
    main()
