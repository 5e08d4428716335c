"""When the KV cells are compacted. llama.cpp places a step's new cells first-fit from the lowest cell
a removal freed, so a prompt or a restored entry lands in the holes that ended answers, spilled
entries and rejected drafts left, spread over many 64-cell tiles, and flash attention computes every
tile that holds one cell of a sequence. Moving every cell in use to the front (`Runner.compact_cells`)
before a step that places prompt rows puts those rows in one run beyond them instead. A compaction
copies the whole KV state, so compactions take at most a share of the engine's step time, as
measured on the machine it runs on (docs/decisions.md, "KV cells compacted before prompts")."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .metrics import EngineMetrics
from .runner_api import Runner

# Compactions may take at most this share of the time the engine's steps take.
COMPACT_SHARE = 0.05
# No compaction moves a KV state larger than this: it is held in host memory while it moves.
COMPACT_MAX_BYTES = 256 * 1024 * 1024


class CompactionFailed(RuntimeError):
    """llama.cpp did not load the KV state back: the cells every sequence held are gone."""


def compact_if_due(
    runner: Runner, metrics: EngineMetrics, places_prompt: bool, order: Sequence[int] = (), share: float = COMPACT_SHARE
) -> bool:
    """Before a step that places prompt rows, compact the KV cells while compactions have taken at
    most `share` of the steps' time, each sequence of `order` (the step's, as its rows go) in one run;
    whether cells moved."""
    if not places_prompt:
        return False
    steps = metrics.step_counts()
    if steps.compaction_seconds > share * steps.step_seconds:
        return False
    started = time.perf_counter()
    try:
        moved = runner.compact_cells(COMPACT_MAX_BYTES, order)
    except RuntimeError as exc:  # runner.RunnerError
        raise CompactionFailed(str(exc)) from exc
    metrics.record_compaction(time.perf_counter() - started, moved is not None)
    return moved is not None
