"""Calibration: the pure parts by hand, then a real short sweep, the probe, the widget and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from magnitude_jupyter.calibrate.capacity import capacity_report, sessions_table
from magnitude_jupyter.calibrate.profile import Profile, compare, summarize_levels
from magnitude_jupyter.calibrate.records import Level, Percentiles
from magnitude_jupyter.calibrate.report import knee_text, turn_charge_text
from magnitude_jupyter.calibrate.stats import (
    knee,
    knee_not_reached,
    percentiles,
    recommend_parallel,
    saturated,
    scaling_efficiency,
)
from magnitude_jupyter.calibrate.sweep import SweepConfig, run_sweep
from magnitude_jupyter.client.http import Client
from magnitude_jupyter.models.registry import bundled_model_path, read_model_info

from .fakes import RecordingClient


def test_percentiles_by_hand():
    values = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    p = percentiles(values)
    assert p.p50 == 55.0 and p.p95 == pytest.approx(95.5) and p.p99 == pytest.approx(99.1)
    assert p.mean == 55.0 and p.std == pytest.approx(30.2765, rel=1e-4)
    assert percentiles([]) == Percentiles(p50=None, p95=None, p99=None, mean=None, std=None)


def test_knee_and_scaling_efficiency():
    thr = {1: 60.0, 2: 100.0, 4: 130.0, 8: 135.0, 16: 134.0}
    assert knee(list(thr.items())) == 4  # 4 → 8 gains under 10% per doubling
    eff = scaling_efficiency(thr)
    assert eff[1] == 1.0 and eff[2] == pytest.approx(100 / 120) and eff[8] == pytest.approx(135 / 480)
    assert knee([(1, 10.0)]) is None
    assert scaling_efficiency({2: 5.0}) == {2: None}
    # Still rising at the last level (notebook 03's sweep: 1, 2, 4 with efficiency 0.33 at 4): no knee yet.
    rising = [(1, 28.0), (2, 35.0), (4, 40.0)]
    assert knee(rising) is None and knee_not_reached(rising)
    assert not knee_not_reached(list(thr.items())) and not knee_not_reached([(1, 10.0)])
    summary = summarize_levels([level(c, t) for c, t in rising], {}, {})
    assert summary.knee_concurrency is None and summary.knee_not_reached
    assert "knee not reached (still rising at concurrency 4: try higher)" in knee_text(summary)
    assert knee_text(summarize_levels([level(c, t) for c, t in thr.items()], {}, {})) == "knee at 4"


def level(c, tps, e2e_p50=100.0, e2e_p95=200.0, ttft_p95=50.0, e2e_std=None, ttft_p50=None):
    return Level(
        concurrency=c,
        requests=4,
        errors=0,
        seconds=2.0,
        requests_per_s=2.0,
        output_tokens=100,
        output_tokens_per_s=tps,
        e2e_ms=Percentiles(p50=e2e_p50, p95=e2e_p95, std=e2e_std),
        ttft_ms=Percentiles(p50=ttft_p50, p95=ttft_p95),
    )


def test_recommendation_and_saturation():
    levels = [level(1, 60, e2e_p95=900), level(4, 120, e2e_p95=1500), level(8, 130, e2e_p95=2600)]
    assert recommend_parallel(levels, 2000) == 4  # p95 end-to-end by default
    assert recommend_parallel(levels, 100) is None
    assert recommend_parallel(levels, 60, latency_ms=lambda lv: lv.ttft_ms.p95) == 8
    assert recommend_parallel([level(1, 50, e2e_p95=None)], 2000) is None  # no latency figure
    assert saturated([level(1, 60, ttft_p95=900)], 500).startswith("p95 TTFT 900 ms")
    assert "over-saturated" in saturated([level(4, 120, e2e_p50=100), level(8, 100, e2e_p50=300)], None)
    assert saturated([level(4, 120), level(8, 125)], None) is None


def test_two_runs_are_compared_level_by_level_within_their_intervals():
    from dataclasses import replace

    from magnitude_jupyter.calibrate.report import agreement_text

    def run(*figures):
        return [replace(level(c, tps), output_tokens_per_s_ci95=ci) for c, tps, ci in figures]

    cell = run((1, 11.4, 0.8), (2, 11.9, 0.9), (4, 12.1, 0.7))
    widget = run((1, 8.8, 0.5), (2, 11.0, 0.9), (4, 13.4, 0.8))
    text = agreement_text(cell, widget, "the cell's run")
    assert text == (
        "At concurrency 2, 4 this run and the cell's run agree within their 95% intervals; at 1: 8.8 ± 0.5 tok/s "
        "now, 11.4 ± 0.8 in the cell's run: more apart than their intervals, so the machine did other work "
        "during one of them (run both again with nothing else running)."
    )
    same = agreement_text(cell, run((1, 11.0, 0.5), (2, 12.0, 0.5)))
    assert same is not None and same.endswith("where their knees differ, the figures cannot tell the two apart.")
    assert agreement_text(cell, run((8, 13.0, 1.0))) is None  # no level in common
    few = agreement_text(run((1, 9.0, None)), run((1, 11.0, None)), "run 1")
    assert few is not None and few.startswith("This run and run 1 both measured concurrency 1, with too few requests")


def test_capacity_arithmetic_for_the_bundled_model():
    meta = read_model_info(bundled_model_path()).to_json()
    status = {"kv_cells_total": 8192, "parallel": 8, "kv_buffer_bytes_reported": 180 * 2**20}
    report = capacity_report(meta, status, memory_bytes=2**30)
    assert report.bytes_per_token == 23_040  # 2 × 30 layers × 3 KV heads × 64 × 2 bytes
    assert report.tokens_that_fit == 2**30 // 23_040 == 46_603
    assert report.predicted_kv_buffer_bytes == report.reported_kv_buffer_bytes == 180 * 2**20
    assert report.current == {"parallel": 8, "ctx_size": 8192, "context_per_session": 1024, "kv_bytes": 8192 * 23_040}
    assert [r["context"] for r in report.table] == [512, 1024, 2048, 4096, 8192]  # not past the trained context
    assert report.table[-1]["sessions"] == 2**30 // (8192 * 23_040) == 5
    assert "sessions_admitted" not in report.table[0]  # the server did not say how it charges a turn
    assert turn_charge_text(report.to_json()) is None
    estimate = capacity_report(meta, {**status, "admission": "estimate", "answer_charge_tokens": 300}, 2**30)
    reserve = capacity_report(meta, {**status, "admission": "reserve", "default_max_tokens": 512}, 2**30)
    assert estimate.table[-1]["sessions_admitted"] == 2**30 // ((8192 + 300) * 23_040) == 5
    assert reserve.table[0]["sessions_admitted"] == 2**30 // ((512 + 512) * 23_040) == 45
    assert estimate.table[0]["sessions_admitted"] == 2**30 // ((512 + 300) * 23_040) == 57
    assert "likely answer (300 tokens" in turn_charge_text(estimate.to_json())
    # The engine's 8 sessions of 1,024 cells: a reserve turn of 512 more leaves room for 5 of them.
    assert turn_charge_text(reserve.to_json()).endswith("5 sessions of 1,024 tokens fit the engine's cells at once")
    q8 = capacity_report(meta, None, memory_bytes=2**30, cache_type="q8_0")
    assert q8.bytes_per_token == pytest.approx(23_040 * 34 / 64)
    assert sessions_table(1000.0, 10_000, contexts=(5, 10)) == [
        {"context": 5, "bytes_per_session": 5000.0, "sessions": 2},
        {"context": 10, "bytes_per_session": 10000.0, "sessions": 1},
    ]


def test_profile_round_trip_and_compare(tmp_path):
    levels = [
        level(1, 50.0, e2e_p50=90.0, e2e_p95=100.0, e2e_std=3.0, ttft_p50=10.0, ttft_p95=None),
        level(2, 66.7, e2e_p50=95.0, e2e_p95=120.0, e2e_std=5.0, ttft_p50=12.0, ttft_p95=None),
    ]
    summary = summarize_levels(levels, {"ctx_size": 4096}, {"trained_context": 8192}, latency_target_ms=110)
    assert summary.single_stream_tokens_per_s == 50.0 and summary.peak_concurrency == 2
    assert summary.usable_context_ratio == 0.5 and summary.recommended_parallel == 1
    profile = Profile(
        machine={"cpu": "x"},
        server={},
        model={"id": "m"},
        engine={"ctx_size": 4096},
        config={},
        levels=levels,
        summary=summary,
        name="a",
    )
    path = profile.save_json(tmp_path / "p.json")
    assert Profile.load(path) == profile
    frame = compare([profile, Profile.load(path)])
    assert len(frame) == 4 and "e2e_ms_p95" in frame.columns
    profile.save_csv(tmp_path / "p.csv")
    html = profile.save_html(tmp_path / "p.html").read_text()
    assert "plotly" in html and "Output tokens" in html and "Sessions that fit" in html


@pytest.mark.model
def test_real_short_sweep_with_confirmed_probe(server, tmp_path):
    from magnitude_jupyter.calibrate.run import calibrate

    client = Client(server.url, server.token)
    seen = []
    config = SweepConfig(concurrency=(1, 2), requests_per_level=3, max_tokens=8, warmup_requests=1)
    profile = calibrate(client, config, on_level=seen.append)
    assert [lv.concurrency for lv in profile.levels] == [1, 2] and seen == profile.levels
    for lv in profile.levels:
        assert lv.requests == 3 and lv.errors == 0 and lv.output_tokens == 24
        assert lv.ttft_ms.p50 > 0 and lv.tpot_ms.p50 > 0 and lv.queue_ms.p50 is not None
        assert lv.kv_usage_max is not None and lv.rss_bytes_max > 0
        # distinct prompts: the cache serves the shared system prompt, not the requests themselves
        assert lv.cached_share is not None and lv.cached_share < 0.6
    cap = profile.capacity
    assert cap["bytes_per_token"] == 23_040 and cap["predicted_kv_buffer_bytes"] == cap["reported_kv_buffer_bytes"]
    assert cap["probe"]["confirmed"], cap["probe"]
    assert profile.model["weight_types"] == {"Q4_1": 106_168_320, "Q8_0": 28_311_552}
    assert profile.model["sha256"] and profile.engine == {
        "parallel": 16,
        "ctx_size": 8192,
        "kv_bytes_per_token": 23040.0,
        "kv_cache_type": "f16",
        "flash_attention": client.status()["flash_attention"],  # measured at load: either kind
    }
    assert Profile.load(profile.save_json(tmp_path / "real.json")).levels == profile.levels


@pytest.mark.model
def test_widget_updates_traces_and_honours_stop(server, tmp_path):
    import yaml

    from magnitude_jupyter.calibrate.widget import CalibrationWidget

    client = Client(server.url, server.token)
    widget = CalibrationWidget.connect(
        client, SweepConfig(concurrency=(1, 2), requests_per_level=2, max_tokens=6, warmup_requests=0), probe=False
    )
    profile = widget.run()
    assert widget.error is None and len(profile.levels) == 2
    # Apply: the diff first, then the second button writes the recommended settings into the config
    config = tmp_path / "config.yaml"
    config.write_text("models_dir: ~/models\n")
    assert widget.apply_button.disabled is False and widget.write_button.disabled is True
    diff = widget.propose(config)
    recommended = profile.summary.recommended_parallel
    if recommended:  # a level met the 3 s target (6-token answers: every machine this runs on)
        assert f"+  parallel: {recommended}" in diff and widget.write_button.disabled is False
        assert widget.write() == config
        written = yaml.safe_load(config.read_text())
        assert written["engine"]["parallel"] == recommended and written["models_dir"] == "~/models"
        assert widget.propose(config) == "" and "already holds" in widget.apply_text.value
    else:
        assert diff == "" and "nothing to write" in widget.apply_text.value
    assert list(widget.throughput.data[0].x) == [1, 2]
    assert list(widget.throughput.data[0].y) == [lv.output_tokens_per_s for lv in profile.levels]
    assert len(widget.latency.data[1].y) == 2 and widget.progress.value == 2
    assert widget.start_button.disabled is False and widget.stop_button.disabled is True

    widget.concurrency.value = "1,2,4,8"
    widget.requests.value = 3
    widget.start()
    deadline = time.monotonic() + 120
    while not widget.levels and time.monotonic() < deadline:
        time.sleep(0.05)
    widget.stop()
    stopped = widget.wait(120)
    assert stopped.stopped_because == "stopped"
    assert 1 <= len(stopped.levels) < 4
    assert widget.stop_button.disabled is True
    # The first run stays on the plot, greyed, and the verdict compares the two where they overlap
    earlier = [t for t in widget.throughput.data if t.name == "run 1 (earlier)"]
    assert len(earlier) == 1 and list(earlier[0].x) == [1, 2]
    assert widget.verdict.value.startswith("This run: ") and "run 1" in widget.verdict.value  # agree or not

    # A profile measured in a cell above is the first run of a new widget
    cell = CalibrationWidget.connect(client, SweepConfig(concurrency=(1, 2)), probe=False, earlier=profile)
    first = [t for t in cell.throughput.data if t.name == "the cell's run (earlier)"]
    assert len(first) == 1 and list(first[0].y) == [lv.output_tokens_per_s for lv in profile.levels]
    assert cell.verdict.value.startswith("The cell's run: knee")


@pytest.mark.model
def test_cli_calibrate_prints_a_table_and_writes_files(server, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "magnitude_jupyter.cli",
            "calibrate",
            "--url",
            server.url,
            "--token",
            server.token,
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--max-tokens",
            "6",
            "--no-probe",
            "--json",
            str(tmp_path / "p.json"),
            "--html",
            str(tmp_path / "p.html"),
            "--csv",
            str(tmp_path / "p.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    assert "out tok/s" in done.stdout and "scaling efficiency" in done.stdout
    assert "79% of the weights are Q4_1, which llama.cpp multiplies one row at a time" in done.stdout
    assert Profile.load(tmp_path / "p.json").levels[0].concurrency == 1
    assert (tmp_path / "p.csv").read_text().startswith("concurrency")
    bad = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "calibrate", "--concurrency", "a,b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "concurrency levels must be integers" in bad.stderr


@pytest.mark.model
def test_open_loop_poisson_level(server):
    from magnitude_jupyter.calibrate.sweep import run_sweep

    client = Client(server.url, server.token)
    config = SweepConfig(mode="open", rates=(4.0,), requests_per_level=4, max_tokens=6, warmup_requests=0)
    levels, reason = run_sweep(client, config)
    assert reason is None and len(levels) == 1
    (lv,) = levels
    assert lv.arrival_rate == 4.0 and lv.concurrency is None
    assert lv.requests == 4 and lv.errors == 0 and lv.output_tokens == 24
    with pytest.raises(ValueError, match="arrival rates"):
        run_sweep(client, SweepConfig(mode="open"))


def test_sweep_prompts_differ_unless_asked_not_to():
    from magnitude_jupyter.calibrate.sweep import messages_for

    varied = SweepConfig()
    assert messages_for(varied, 1) != messages_for(varied, 2) and messages_for(varied, 3) == messages_for(varied, 3)
    assert messages_for(varied, 1)[0] == messages_for(varied, 2)[0]  # the same system prompt
    assert len(messages_for(SweepConfig(prompt_words=80), 1)[1]["content"]) > len(messages_for(varied, 1)[1]["content"])
    mine = SweepConfig(prompts=("a", "b"))
    assert [messages_for(mine, i)[0]["content"] for i in range(4)] == ["a", "b", "a", "b"]
    assert messages_for(SweepConfig(prompt="same"), 7) == [{"role": "user", "content": "same"}]


def test_a_level_reports_an_interval_and_says_what_it_measured():
    import statistics

    from magnitude_jupyter.calibrate.figures import measured_caption
    from magnitude_jupyter.calibrate.sweep import Sample, throughput_interval

    samples = [Sample(ok=True, ttft_s=0.1, e2e_s=e, tokens=10) for e in (1.0, 1.1, 0.9, 1.0)]
    interval = throughput_interval(samples, concurrency=2)
    rates = [20 / e for e in (1.0, 1.1, 0.9, 1.0)]
    assert interval == pytest.approx(1.96 * statistics.stdev(rates) / 2)
    assert throughput_interval(samples[:2], 2) is None, "two requests say nothing about spread"
    config = {"requests_per_level": 8, "max_tokens": 32, "min_seconds_per_level": 4, "prompt_words": 40}
    caption = measured_caption(config)
    assert caption == (
        "each point: 8 requests, at least 4 s, 32 new tokens each, distinct ~40-word prompts; "
        "prompt processing included; bars: 95% interval"
    )


@pytest.mark.model
def test_a_level_keeps_sending_until_its_minimum_time(server):
    import threading

    from magnitude_jupyter.calibrate.sweep import run_closed_level
    from magnitude_jupyter.client.http import Client

    config = SweepConfig(concurrency=(2,), requests_per_level=1, max_tokens=4, min_seconds_per_level=1.5)
    level = run_closed_level(Client(server.url, server.token), config, 2, threading.Event())
    # Without the minimum, one request per client ends the level in well under a second; how many more
    # fit in 1.5 s depends on the machine, so only the time is asserted.
    assert level.seconds >= 1.5 and level.requests >= 2 and level.errors == 0
    # The interval needs 3 requests; how many fit depends on the machine.
    if level.requests >= 3:
        assert level.output_tokens_per_s_ci95 is not None and level.output_tokens_per_s_ci95 >= 0


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_no_sweep_sends_a_prompt_again_across_levels_or_runs(mode):
    """A prompt sent again is a prefix-cache hit whose greedy answer is remembered: it would flatter
    the level (or the second calibration of the same server) that sends it."""
    config = SweepConfig(concurrency=(1, 2), rates=(50.0, 100.0), mode=mode, requests_per_level=6, warmup_requests=0)
    client = RecordingClient()
    for _ in range(2):
        run_sweep(client, config)
    assert len(client.sent) == 24 and len({json.dumps(messages) for messages in client.sent}) == 24


def test_calibration_traffic_is_named_in_the_panel_by_its_level():
    client = RecordingClient()
    run_sweep(client, SweepConfig(concurrency=(1, 2), requests_per_level=2, warmup_requests=1))
    assert client.origins[0] == "calibration · warm-up"
    assert set(client.origins[1:]) == {"calibration · 1 client", "calibration · 2 clients"}


def test_apply_writes_the_recommendation_into_the_config_as_a_diff(tmp_path):
    from magnitude_jupyter.calibrate.apply import config_diff, recommendations
    from magnitude_jupyter.config import load_settings

    levels = [level(1, 60, e2e_p95=900, ttft_p95=120), level(4, 120, e2e_p95=1500, ttft_p95=410)]
    summary = summarize_levels(levels, {"ctx_size": 4096}, {"trained_context": 8192}, latency_target_ms=2000)
    profile = Profile(machine={}, server={}, model={"id": "m"}, engine={}, config={}, levels=levels, summary=summary)
    changes = recommendations(profile)
    assert changes == {"engine": {"parallel": 4, "max_waiting": 8}, "slo": {"e2e_p95_ms": 2000.0, "ttft_p95_ms": 650.0}}
    path = tmp_path / "config.yaml"
    path.write_text("default_model: smollm2-135m\nengine:\n  parallel: 16\n  cache_type: q8_0\n")
    new, diff = config_diff(path, changes)
    assert "-  parallel: 16\n" in diff and "+  parallel: 4\n" in diff and "+  ttft_p95_ms: 650.0\n" in diff
    path.write_text(new)
    settings = load_settings(path, environ={})
    assert (settings.engine.parallel, settings.engine.max_waiting, settings.engine.cache_type) == (4, 8, "q8_0")
    assert (settings.slo.e2e_p95_ms, settings.slo.ttft_p95_ms) == (2000.0, 650.0)
    assert config_diff(path, changes)[1] == ""  # applied twice: nothing left to change
    none_met = Profile(
        machine={},
        server={},
        model={},
        engine={},
        config={},
        levels=levels,
        summary=summarize_levels(levels, {}, {}, latency_target_ms=100),
    )
    assert recommendations(none_met) == {"engine": {}, "slo": {}}
