"""Scoring beyond one machine: an engine in every Dask worker, and DataFrames scored where they lie.

    from distributed import Client, LocalCluster
    from magnitude_jupyter.batch.dask import EnginePlugin, score_dask_dataframe

    client = Client(LocalCluster(n_workers=2, threads_per_worker=1))
    client.register_plugin(EnginePlugin(parallel=4, threads=1))   # every worker, now and later
    scored = score_dask_dataframe(ddf, "Is this review positive? {{ review }}", max_tokens=4).compute()

Each partition is a pure task: the worker that runs it scores its rows with its own engine, in
process (`inprocess.EngineClient`: the batch code's retries, overflow policy and JSON schemas, no
HTTP). If a worker dies, Dask runs its partitions again elsewhere and every row still appears once.
With `checkpoint=FOLDER` (one every worker reaches), each partition whose rows all succeeded is
written there as parquet when it finishes; a rerun of the same job reads it instead of scoring.
Dask comes with the package (the workshop runs on the plain install).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from distributed import WorkerPlugin, get_worker

from ..calibrate.profile import Profile, compare, summarize_levels
from ..calibrate.records import Level, Percentiles
from ..calibrate.run import calibrate
from ..calibrate.sweep import SweepConfig
from ..client.http import Client as HTTPClient
from ..config import load_settings
from ..engine import Engine
from ..models.registry import ModelNotFoundError
from .endpoints import assign_partitions, endpoint_weights
from .inprocess import EngineClient
from .options import BatchOptions
from .score import ChatClient, score_dataframe, served_model

if TYPE_CHECKING:
    import dask.dataframe as dd
    import pandas as pd

    from ..client.http import Client

PLUGIN_NAME = "magnitude-engine"
WORKER_COLUMN = "worker"


class EnginePlugin(WorkerPlugin):
    """Starts an `Engine` when a worker starts (and in every worker that joins later), stops it with
    the worker. The model resolves on the worker: the bundled model is wherever the package is; a
    path must exist on every worker."""

    name = PLUGIN_NAME

    def __init__(self, model: str | None = None, **engine_settings: Any) -> None:
        self.model = model
        self.engine_settings = engine_settings
        self.engine: Engine | None = None

    def setup(self, worker: Any) -> None:
        try:
            engine = Engine(self.model, settings=load_settings(), **self.engine_settings)
        except ModelNotFoundError as exc:
            raise ModelNotFoundError(f"worker {worker.address}: {exc}") from None
        self.engine = engine.start()

    def teardown(self, worker: Any) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def worker_engine() -> Engine:
    """The engine of the worker this task runs on."""
    worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, EnginePlugin) or plugin.engine is None:
        raise RuntimeError(
            f"worker {worker.address} has no magnitude engine: register one first, "
            "client.register_plugin(EnginePlugin(...))"
        )
    return plugin.engine


def partition_file(
    folder: str, number: int, part: pd.DataFrame, template: str, options: dict[str, Any], model: str
) -> Path:
    """Where a partition's finished rows are kept: named by its number and a hash of what made them (its
    rows, the template, every option, the model), so a rerun of the same job finds it and another
    job never does."""
    import pandas as pd

    made_of = json.dumps({"template": template, "options": options, "model": model}, sort_keys=True, default=str)
    digest = hashlib.sha256(made_of.encode())
    digest.update(pd.util.hash_pandas_object(part, index=True).to_numpy().tobytes())
    digest.update(json.dumps([str(c) for c in part.columns]).encode())
    return Path(folder) / f"part-{number:05d}-{digest.hexdigest()[:20]}.parquet"


def _score_partition(
    part: pd.DataFrame,
    template: str,
    options: dict[str, Any],
    checkpoint: str | None,
    plan: list[str] | None,
    token: str | None,
    partition_info: dict[str, Any] | None = None,
) -> pd.DataFrame:
    import pandas as pd

    if part.empty:
        return _empty_result(part, options)
    number = int(partition_info["number"]) if partition_info is not None else None
    client: ChatClient
    if plan:  # an OpenAI-compatible server the plan picked for this partition
        url = plan[(number or 0) % len(plan)]
        client = HTTPClient(url, token, source=f"dask partition {number}")
        scorer, model = url, options.get("model") or served_model(client) or url
    else:  # this worker's own engine
        engine = worker_engine()
        client, scorer, model = EngineClient(engine), get_worker().address, engine.model_id
    try:
        saved = None
        if checkpoint is not None and number is not None:
            saved = partition_file(checkpoint, number, part, template, options, model)
            if saved.exists():
                return _restored(part, pd.read_parquet(saved), options)
        out = score_dataframe(part, template, client=client, progress=False, **options)
    finally:
        client.close()
    out[WORKER_COLUMN] = pd.Series(scorer, index=out.index, dtype=object)
    if saved is not None and out["error"].isna().all():  # a partition with failed rows runs again next time
        tmp = saved.with_suffix(f".{os.getpid()}.tmp")
        out.to_parquet(tmp)
        tmp.replace(saved)
    return out


def _restored(part: pd.DataFrame, stored: pd.DataFrame, options: dict[str, Any]) -> pd.DataFrame:
    """A checkpointed partition: the input as it is now (its dtypes untouched by parquet), the saved answers."""
    import pandas as pd

    out = part.copy()
    for column in (*BatchOptions(template="", **options).columns, WORKER_COLUMN):
        out[column] = pd.Series(stored[column].to_numpy(dtype=object), index=part.index, dtype=object)
    return out


def _empty_result(df: pd.DataFrame, options: dict[str, Any]) -> pd.DataFrame:
    import pandas as pd

    opts = BatchOptions(template="", **options)
    out = df.iloc[0:0].copy()
    for column in (*opts.columns, WORKER_COLUMN):
        out[column] = pd.Series(dtype=object)
    return out


def score_dask_dataframe(
    ddf: dd.DataFrame,
    template: str,
    endpoints: Sequence[str] | None = None,
    weights: Mapping[str, float] | None = None,
    token: str | None = None,
    **options: Any,
) -> dd.DataFrame:
    """A lazy dask DataFrame with the pandas path's columns (and `worker`: who scored each row), scored
    partition by partition. The template and options are checked here, before anything runs.

    Without `endpoints`, each partition is scored by the engine of the worker that runs it. With
    `endpoints=[url, …]` (OpenAI-compatible servers, `token` their bearer token), each partition goes
    to one of them over HTTP, in proportion to `weights` or to their calibrated throughput (see
    `endpoints.py`); `worker` then names the server."""
    from .score import BatchError, render_prompts

    checkpoint = options.pop("checkpoint", None)
    if checkpoint is not None:
        if not Path(checkpoint).is_dir():
            raise BatchError(f"checkpoint {checkpoint!r}: for a dask DataFrame, a folder every worker can reach")
        checkpoint = str(Path(checkpoint).resolve())
    opts = BatchOptions(template=template, **options)
    opts.validate()
    opts.check_columns([str(c) for c in ddf.columns])
    render_prompts(ddf._meta, template)  # a template error shows now, not inside a worker
    plan = None
    if endpoints is not None:
        try:
            spread = endpoint_weights(list(endpoints), weights)
        except ValueError as exc:
            raise BatchError(str(exc)) from None
        plan = assign_partitions(spread, ddf.npartitions)
    elif weights is not None:
        raise BatchError("weights are for endpoints: give endpoints=[url, …] too")
    meta = _empty_result(ddf._meta, options)
    return ddf.map_partitions(_score_partition, template, options, checkpoint, plan, token, meta=meta)


def compute_scored(scored: dd.DataFrame, progress: bool = True) -> pd.DataFrame:
    """Compute a scored dask DataFrame on the current Dask client, with Dask's progress bar (a widget in
    a notebook, text in a terminal); the result's `attrs["magnitude"]` says rows, errors, rows/s and
    which worker scored how many rows."""
    import time

    from distributed import default_client
    from distributed import progress as show_progress

    client = default_client()
    started = time.monotonic()
    future = client.compute(scored)
    if progress:
        show_progress(future)
    out = future.result()
    seconds = time.monotonic() - started
    out.attrs["magnitude"] = {
        "rows": len(out),
        "errors": int(out["error"].notna().sum()),
        "rows_per_s": round(len(out) / seconds, 2) if seconds > 0 else None,
        "rows_by_worker": rows_by_worker(out),
        "dashboard": client.dashboard_link,
    }
    return out


def rows_by_worker(scored: pd.DataFrame) -> dict[str, int]:
    """How many rows each worker scored (of a computed result)."""
    return dict(Counter(scored[WORKER_COLUMN]))


def summary_line(scored: pd.DataFrame) -> str:
    """One line for a person: rows scored and failed, how fast, and which worker scored how many."""
    failed = int(scored["error"].notna().sum())
    workers = rows_by_worker(scored)
    spread = ", ".join(f"{n} on {address}" for address, n in sorted(workers.items()))
    rate = scored.attrs.get("magnitude", {}).get("rows_per_s")
    speed = f", {rate:.2f} rows/s" if rate else ""
    return (
        f"{len(scored) - failed} of {len(scored)} rows scored, {failed} failed{speed}, "
        f"by {len(workers)} workers ({spread})"
    )


@dataclass(frozen=True)
class ClusterCalibration:
    """Every worker's profile, measured at the same time, and the cluster's as one profile."""

    workers: dict[str, Profile]
    aggregate: Profile

    def frame(self) -> pd.DataFrame:
        """One row per (worker, level), the cluster's rows last (`profile` column: who)."""
        return compare([*(replace(p, name=address) for address, p in self.workers.items()), self.aggregate])


