"""DataFrames scored on a real Dask cluster: two worker processes, each with a real engine (one
llama.cpp thread each) started by `EnginePlugin`."""

from __future__ import annotations

import os
import re
import time

import pandas as pd
import pytest

dd = pytest.importorskip("dask.dataframe")
distributed = pytest.importorskip("distributed")

from magnitude_jupyter.batch.dask import EnginePlugin, rows_by_worker, score_dask_dataframe  # noqa: E402
from magnitude_jupyter.batch.score import BatchError, score_dataframe  # noqa: E402
from magnitude_jupyter.models.registry import ModelNotFoundError  # noqa: E402

pytestmark = pytest.mark.model
TEMPLATE = "Is this review positive or negative? Answer in one word. {{ review }}"


@pytest.fixture(scope="module")
def cluster():
    local = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = distributed.Client(local)
    client.register_plugin(EnginePlugin(parallel=4, ctx_size=2048, threads=1))
    yield client
    client.close()
    local.close()


def reviews(n: int) -> pd.DataFrame:
    texts = [f"Review {i}: the product was {'great' if i % 2 else 'bad'}." for i in range(n)]
    return pd.DataFrame({"review": texts}, index=[f"r{i}" for i in range(n)])


def test_every_row_once_in_order_with_errors_confined(cluster):
    df = reviews(60)
    df.loc["r17", "review"] = "word " * 3000  # longer than a worker's context: this row alone fails
    lazy = score_dask_dataframe(dd.from_pandas(df, npartitions=6, sort=False), TEMPLATE, max_tokens=3)
    assert list(lazy.columns) == [
        "review", "answer", "finish_reason", "prompt_tokens", "completion_tokens", "latency_ms", "error", "worker"
    ]  # fmt: skip
    out = lazy.compute()
    assert list(out.index) == list(df.index), "every row exactly once, in order"
    assert out.loc["r17", "error"] and "context" in out.loc["r17", "error"]
    assert out.drop(index="r17")["error"].isna().all() and out.drop(index="r17")["answer"].str.len().gt(0).all()
    counts = rows_by_worker(out)
    assert sum(counts.values()) == 60 and set(counts) <= set(cluster.scheduler_info()["workers"])


def test_a_killed_worker_loses_no_row(cluster):
    df = reviews(48)
    lazy = score_dask_dataframe(dd.from_pandas(df, npartitions=8, sort=False), TEMPLATE, max_tokens=6)
    future = cluster.compute(lazy)
    deadline = time.monotonic() + 60
    while not any(cluster.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = next(w for w, tasks in cluster.processing().items() if tasks)
    # The nanny restarts it and the plugin equips the new one; its partitions run again somewhere.
    cluster.run(os._exit, 1, workers=[victim], on_error="ignore")
    out = future.result(timeout=300)
    assert list(out.index) == list(df.index) and out["error"].isna().all()


def test_reproducible_answers_equal_the_pandas_path(cluster):
    from magnitude_jupyter.batch.inprocess import EngineClient
    from magnitude_jupyter.config import Settings
    from magnitude_jupyter.engine import Engine

    # Rows overlap on both sides: each reproducible request runs in a lane of its own (runner.Lane).
    options = {"max_tokens": 8, "reproducible": True}
    df = reviews(12)
    out = score_dask_dataframe(dd.from_pandas(df, npartitions=3, sort=False), TEMPLATE, **options).compute()
    with Engine(settings=Settings(), parallel=4, ctx_size=2048, threads=1) as engine:  # the workers' settings
        local = score_dataframe(df, TEMPLATE, client=EngineClient(engine), progress=False, **options)
    assert out["error"].isna().all() and out["answer"].tolist() == local["answer"].tolist()


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_sentiment",
        "description": "Look up a review's sentiment.",
        "parameters": {
            "type": "object",
            "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative"]}},
            "required": ["sentiment"],
        },
    },
}


def test_tools_reach_the_workers_engines_and_every_row_has_its_calls(cluster, inproc):
    """The Dask path submits as the HTTP handlers do (api.submit): a DataFrame scored with tools and
    tool_choice 'required' has each row's call, held to the tool's schema by the grammar, on the
    workers' engines, through a server over HTTP, and in the process."""
    from magnitude_jupyter.batch.inprocess import EngineClient
    from magnitude_jupyter.client.http import Client

    df = reviews(6)
    options = {"max_tokens": 48, "tools": [LOOKUP], "tool_choice": "required"}
    lazy = score_dask_dataframe(dd.from_pandas(df, npartitions=2, sort=False), TEMPLATE, **options)
    assert "tool_calls" in lazy.columns
    on_dask = lazy.compute()
    over_http = score_dataframe(df, TEMPLATE, client=Client(inproc.url, token=inproc.token), progress=False, **options)
    in_process = score_dataframe(df, TEMPLATE, client=EngineClient(inproc.engine), progress=False, **options)
    for out in (on_dask, over_http, in_process):
        assert out["error"].isna().all(), out["error"].tolist()
        assert (out["finish_reason"] == "tool_calls").all()
        for calls in out["tool_calls"]:
            assert calls and calls[0]["name"] == "lookup_sentiment"
            assert calls[0]["arguments"]["sentiment"] in ("positive", "negative")
    with pytest.raises(BatchError, match="tool_choice needs tools"):
        score_dask_dataframe(dd.from_pandas(df, npartitions=2), TEMPLATE, tool_choice="required")


