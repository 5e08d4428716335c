"""Service-level objectives: the rolling judgement against a direct computation, and the settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magnitude_jupyter.config import ConfigError, SloSettings, load_settings
from magnitude_jupyter.engine.metrics import EngineMetrics, Finished
from magnitude_jupyter.engine.slo import OBJECTIVES, evaluate, judge
from magnitude_jupyter.settings_surface import slo_overrides

from .conftest import wait_for

TTFT = next(o for o in OBJECTIVES if o.name == "ttft_p95_ms")
RATE = next(o for o in OBJECTIVES if o.name == "min_tokens_per_s")


def finished(at: float, ttft_ms: float, outcome: str = "stop", tok_s: float | None = 50.0, round_: bool = False):
    return Finished(at, outcome, ttft_ms / 1000, ttft_ms / 1000 + 1.0, tok_s, round_)


@given(st.lists(st.floats(min_value=1, max_value=10_000), min_size=1, max_size=200), st.floats(1, 10_000))
def test_the_window_p95_and_compliance_are_a_direct_computation(ttfts, limit):
    state = judge(TTFT, limit, [finished(i, t) for i, t in enumerate(ttfts)])
    values = np.array(ttfts)
    assert state.current == pytest.approx(round(float(np.percentile(values, 95)), 2), abs=0.01)
    compliance = float(np.mean(values / 1000 * 1000 <= limit))
    assert state.compliance == pytest.approx(compliance, abs=1e-4)
    assert state.holds == (compliance >= 0.95)
    assert state.burn_rate == pytest.approx((1 - compliance) / 0.05, abs=1e-2)


def test_errors_and_requests_without_a_first_token_are_misses_and_a_rate_is_judged_on_its_slow_end():
    window = [finished(0, 10), finished(1, 10, outcome="error"), Finished(2, "cancelled", None, 5.0, None, False)]
    state = judge(TTFT, 100, window)
    assert (state.requests, state.compliance, state.holds, state.color) == (3, round(1 / 3, 4), False, "red")
    rates = [finished(i, 10, tok_s=float(v)) for i, v in enumerate(range(1, 101))]
    slow = judge(RATE, 3.5, rates)
    assert slow.current == pytest.approx(np.percentile(range(1, 101), 5)) and slow.compliance == 0.97
    assert slow.holds and slow.color == "amber"  # holds, but 3% missing of the 5% allowed is over half
    assert judge(RATE, 1, rates).color == "green"


def test_only_the_window_counts_and_unset_objectives_are_not_judged():
    metrics = EngineMetrics()
    for i in range(10):
        metrics.finished.append(finished(float(i), 1000 if i < 5 else 10))
    settings = SloSettings(ttft_p95_ms=100, window=4.5)
    [state] = evaluate(settings, metrics.finished_since, now=9.0)
    assert (state.requests, state.holds) == (5, True)  # the five slow ones are older than the window
    assert evaluate(SloSettings(), metrics.finished_since) == []


def test_a_cold_server_predicts_the_slot_wait_from_the_answers_running_now():
    from magnitude_jupyter.engine.core import cold_wait_s
    from magnitude_jupyter.engine.metrics import StepCounts

    steps = StepCounts(decode_calls=10, decode_rows=40, decode_prompt_rows=8, decode_seconds=0.9, step_seconds=1.0)
    assert cold_wait_s([30, 50], whole_answer=100, ahead=0, steps=steps) == pytest.approx(3.0)  # the first to end
    assert cold_wait_s([30, 50], whole_answer=100, ahead=1, steps=steps) == pytest.approx(5.0)
    # further back: after the running answers, whole answers shared over the two slots
    assert cold_wait_s([30, 50], whole_answer=100, ahead=3, steps=steps) == pytest.approx(5.0 + 2 * 100 / 2 * 0.1)
    assert cold_wait_s([], whole_answer=100, ahead=0, steps=steps) is None  # nothing runs
    assert cold_wait_s([30], whole_answer=100, ahead=0, steps=StepCounts(0, 0, 0, 0.0, 0.0)) is None  # no step yet


def test_slo_settings_in_the_config_per_model_and_as_flags(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("slo:\n  ttft_p95_ms: 2000\n  window: 5m\nmodels:\n  big:\n    slo:\n      ttft_p95_ms: 9000\n")
    settings = load_settings(path, environ={})
    assert (settings.slo.ttft_p95_ms, settings.slo.window) == (2000, 300.0)
    assert settings.model_slo("big").ttft_p95_ms == 9000 and settings.model_slo("big").window == 300.0
    assert settings.model_slo("other") == settings.slo
    for bad, words in (("slo:\n  ttft_p95: 1\n", "unknown key 'ttft_p95'"), ("slo:\n  e2e_p95_ms: -1\n", "e2e_p95_ms")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=words):
            load_settings(path, environ={})
    assert slo_overrides({"slo_ttft_p95_ms": "1500", "slo_window": "1m", "parallel": 4}) == {
        "ttft_p95_ms": 1500.0,
        "window": 60.0,
    }


@pytest.mark.model
def test_a_server_judges_its_objectives_live_on_status_metrics_and_the_cli():
    from click.testing import CliRunner
    from prometheus_client.parser import text_string_to_metric_families

    from magnitude_jupyter.cli.main import main
    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer

    # One objective no answer can miss (from the flag), one every answer misses (from the config).
    with LocalServer(
        ("--parallel", "2", "--ctx-size", "1024", "--slo-ttft-p95-ms", "600000"),
        token="slo-token",
        config="slo:\n  e2e_p95_ms: 0.001\n  window: 10m\n",
    ) as server:
        client = Client(server.url, server.token)
        assert [o["color"] for o in client.status()["slo"]["objectives"]] == ["grey", "grey"]
        for _ in range(2):
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        slo = client.status()["slo"]
        by_name = {o["name"]: o for o in slo["objectives"]}
        assert slo["window_s"] == 600.0
        assert (by_name["ttft_p95_ms"]["holds"], by_name["ttft_p95_ms"]["requests"]) == (True, 2)
        assert (by_name["e2e_p95_ms"]["holds"], by_name["e2e_p95_ms"]["burn_rate"]) == (False, 20.0)

        text = client._get("/metrics").text
        samples = {
            (s.name, s.labels.get("objective")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("magnitude_slo_")
        }
        assert samples[("magnitude_slo_objective", "e2e_p95_ms")] == 0.001
        assert samples[("magnitude_slo_compliance_ratio", "e2e_p95_ms")] == 0.0
        assert samples[("magnitude_slo_compliance_ratio", "ttft_p95_ms")] == 1.0
        assert samples[("magnitude_slo_window_seconds", None)] == 600.0

        result = CliRunner().invoke(main, ["slo", "--url", server.url, "--token", server.token])
        assert result.exit_code == 1, result.output
        assert "TTFT p95" in result.output and "BROKEN" in result.output


@pytest.mark.model
@pytest.mark.parametrize("warm", [True, False], ids=["after-an-answer", "cold"])
def test_with_shedding_on_an_interactive_request_that_would_wait_past_the_objective_is_told_at_once(warm):
    import httpx

    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer

    # One slot and a TTFT objective of 1 ms: any wait for the slot breaks it, by construction.
    with LocalServer(
        ("--parallel", "1", "--ctx-size", "2048", "--slo-ttft-p95-ms", "1", "--slo-shed"), token="shed-token", config=""
    ) as server:
        client = Client(server.url, server.token)
        if warm:  # an answer finished: the rate of finishes predicts; cold, the running answer does
            client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)  # the slot is free
        busy = client.open_chat_stream(
            [{"role": "user", "content": "Count upwards."}], max_tokens=1500, ignore_eos=True, temperature=0
        )
        try:
            for line in busy.iter_lines():  # until its first token: the slot is taken and steps timed
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
            headers = {"Authorization": f"Bearer {server.token}"}
            body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
            shed = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
            assert shed.status_code == 503 and shed.json()["error"]["code"] == "slo_shed"
            assert int(shed.headers["Retry-After"]) >= 1
            # A batch request is never shed: it queues behind the interactive ones.
            queued = client.open_chat_stream(body["messages"], max_tokens=2, priority="batch")
            assert queued.status_code == 200
            queued.close()
            client.cancel(queued.headers["X-Completion-Id"])
        finally:
            client.cancel(busy.headers["X-Completion-Id"])
            busy.close()


@pytest.mark.model
def test_an_answer_nobody_reads_gives_its_slot_to_a_reader_instead_of_having_it_shed():
    """A client hung up on a long answer; the grace period (here 600 s) would keep it running. A reader
    who would be shed for its slot is served instead: the unread answer is stopped first."""
    import httpx

    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer

    with LocalServer(
        ("--parallel", "1", "--ctx-size", "2048", "--slo-ttft-p95-ms", "1", "--slo-shed"),
        token="unread-token",
        config="engine:\n  grace_seconds: 600\n",
    ) as server:
        client = Client(server.url, server.token)
        client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
        busy = client.open_chat_stream(
            [{"role": "user", "content": "Count upwards."}], max_tokens=1500, ignore_eos=True, temperature=0
        )
        busy_id = busy.headers["X-Completion-Id"]
        for line in busy.iter_lines():  # until its first token: the slot is taken
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        busy.close()  # the client hangs up; nobody reads the answer any more
        headers = {"Authorization": f"Bearer {server.token}"}
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        answers: list[int] = []

        def served() -> bool:
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
            answers.append(r.status_code)
            assert r.status_code in (200, 503), r.text
            return r.status_code == 200

        wait_for(served, timeout=120, interval=0.5, what="a reader served in the unread answer's slot")
        replay = httpx.get(f"{server.url}/v1/streams/{busy_id}?starting_after=0", headers=headers, timeout=60)
        chunks = [json.loads(line[6:]) for line in replay.text.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("cancelled", "stop")
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) < 1500


@pytest.mark.model
def test_with_a_fallback_model_the_request_the_objective_would_shed_is_answered_by_it(models_dir):
    import httpx

    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer
    from tests.conftest import SECOND_MODEL

    config = f"models_dir: {models_dir}\nslo:\n  fallback_model: {SECOND_MODEL}\n"
    with LocalServer(
        ("--parallel", "1", "--ctx-size", "2048", "--slo-ttft-p95-ms", "1", "--slo-shed"),
        token="fb-token",
        config=config,
    ) as server:
        client = Client(server.url, server.token)
        client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
        busy = client.open_chat_stream(
            [{"role": "user", "content": "Count upwards."}], max_tokens=1500, ignore_eos=True, temperature=0
        )
        try:
            answer = client.chat([{"role": "user", "content": "Hello"}], max_tokens=2, temperature=0)
            assert answer.model == SECOND_MODEL  # the answer says which model served it
            # The same on the other two APIs that generate.
            headers = {"Authorization": f"Bearer {server.token}"}
            for path, body in (
                ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}),
                ("/v1/responses", {"max_output_tokens": 2, "input": "Hello"}),
            ):
                r = httpx.post(server.url + path, json=body, headers=headers, timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == SECOND_MODEL
        finally:
            client.cancel(busy.headers["X-Completion-Id"])
            busy.close()


@pytest.mark.model
def test_a_second_calibration_against_the_applied_config_meets_what_the_first_recommended(tmp_path, monkeypatch):
    """calibrate --apply writes the recommendation; a server started from that file runs it, and a second
    calibration there finds the recommended level within the objective the first one wrote."""
    import json

    import yaml
    from click.testing import CliRunner

    from magnitude_jupyter.cli.main import main
    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer

    # A target any level meets on any machine: the test is about the loop, not about this machine's speed.
    sweep = ("--requests", "4", "--max-tokens", "8", "--warmup", "0", "--no-probe", "--no-archive")
    sweep += ("--latency-target-ms", "600000")
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  parallel: 2\n  ctx_size: 2048\n")
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(config))  # where --apply writes
    with LocalServer(token="apply-token", config=config.read_text()) as first:
        args = ["calibrate", "--url", first.url, "--token", "apply-token", "--concurrency", "1,2", *sweep]
        result = CliRunner().invoke(main, [*args, "--apply", "--yes"])
    assert result.exit_code == 0, result.output
    applied = yaml.safe_load(config.read_text())
    parallel = applied["engine"]["parallel"]
    assert parallel in (1, 2) and applied["engine"]["max_waiting"] == 2 * parallel
    assert applied["engine"]["ctx_size"] == 2048  # what the file held stays
    assert applied["slo"]["e2e_p95_ms"] == 600000.0 and applied["slo"]["ttft_p95_ms"] > 0

    with LocalServer(token="apply-token", config=config.read_text()) as second:
        client = Client(second.url, second.token)
        assert client.status()["parallel"] == parallel
        args = ["calibrate", "--url", second.url, "--token", "apply-token", "--concurrency", str(parallel), *sweep]
        result = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "second.json")])
        assert result.exit_code == 0, result.output
        assert json.loads((tmp_path / "second.json").read_text())["summary"]["recommended_parallel"] == parallel
        e2e = next(o for o in client.status()["slo"]["objectives"] if o["name"] == "e2e_p95_ms")
        assert e2e["holds"] is True and e2e["requests"] >= 4