def _calibrate_worker(config: SweepConfig) -> Profile:
    client = EngineClient(worker_engine(), source=get_worker().address)
    # A sweep without the probe asks a client only what EngineClient answers (stream_chat, status, models).
    return calibrate(cast("Client", client), config, run_probe=False, name=get_worker().address)


def calibrate_cluster(
    dask_client: Any, config: SweepConfig | None = None, one_at_a_time: bool = False
) -> ClusterCalibration:
    """The calibration sweep on every worker's engine at once (one task pinned to each worker), and
    the cluster's magnitude: per level, the workers' throughputs and token counts add up; latency
    percentiles are the worst worker's (a request meets the slowest engine as easily as any).

    `one_at_a_time`: each worker alone, one after the other: what the sum would be if the workers
    shared nothing (cores, memory bandwidth, a network), to compare the real cluster with."""
    config = config or SweepConfig()
    addresses = sorted(dask_client.scheduler_info()["workers"])

    def task(address: str) -> Any:
        return dask_client.submit(_calibrate_worker, config, workers=[address], allow_other_workers=False, pure=False)

    if one_at_a_time:
        results = [task(a).result() for a in addresses]
    else:
        results = dask_client.gather([task(a) for a in addresses])
    profiles = dict(zip(addresses, results, strict=True))
    return ClusterCalibration(profiles, _aggregate(profiles, config))