def test_endpoints_take_partitions_by_weight(cluster, inproc):
    df = reviews(16)
    ddf = dd.from_pandas(df, npartitions=8, sort=False)
    a, b = inproc.url, inproc.open_url  # two servers in front of one engine: two URLs to spread over
    lazy = score_dask_dataframe(ddf, TEMPLATE, endpoints=[a, b], weights={a: 3, b: 1}, token=inproc.token, max_tokens=4)
    out = lazy.compute()
    assert list(out.index) == list(df.index) and out["error"].isna().all()
    assert out["answer"].str.len().gt(0).all() and (out["completion_tokens"] > 0).all()
    assert rows_by_worker(out) == {a: 12, b: 4}, "6 of 8 partitions to the server weighted 3, 2 to the other"
    with pytest.raises(BatchError, match="weights for servers not in endpoints"):
        score_dask_dataframe(ddf, TEMPLATE, endpoints=[a], weights={b: 1.0})


def test_template_checks_and_unsupported_options_fail_before_anything_runs(cluster):
    ddf = dd.from_pandas(reviews(4), npartitions=2)
    with pytest.raises(BatchError, match=r"column 'nosuchcolumn' that the DataFrame does not have"):
        score_dask_dataframe(ddf, "{{ nosuchcolumn }}")
    with pytest.raises(BatchError, match="a folder every worker can reach"):
        score_dask_dataframe(ddf, TEMPLATE, checkpoint="/nowhere/ck")


def generated_tokens(cluster) -> int:
    """Tokens generated so far by every worker's engine."""

    def count(dask_worker) -> int:
        return dask_worker.plugins["magnitude-engine"].engine.metrics.generation_tokens_total

    return sum(cluster.run(count).values())


def test_a_checkpoint_folder_skips_finished_partitions_of_the_same_job_only(cluster, tmp_path):
    df = reviews(24)
    ddf = dd.from_pandas(df, npartitions=4, sort=False)
    first = score_dask_dataframe(ddf, TEMPLATE, max_tokens=3, checkpoint=tmp_path).compute()
    assert len(list(tmp_path.glob("part-*.parquet"))) == 4
    before = generated_tokens(cluster)
    again = score_dask_dataframe(ddf, TEMPLATE, max_tokens=3, checkpoint=tmp_path).compute()
    assert generated_tokens(cluster) == before, "the same job generates nothing new"
    pd.testing.assert_frame_equal(again, first)
    other = score_dask_dataframe(ddf, TEMPLATE + " Be brief.", max_tokens=3, checkpoint=tmp_path).compute()
    assert generated_tokens(cluster) > before, "another template is scored again"
    assert list(other.index) == list(df.index) and len(list(tmp_path.glob("part-*.parquet"))) == 8


def test_a_missing_model_path_names_the_worker_and_the_path():
    local = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")
    try:
        with distributed.Client(local) as client, pytest.raises(ModelNotFoundError) as err:
            client.register_plugin(EnginePlugin(model="/nowhere/model.gguf", parallel=2, ctx_size=512, threads=1))
        assert "worker tcp://" in str(err.value) and "/nowhere/model.gguf" in str(err.value)
    finally:
        local.close()


def test_magic_scores_a_dask_dataframe_in_a_real_kernel(tmp_path):
    from .notebook_helpers import run_notebook, text_outputs

    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import pandas as pd, dask.dataframe as dd\n"
            "from distributed import Client, LocalCluster\n"
            "from magnitude_jupyter.batch.dask import EnginePlugin\n"
            "cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=':0')\n"
            "client = Client(cluster)\n"
            "client.register_plugin(EnginePlugin(parallel=2, ctx_size=1024, threads=1))\n"
            "df = pd.DataFrame({'review': [f'Review {i}: fine.' for i in range(12)]})\n"
            "ddf = dd.from_pandas(df, npartitions=4, sort=False)",
            "%%magnitude --df ddf -o scored --max-tokens 2\nIs this positive? {{ review }}",
            "print(type(scored).__name__, len(scored), list(scored.index) == list(df.index), "
            "sum(scored.attrs['magnitude']['rows_by_worker'].values()), scored.attrs['magnitude']['errors'])",
            "client.close(); cluster.close()",
        ],
        tmp_path,
    )
    assert re.search(r"12 of 12 rows scored, 0 failed, [\d.]+ rows/s, by [12] workers", text_outputs(nb.cells[2]))
    assert text_outputs(nb.cells[3]).split() == ["DataFrame", "12", "True", "12", "0"]


def test_calibrate_cluster_reports_every_worker_and_their_sum(cluster):
    from magnitude_jupyter.batch.dask import calibrate_cluster
    from magnitude_jupyter.calibrate.sweep import SweepConfig

    config = SweepConfig(concurrency=(1, 2), requests_per_level=2, max_tokens=6, warmup_requests=1)
    result = calibrate_cluster(cluster, config)
    assert sorted(result.workers) == sorted(cluster.scheduler_info()["workers"]) and len(result.workers) == 2
    for profile in result.workers.values():
        assert [lv.concurrency for lv in profile.levels] == [1, 2] and profile.engine["parallel"] == 4
    total = result.aggregate
    assert [lv.concurrency for lv in total.levels] == [2, 4], "two workers: twice the clients"
    for i, level in enumerate(total.levels):
        assert level.output_tokens_per_s == pytest.approx(
            sum(p.levels[i].output_tokens_per_s for p in result.workers.values())
        )
        assert level.ttft_ms.p95 == max(p.levels[i].ttft_ms.p95 for p in result.workers.values())
    assert total.summary.peak_tokens_per_s and total.name == "cluster (2 workers)"
    assert set(result.frame()["profile"]) == {*result.workers, "cluster (2 workers)"}
