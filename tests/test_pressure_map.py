"""The pressure map (concurrency × context): its logic against a simulated server, its files, and the
CLI against the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from magnitude_jupyter.calibrate.archive import compare_to_baseline
from magnitude_jupyter.calibrate.options import parse_contexts
from magnitude_jupyter.calibrate.pressure import (
    DOES_NOT_FIT,
    NOT_RUN,
    PressureCell,
    PressureMap,
    fit,
    measure_sizer,
    run_pressure_map,
)
from magnitude_jupyter.calibrate.pressure_figures import pressure_difference_figure, pressure_latency_figure
from magnitude_jupyter.calibrate.profile import Profile
from magnitude_jupyter.calibrate.records import Summary
from magnitude_jupyter.calibrate.report import format_pressure_map
from magnitude_jupyter.calibrate.sweep import SweepConfig, run_sweep
from magnitude_jupyter.client.http import ClientError

TEMPLATE_TOKENS = 12


class SimulatedServer:
    """A server whose tokenizer makes a token of every word (plus its template's), whose answers take
    longer the longer their prompt and the more requests are in flight, and whose KV cache holds
    `kv_cells` (None: it does not say, as another server's /status)."""

    def __init__(self, kv_cells: int | None = None, token_s: float = 0.01, prompt_token_s: float = 0.00005) -> None:
        self.kv_cells = kv_cells
        self.token_s = token_s
        self.prompt_token_s = prompt_token_s
        self.in_flight = 0
        self.sent: list[tuple[list[dict], dict]] = []
        self._lock = threading.Lock()

    def prompt_tokens(self, messages: list[dict]) -> int:
        return TEMPLATE_TOKENS + sum(len(m["content"].split()) for m in messages)

    def stream_chat(self, messages, result=None, **body):
        with self._lock:
            self.sent.append(([dict(m) for m in messages], body))
            self.in_flight += 1
        try:
            tokens = self.prompt_tokens(messages)
            time.sleep(self.prompt_token_s * tokens * self.in_flight)
            for _ in range(body["max_tokens"]):
                time.sleep(self.token_s * (1 + 0.3 * (self.in_flight - 1)))
                yield "x"
            if result is not None:
                result.usage = {"prompt_tokens": tokens, "completion_tokens": body["max_tokens"]}
        finally:
            with self._lock:
                self.in_flight -= 1

    def status(self):
        if self.kv_cells is None:
            raise ClientError("not ours")
        return {"kv_cells_total": self.kv_cells, "kv_cells_used": 0, "parallel": 4}


def quick(**kw) -> SweepConfig:
    return SweepConfig(**{"concurrency": (1, 4), "requests_per_level": 8, "max_tokens": 8, "warmup_requests": 0, **kw})


def test_contexts_are_parsed_and_refused_in_words():
    assert parse_contexts("1024, 256,256") == (256, 1024)
    assert parse_contexts("4_096") == (4096,)
    with pytest.raises(ValueError, match="token counts separated by commas"):
        parse_contexts("short,long")
    with pytest.raises(ValueError, match="64 tokens or more"):
        parse_contexts("16")


def test_prompts_are_sized_by_the_servers_own_count():
    server = SimulatedServer()
    sizer = measure_sizer(server, quick(), seed=7)
    assert sizer.tokens_per_word == pytest.approx(1.0)
    for context in (256, 1024, 4096):
        shared, distinct = sizer.split(context)
        config = quick(system_words=shared, prompt_words=distinct)
        from magnitude_jupyter.calibrate.sweep import messages_for

        assert server.prompt_tokens(messages_for(config, 3)) == pytest.approx(context, abs=2)
        assert shared == pytest.approx(distinct, abs=2), "half shared, half the request's own"


def test_what_fits_the_kv_cache_is_said_in_cells():
    assert fit(4, 1024, 32, None) is None, "a server that does not say its cache: every cell runs"
    assert fit(4, 1024, 32, 8192) is None  # 512 shared + 4 × (512 + 32) = 2,688
    why = fit(16, 1024, 32, 8192)  # 512 + 16 × 544 = 9,216
    assert why == (
        "16 sessions of 1,024 + 32 tokens (512 of them shared) need 9,216 cells, more than the 8,192 of the KV cache"
    )
    assert "one session of 8,192 + 32 tokens" in (fit(1, 8192, 32, 8192) or "")


def test_every_cell_is_measured_or_marked_and_only_fitting_cells_send_requests():
    server = SimulatedServer(kv_cells=2500, token_s=0.001)
    seen: list[PressureCell] = []
    pmap = run_pressure_map(server, quick(requests_per_level=4), (256, 1024), on_cell=seen.append)
    assert [(c.concurrency, c.context_tokens) for c in pmap.cells] == [(1, 256), (4, 256), (1, 1024), (4, 1024)]
    assert seen == list(pmap.cells), "progress cell by cell, in the order measured"
    unfit = pmap.cell(4, 1024)
    assert unfit is not None and unfit.state == DOES_NOT_FIT and unfit.requests == 0 and "2,500" in (unfit.why or "")
    measured = [c for c in pmap.cells if c.measured]
    assert len(measured) == 3 and all(c.requests == 4 and c.errors == 0 for c in measured)
    assert all(c.prompt_tokens_mean == pytest.approx(c.context_tokens, abs=2) for c in measured)
    # 2 sizing requests, then 4 requests in each of the three cells that fit.
    assert len(server.sent) == 2 + 3 * 4
    cell_prompts = [messages for messages, body in server.sent if body["max_tokens"] == 8]
    assert len({json.dumps(m) for m in cell_prompts}) == 12, "every request its own prompt"
    systems = {m[0]["content"] for m in cell_prompts}
    assert len(systems) == 2, "one shared system part a context length"
    origins = {body["origin"] for _, body in server.sent}
    assert "calibration · 4 clients · 256 tokens" in origins


def test_a_second_map_shares_no_prompt_with_the_first():
    server = SimulatedServer(token_s=0.0005)
    for _ in range(2):
        run_pressure_map(server, quick(concurrency=(1,), requests_per_level=2), (128,))
    cell_prompts = [json.dumps(messages) for messages, body in server.sent if body["max_tokens"] == 8]
    assert len(cell_prompts) == 4 and len(set(cell_prompts)) == 4
    assert len({json.loads(p)[0]["content"] for p in cell_prompts}) == 2, "nor its shared part"


def test_a_stopped_map_marks_the_cells_it_did_not_run():
    server = SimulatedServer(token_s=0.0005)
    stop = threading.Event()

    def on_cell(cell: PressureCell) -> None:
        stop.set()

    pmap = run_pressure_map(server, quick(requests_per_level=2), (128, 256), on_cell=on_cell, stop=stop)
    assert pmap.cells[0].measured and all(c.state == NOT_RUN for c in pmap.cells[1:])
    assert len(pmap.cells) == 4 and pmap.stopped_because == "stopped"


def test_the_map_agrees_with_the_plain_sweep_where_they_share_a_cell():
    """A map's cell is a sweep's level with prompts of that length: the same client, the same figures."""
    server = SimulatedServer()
    context = 512
    pmap = run_pressure_map(server, quick(), (context,))
    shared, distinct = measure_sizer(server, quick(), seed=1).split(context)
    levels, _ = run_sweep(server, quick(system_words=shared, prompt_words=distinct))
    for level in levels:
        cell = pmap.cell(level.concurrency or 0, context)
        assert cell is not None and cell.measured
        noise = (cell.output_tokens_per_s_ci95 or 0) + (level.output_tokens_per_s_ci95 or 0)
        # Both are measured on this machine's clock, one after the other: room for what it did meanwhile.
        gap = abs((cell.output_tokens_per_s or 0) - level.output_tokens_per_s)
        assert gap <= noise + 0.25 * level.output_tokens_per_s
        assert cell.prompt_tokens_mean == pytest.approx(level.prompt_tokens_mean, abs=2)


def handmade(scale: float = 1.0, target: float | None = 3000.0) -> PressureMap:
    def cell(c: int, ctx: int, tps: float, p95: float) -> PressureCell:
        return PressureCell(c, ctx, output_tokens_per_s=tps * scale, e2e_p95_ms=p95, requests=8)

    return PressureMap(
        concurrency=(1, 4, 16),
        contexts=(256, 4096),
        max_tokens=32,
        requests_per_cell=8,
        latency_target_ms=target,
        kv_cells_total=65536,
        cells=(
            cell(1, 256, 30.0, 1200),
            cell(4, 256, 80.0, 2000),
            cell(16, 256, 150.0, 2900),
            cell(1, 4096, 10.0, 2500),
            cell(4, 4096, 20.0, 2950),
            PressureCell(16, 4096, DOES_NOT_FIT, why="16 sessions of 4,096 + 32 tokens ... more than the 65,536"),
        ),
    )


def test_the_recommendation_reads_off_the_map():
    assert handmade().recommendation() == [
        "at 256 tokens of context, at most 16 sessions meet p95 ≤ 3 s (peak 150.0 tok/s with 16 sessions)",
        "at 4,096 tokens of context, at most 4 sessions meet p95 ≤ 3 s (peak 20.0 tok/s with 4 sessions)",
    ]
    strict = PressureMap(**{**handmade().__dict__, "latency_target_ms": 1000.0})
    assert strict.recommendation()[1].startswith("at 4,096 tokens of context, no number of sessions tested meets")
    text = format_pressure_map(strict)
    assert "1.20 s ✗" in text and "does not fit" in text and "not run: 16 sessions of 4,096" in text


def test_a_profile_keeps_its_map_in_json_csv_and_the_report(tmp_path):
    profile = Profile(
        machine={},
        server={},
        model={"id": "m", "sha256": "ab"},
        engine={"parallel": 4},
        config={"concurrency": [1, 4, 16], "max_tokens": 32, "pressure_map": {"contexts": [256, 4096]}},
        levels=[],
        summary=Summary(),
        pressure_map=handmade(),
    )
    profile.save_json(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    keys = {"concurrency", "context_tokens", "output_tokens_per_s", "ttft_p95_ms", "e2e_p95_ms", "kv_cells_peak"}
    assert len(data["pressure_map"]["cells"]) == 6 and all(keys <= set(c) for c in data["pressure_map"]["cells"])
    again = Profile.load(tmp_path / "p.json")
    assert again.pressure_map == profile.pressure_map
    profile.save_csv(tmp_path / "p.csv")
    header, *rows = (tmp_path / "p.csv").read_text().splitlines()
    assert header.startswith("concurrency,context_tokens,state") and "meets_target" in header and len(rows) == 6
    faster = Profile(**{**profile.__dict__, "pressure_map": handmade(scale=1.5), "name": "faster"})
    faster.save_html(tmp_path / "p.html", baseline=profile)
    page = (tmp_path / "p.html").read_text()
    assert page.count('"hoverongaps":false') == 3, "tokens/s, p95, and the difference from the baseline"
    assert "at most 4 sessions meet p95 ≤ 3 s" in page and "engine: parallel 4" in page


def test_two_maps_compare_cell_by_cell():
    slower = handmade(scale=0.5)
    rows = compare_to_baseline(
        Profile({}, {}, {}, {}, {}, [], Summary(), pressure_map=slower),
        Profile({}, {}, {}, {}, {}, [], Summary(), pressure_map=handmade()),
        max_regression=0.15,
    )
    assert len(rows) == 5 and all(r.regressed and r.change == pytest.approx(-0.5) for r in rows)
    assert rows[0].figure == "map tokens/s" and rows[-1].step == "4×4,096"
    figure = pressure_difference_figure(slower, handmade())
    z = figure.data[0].z
    assert z[0][0] == pytest.approx(-50) and z[1][2] is None
    latency = pressure_latency_figure(PressureMap(**{**handmade().__dict__, "latency_target_ms": 1000.0}))
    assert latency.data[0].text[0][1] == "2.00 s ✗" and "over the p95 target of 1 s" in latency.layout.title.text


@pytest.mark.model
def test_cli_pressure_map_against_the_real_server(server, tmp_path):
    """The issue's command, at a size a test affords: the keys of every cell, and a heatmap in the report."""
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
            "--pressure-map",
            "--concurrency",
            "1,2",
            "--contexts",
            "128,256",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--warmup",
            "0",
            "--no-archive",
            "--json",
            str(tmp_path / "p.json"),
            "--html",
            str(tmp_path / "p.html"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    assert "cell 4/4" in done.stderr and "output tokens/s:" in done.stdout
    assert "at 256 tokens of context" in done.stdout
    cells = json.loads((tmp_path / "p.json").read_text())["pressure_map"]["cells"]
    assert [(c["concurrency"], c["context_tokens"]) for c in cells] == [(1, 128), (2, 128), (1, 256), (2, 256)]
    for cell in cells:
        assert cell["state"] == "measured" and cell["errors"] == 0
        assert cell["output_tokens_per_s"] > 0 and cell["ttft_p95_ms"] > 0 and cell["e2e_p95_ms"] > 0
        assert cell["prompt_tokens_mean"] == pytest.approx(cell["context_tokens"], rel=0.1)
        assert cell["kv_cells_peak"] is None or cell["kv_cells_peak"] > 0
    assert '"hoverongaps":false' in (tmp_path / "p.html").read_text()


def test_calibrate_refuses_a_map_and_a_workflow_together():
    bad = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "calibrate", "--pressure-map", "--workflow"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--pressure-map and --workflow" in bad.stderr