def _worst(values: list[Percentiles]) -> Percentiles:
    def top(name: str) -> float | None:
        found = [getattr(v, name) for v in values if getattr(v, name) is not None]
        return max(found) if found else None

    return Percentiles(p50=top("p50"), p95=top("p95"), p99=top("p99"), mean=top("mean"), std=top("std"))


def _aggregate(profiles: dict[str, Profile], config: SweepConfig) -> Profile:
    first = next(iter(profiles.values()))
    levels = []
    for step in [lv.step for lv in first.levels]:
        same = [lv for p in profiles.values() for lv in p.levels if lv.step == step]
        if len(same) != len(profiles):
            continue  # a worker stopped early: the cluster has no figure for this level
        levels.append(
            Level(
                requests=sum(lv.requests for lv in same),
                errors=sum(lv.errors for lv in same),
                seconds=max(lv.seconds for lv in same),
                requests_per_s=sum(lv.requests_per_s for lv in same),
                output_tokens=sum(lv.output_tokens for lv in same),
                output_tokens_per_s=sum(lv.output_tokens_per_s for lv in same),
                ttft_ms=_worst([lv.ttft_ms for lv in same]),
                tpot_ms=_worst([lv.tpot_ms for lv in same]),
                itl_ms=_worst([lv.itl_ms for lv in same]),
                e2e_ms=_worst([lv.e2e_ms for lv in same]),
                queue_ms=_worst([lv.queue_ms for lv in same]),
                concurrency=(lv0.concurrency * len(same)) if (lv0 := same[0]).concurrency is not None else None,
                arrival_rate=lv0.arrival_rate,
            )
        )
    engine = {"workers": len(profiles), **{k: first.engine.get(k) for k in ("parallel", "ctx_size")}}
    return Profile(
        machine={"workers": {a: p.machine for a, p in profiles.items()}},
        server={"url": "dask", "engine": "magnitude", "workers": sorted(profiles)},
        model=first.model,
        engine=engine,
        config=first.config,
        levels=levels,
        summary=summarize_levels(levels, engine, first.model, config.latency_target_ms),
        name=f"cluster ({len(profiles)} workers)",
    )
