"""Many models through one real `magnitude serve`: OpenAI clients pick them by name, the server loads
them on demand, lists and reports each, loads and unloads on request, and a broken file fails only
its own requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from magnitude_jupyter.calibrate.archive import compare_to_baseline
from magnitude_jupyter.calibrate.profile import Profile
from magnitude_jupyter.engine.runner import gpu_offload_supported

from .conftest import SECOND_MODEL, wait_for


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=120) as c:
        yield c


def listing(http: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def ask(oai: openai.OpenAI, model: str, **extra: object):
    return oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
        extra_body=extra or None,
    )


def test_two_models_answer_through_one_server(oai, http):
    first = ask(oai, "smollm2-135m")
    second = ask(oai, SECOND_MODEL)
    assert first.model == "smollm2-135m" and second.model == SECOND_MODEL
    assert first.choices[0].message.content and second.choices[0].message.content
    assert ask(oai, f"{SECOND_MODEL}.gguf").model == SECOND_MODEL, "the file name picks it too"

    models = listing(http)
    assert next(iter(models)) == "smollm2-135m", "the default comes first"
    for name in ("smollm2-135m", SECOND_MODEL):
        assert models[name]["loaded"] is True
        memory = models[name]["memory"]
        assert memory["resident"] == memory["weights"] + memory["kv_cache"] + memory["buffers"]
    assert models[SECOND_MODEL]["settings"]["parallel"] == 4, "its own entry in the config file"
    assert models[SECOND_MODEL]["settings"]["ctx_size"] == 2048
    assert models["smollm2-135m"]["settings"]["parallel"] == 16, "the server's flag"
    assert models[SECOND_MODEL]["meta"]["quantization"] == "Q8_0"
    if not gpu_offload_supported():  # the pinned CPU build says so instead of pretending
        assert "no GPU support" in models[SECOND_MODEL]["settings"]["gpu_layers_ignored"]
    assert {m.id for m in oai.models.list()} >= {"smollm2-135m", SECOND_MODEL, "broken"}

    status = http.get("/status").json()
    assert status["model"] == "smollm2-135m", "one-model clients still read the default's engine"
    assert {m["id"] for m in status["models"]} == {"smollm2-135m", SECOND_MODEL}
    assert http.get("/status", params={"model": SECOND_MODEL}).json()["parallel"] == 4
    metrics = http.get("/metrics").text
    assert f'magnitude_generation_tokens_total{{model="{SECOND_MODEL}"}}' in metrics
    assert 'magnitude_model_loaded{model="smollm2-135m"} 1.0' in metrics
    assert 'magnitude_prefix_cache_spilled_entries_total{model="smollm2-135m"}' in metrics


def test_load_unload_and_keep_alive(oai, http):
    ask(oai, SECOND_MODEL)
    unloaded = http.post(f"/models/{SECOND_MODEL}/unload").json()
    assert unloaded == {"id": SECOND_MODEL, "loaded": False, "unload_when_idle": False, "success": True}
    assert listing(http)[SECOND_MODEL]["loaded"] is False
    assert listing(http)[SECOND_MODEL]["state"] == "unloaded"
    assert http.get("/status", params={"model": SECOND_MODEL}).json()["state"] == "unloaded"

    loaded = http.post(f"/models/{SECOND_MODEL}/load").json()
    assert loaded["loaded"] is True and loaded["load_ms"] > 0
    assert listing(http)[SECOND_MODEL]["loaded"] is True

    http.post(f"/models/{SECOND_MODEL}/unload")
    cold = ask(oai, SECOND_MODEL, keep_alive=0)
    timings = cold.model_extra["timings"] if cold.model_extra else None
    assert timings and timings["load_ms"] > 0, "the request's timings show the load it waited for"
    wait_for(lambda: not listing(http)[SECOND_MODEL]["loaded"], timeout=15, what="keep_alive 0 to unload it")
    assert listing(http)["smollm2-135m"]["loaded"] is True


def test_bad_model_names_and_broken_files(oai, http):
    with pytest.raises(openai.NotFoundError) as err:
        ask(oai, "no-such-model")
    assert "this server serves" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        ask(oai, "/etc/passwd.gguf")

    with pytest.raises(openai.InternalServerError) as err:
        ask(oai, "broken")
    body = err.value.response.json()["error"]
    assert body["code"] == "model_load_failed" and body["param"] == "model"
    assert "broken.gguf" in body["message"]
    assert listing(http)["broken"]["error"], "the listing says why it cannot be served"
    assert ask(oai, "smollm2-135m").choices[0].message.content, "the others keep serving"

    response = http.post("/models/no-such-model/load")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    body = {"messages": [{"role": "user", "content": "x"}], "keep_alive": "soon"}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "keep_alive"


@pytest.mark.model
def test_notebook_use_compare_and_batch_compare(connected, tmp_path):
    from .notebook_helpers import run_notebook, text_outputs

    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            f"%magnitude use {SECOND_MODEL}",
            "%%magnitude --max-tokens 8\nName a fruit.",
            "%magnitude list",
            f"%%magnitude --compare smollm2-135m,{SECOND_MODEL} --max-tokens 8 -o side\nName a fruit.",
            "print(list(side.index), side['completion_tokens'].tolist(), side['error'].isna().all())",
            "import pandas as pd\ndf = pd.DataFrame({'thing': ['apple', 'sky']})",
            f"%%magnitude --df df --compare smollm2-135m,{SECOND_MODEL} --max-tokens 4 -o both\n"
            "What colour is {{ thing }}?",
            "print(list(both.columns))",
        ],
        tmp_path,
    )
    assert f"using model '{SECOND_MODEL}'" in text_outputs(nb.cells[1])
    (answer,) = [o for o in nb.cells[2].outputs if o.output_type == "display_data"]
    assert answer.metadata["magnitude"]["model"] == SECOND_MODEL, "the cell after `use` asks the chosen model"
    listed = text_outputs(nb.cells[3]).splitlines()
    assert f"* {SECOND_MODEL}  (loaded" in "\n".join(listed)
    # The notebook's model is starred; the server's default is named as the panel names it.
    assert any(line.startswith("  smollm2-135m  (server default") for line in listed)
    assert listed[-1] == f"(* this notebook's cells use {SECOND_MODEL}: %magnitude use)"
    (table,) = [o for o in nb.cells[4].outputs if o.output_type == "display_data"]
    html = table.data["text/html"]
    assert html.count("<th>smollm2-135m</th>") == 1 and f"<th>{SECOND_MODEL}</th>" in html and "TTFT" in html
    printed = text_outputs(nb.cells[5]).strip()
    assert printed.startswith(f"['smollm2-135m', '{SECOND_MODEL}'] [") and printed.endswith("] True")
    assert text_outputs(nb.cells[8]).strip() == f"['thing', 'answer[smollm2-135m]', 'answer[{SECOND_MODEL}]']"


def _calibrate(server, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "magnitude_jupyter.cli", "calibrate", "--url", server.url]
    command += ["--token", server.token, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6", "--no-probe"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=os.environ.copy())


def _doctored(profile: Profile, factor: float, path) -> str:
    """The profile with every level `factor` times as fast (throughput up, latencies down)."""
    data = profile.to_json()
    for level in data["levels"]:
        level["output_tokens_per_s"] *= factor
        for name in ("ttft_ms", "e2e_ms"):
            level[name] = {k: (v / factor if v is not None else None) for k, v in level[name].items()}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.model
def test_profiles_per_model_and_the_regression_gate(server, tmp_path, profile_archive):
    done = _calibrate(server, "--model", SECOND_MODEL, "--json", str(tmp_path / "p.json"))
    assert done.returncode == 0, done.stderr
    profile = Profile.load(tmp_path / "p.json")
    assert profile.model["id"] == SECOND_MODEL and profile.model["quantization"] == "Q8_0"
    assert profile.engine["parallel"] == 4, "the second model's own engine was measured"
    (archived,) = list(profile_archive.glob("*.json"))
    assert archived.name.startswith(profile.model["sha256"][:16]) and "archived" in done.stderr

    listed = subprocess.run(
        [sys.executable, "-m", "magnitude_jupyter.cli", "profiles", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = json.loads(listed.stdout)["profiles"]
    assert [r["model"] for r in rows] == [SECOND_MODEL] and rows[0]["kind"] == "sweep"

    assert not any(r.regressed for r in compare_to_baseline(profile, profile, 0.15)), "it passes against itself"
    assert compare_to_baseline(profile, profile, 0.15), "and compares something"
    slower = _calibrate(server, "--model", SECOND_MODEL, "--baseline", _doctored(profile, 0.1, tmp_path / "slow.json"))
    assert slower.returncode == 0, slower.stdout + slower.stderr
    faster = _calibrate(server, "--model", SECOND_MODEL, "--baseline", _doctored(profile, 10, tmp_path / "fast.json"))
    assert faster.returncode == 1 and "REGRESSED" in faster.stdout
    assert "tokens/s" in faster.stdout and "TTFT p50 ms" in faster.stdout
    # `auto` finds the archived profile: the verdict is the doctored runs' above (two real runs on a
    # busy machine may differ by any amount, so this one's is not asserted).
    auto = _calibrate(server, "--model", SECOND_MODEL, "--baseline", "auto", "--max-regression", "95%")
    assert auto.returncode in (0, 1) and "against baseline" in auto.stdout, auto.stdout + auto.stderr
    assert (auto.returncode == 1) == ("REGRESSED" in auto.stdout)
    bad = _calibrate(server, "--baseline", "auto", "--max-regression", "lots")
    assert bad.returncode != 0 and "--max-regression takes a percentage" in bad.stderr


@pytest.mark.model
def test_calibration_widget_overlays_several_models(server):
    from magnitude_jupyter.calibrate.sweep import SweepConfig
    from magnitude_jupyter.calibrate.widget import CalibrationWidget
    from magnitude_jupyter.client.http import Client

    client = Client(server.url, server.token)
    widget = CalibrationWidget.connect(
        client, SweepConfig(concurrency=(1, 2), requests_per_level=2, max_tokens=6), probe=False
    )
    assert "broken" not in widget.model.options, "a model that cannot load is not offered"
    for fig in (widget.throughput, widget.latency, widget.capacity):  # sized by the cell, not 700 px each
        assert fig.layout.width is None and fig.layout.autosize
    for fig in (widget.throughput, widget.latency):  # empty plots already span the levels asked for
        assert list(fig.layout.xaxis.tickvals) == [1, 2] and fig.layout.yaxis.rangemode == "tozero"
        assert -0.2 < fig.layout.xaxis.range[0] < 0 < 0.30103 < fig.layout.xaxis.range[1] < 0.5
    widget.concurrency.value = "1,2,4"
    widget._reset_traces([None])
    assert list(widget.throughput.layout.xaxis.tickvals) == [1, 2, 4]
    widget.concurrency.value = "1,2"
    widget.model.value = ("smollm2-135m", SECOND_MODEL)
    widget.run()
    assert widget.error is None
    assert [p.model["id"] for p in widget.profiles] == ["smollm2-135m", SECOND_MODEL]
    assert [p.engine["parallel"] for p in widget.profiles] == [16, 4], "each model's own engine"
    lines = [t for t in widget.throughput.data if t.name != "knee"]
    assert [t.name for t in lines] == ["smollm2-135m", SECOND_MODEL]
    assert all(list(t.x) == [1, 2] for t in lines), "one line per model, overlaid"
    assert [t.name for t in widget.latency.data][-1] == f"TTFT p95 ({SECOND_MODEL})"
    assert widget.progress.value == widget.progress.max == 4


def test_magnitude_list_marks_what_the_server_holds(connected, models_dir, tmp_path):
    (tmp_path / "config.yaml").write_text(f"models_dir: {models_dir}\n")
    env = {**os.environ, "MAGNITUDE_CONFIG": str(tmp_path / "config.yaml")}
    command = [sys.executable, "-m", "magnitude_jupyter.cli", "list"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    default = next(line for line in done.stdout.splitlines() if line.startswith("* smollm2-135m "))
    assert "[loaded, " in default and "MiB]" in default
    rows = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, env=env).stdout)["models"]
    assert {r["id"]: r["loaded"] for r in rows}["smollm2-135m"] is True
