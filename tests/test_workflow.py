"""Agent-workflow calibration: the arithmetic directly, the sweep against the real server, the CLI gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from magnitude_jupyter.calibrate.workflow import (
    WorkflowResult,
    _Sample,
    format_workflow,
    run_workflow,
    session_message,
    summarize_level,
)
from magnitude_jupyter.client.http import Client

from .fakes import RecordingClient


def samples(latencies_by_round: dict[int, list[float]]) -> list[_Sample]:
    return [
        _Sample(r, s / 2, s, prompt_tokens=50 * r, cached_tokens=40 * (r - 1), output_tokens=10)
        for r, values in latencies_by_round.items()
        for s in values
    ]


def test_the_verdict_is_the_largest_session_count_whose_every_round_meets_the_slo():
    fast = summarize_level(2, samples({1: [0.5, 0.6], 2: [0.7, 0.8]}), 4.0, rounds=2, slo_ms=1000)
    slow_round = summarize_level(4, samples({1: [0.5, 0.6, 0.7, 0.8], 2: [0.9, 1.0, 1.5, 2.5]}), 8.0, 2, 1000)
    assert fast.meets_slo and not slow_round.meets_slo
    assert [r.round for r in fast.rounds] == [1, 2] and fast.output_tokens == 40
    assert fast.rounds[1].cached_tokens == 40 and fast.rounds[1].prompt_tokens == 100
    result = WorkflowResult(1000, 2, 10, (fast, slow_round))
    assert result.largest_sessions_within_slo == 2 and not result.passed
    verdict = result.verdict()
    assert "2 concurrent sessions meet the SLO" in verdict and "4 concurrent sessions FAILS" in verdict
    assert WorkflowResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    # a session that failed a request misses the SLO, whatever its latencies
    broken = summarize_level(1, [*samples({1: [0.1], 2: [0.1]}), _Sample(0, None, 0.0, 0, 0, 0)], 1.0, 2, 1000)
    assert not broken.meets_slo and broken.errors == 1
    assert "MISSED" in format_workflow(WorkflowResult(1000, 2, 10, (broken,)))


def test_every_session_says_something_different():
    firsts = {session_message(s, 0) for s in range(16)}
    assert len(firsts) == 16


@pytest.mark.model
def test_a_real_workflow_sweep_reuses_the_history(server):
    client = Client(server.url, server.token)
    seen = []
    result = run_workflow(
        client, sessions=(1, 2), rounds=3, max_tokens=8, slo_round_p95_ms=60_000, on_level=seen.append
    )
    assert [lv.sessions for lv in result.levels] == [1, 2] and seen == list(result.levels)
    for level in result.levels:
        assert level.errors == 0 and [r.round for r in level.rounds] == [1, 2, 3]
        assert level.output_tokens == level.sessions * 3 * 8
        # rounds 2 and 3 resend the history, and the prefix cache holds it
        assert level.rounds[2].prompt_tokens > level.rounds[0].prompt_tokens
        assert level.rounds[2].cached_tokens > level.rounds[0].prompt_tokens
    assert result.passed and result.largest_sessions_within_slo == 2


@pytest.mark.model
def test_the_cli_gate_fails_a_tiny_slo_and_passes_a_huge_one(server, tmp_path):
    env = {**os.environ, "MAGNITUDE_URL": server.url, "MAGNITUDE_TOKEN": server.token}

    def gate(slo_ms: str) -> subprocess.CompletedProcess:
        args = ["calibrate", "--workflow", "--sessions", "1,2", "--rounds", "2", "--max-tokens", "4"]
        args += ["--slo-round-p95-ms", slo_ms, "--json", str(tmp_path / f"w{slo_ms}.json")]
        return subprocess.run(
            [sys.executable, "-m", "magnitude_jupyter.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )

    tiny, huge = gate("1"), gate("600000")
    assert tiny.returncode == 1 and "no number of sessions met the SLO" in tiny.stdout, tiny.stdout + tiny.stderr
    assert "ask for fewer tokens per answer (max_tokens), set an objective this machine can keep" in tiny.stdout
    assert huge.returncode == 0 and "the most this run tried" in huge.stdout, huge.stdout + huge.stderr
    saved = json.loads((tmp_path / "w600000.json").read_text())
    assert saved["workflow"]["passed"] and saved["workflow"]["largest_sessions_within_slo"] == 2


@pytest.mark.model
def test_the_workflow_sweep_runs_live_in_a_notebook(connected, tmp_path):
    from .notebook_helpers import run_notebook, text_outputs

    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "%magnitude calibrate --workflow --sessions 1,2 --rounds 2 --max-tokens 4 --slo-round-p95-ms 600000",
            "w = _magnitude_calibration.workflow\nprint(w.passed, [lv.sessions for lv in w.levels])",
        ],
        tmp_path,
    )
    outputs = nb.cells[1].outputs
    # plain plotly output, updated in place: a saved notebook keeps the figure with both levels
    (plot,) = [o for o in outputs if "application/vnd.plotly.v1+json" in (o.get("data") or {})]
    figure = plot["data"]["application/vnd.plotly.v1+json"]
    assert len(figure["data"]) >= 2 and not any("widget-view" in k for o in outputs for k in o.get("data") or {})
    assert "2 concurrent sessions meet the SLO" in text_outputs(nb.cells[1])
    assert text_outputs(nb.cells[2]).strip() == "True [1, 2]"


def test_the_built_in_tools_compute_and_refuse_what_they_should():
    from magnitude_jupyter.calibrate.agent_tools import agent_task, calculator, lookup

    assert calculator("(545000 + 709000) / 2") == "627000" and calculator("2 ** 0.5") == "1.41421"
    for bad in ("__import__('os')", "9 ** 9999", "open('x')"):
        with pytest.raises(ValueError):
            calculator(bad)
    assert "population 545000" in lookup(" lisbon ") and "the table knows" in lookup("Atlantis")
    assert len({agent_task(s) for s in range(16)}) == 16


@pytest.mark.model
def test_an_agent_workflow_calls_tools_round_after_round_and_answers_last(server):
    from magnitude_jupyter.calibrate.workflow import agent_tools

    client = Client(server.url, server.token)
    result = run_workflow(client, sessions=(2,), rounds=3, max_tokens=96, slo_round_p95_ms=600_000, agent=True)
    (level,) = result.levels
    assert result.agent and level.errors == 0 and [r.round for r in level.rounds] == [1, 2, 3]
    assert level.tool_calls == 2 * 2  # every session called a tool in rounds 1 and 2, then answered
    # each round resends the call and its result: the prefix cache holds the history
    assert level.rounds[2].prompt_tokens > level.rounds[1].prompt_tokens > level.rounds[0].prompt_tokens
    assert level.rounds[2].cached_tokens >= level.rounds[1].prompt_tokens
    assert "agent workflow" in format_workflow(result) and "4 tool calls" in format_workflow(result)
    assert {t.name for t in agent_tools()} == {"calculator", "lookup"}
    assert WorkflowResult.from_json(json.loads(json.dumps(result.to_json()))) == result


@pytest.mark.parametrize("agent", [False, True])
def test_no_workflow_sends_a_conversation_again_across_levels_or_runs(agent):
    """Session 0 of one level replaying session 0 of the level before would find its whole history in
    the prefix cache and its greedy answers remembered, and flatter the level; so would a second
    calibration of the same server replaying the first."""
    client = RecordingClient()
    for _ in range(2):
        run_workflow(client, sessions=(1, 2, 4), rounds=2, max_tokens=4, agent=agent)
    # a session's first request: the system prompt and its first message
    firsts = [messages[1]["content"] for messages in client.sent if len(messages) == 2]
    assert len(firsts) == 14 and len(set(firsts)) == 14
