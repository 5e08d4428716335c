"""When a step compacts the KV cells first (compaction.py): the policy, on the fake runner."""

from __future__ import annotations

from collections.abc import Sequence

from magnitude_jupyter.engine.compaction import COMPACT_SHARE, compact_if_due
from magnitude_jupyter.engine.metrics import EngineMetrics

from .fakes import FakeRunner


class Moving(FakeRunner):
    def compact_cells(self, max_bytes: int, order: Sequence[int] = ()) -> int | None:
        self.compactions += 1
        return 1024


def test_a_step_that_places_prompt_rows_compacts_while_compactions_stay_within_their_share():
    runner, metrics = Moving(), EngineMetrics()
    assert not compact_if_due(runner, metrics, places_prompt=False)  # decode rows only: never
    assert runner.compactions == 0
    assert compact_if_due(runner, metrics, places_prompt=True)  # no time spent on it yet
    assert metrics.step_counts().compactions == 1
    metrics.record_step_time(1.0)
    metrics.record_compaction(COMPACT_SHARE * 2, True)  # twice its share of the steps' time
    assert not compact_if_due(runner, metrics, places_prompt=True)
    metrics.record_step_time(3.0)  # the steps' time grew past it
    assert compact_if_due(runner, metrics, places_prompt=True)
    assert runner.compactions == 2


def test_a_check_that_finds_nothing_to_move_counts_its_time_but_no_compaction():
    runner, metrics = FakeRunner(), EngineMetrics()
    assert not compact_if_due(runner, metrics, places_prompt=True)
    assert runner.compactions == 1 and metrics.step_counts().compactions == 0
