"""One step's plan carried out on the runner: the decodes, then each chunk's picks (drafts confirmed
or cut). Engine thread only; what the picks mean for each request is the engine's `_update`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from .anchors import NEAR_TIE
from .metrics import EngineMetrics
from .plan import DecodeItem, ScheduledChunk, SchedulerOutput
from .runner_api import GrammarDeadEnd, NoRoomForBatch, Runner, Sampled

log = logging.getLogger(__name__)


def execute_plan(
    runner: Runner,
    out: SchedulerOutput,
    metrics: EngineMetrics,
    solo_threads: int | None,
    make_room: Callable[[], bool] = lambda: False,
) -> list[list[Sampled]]:
    """Decode the plan: the batched chunks in one call, each reproducible chunk in its own. Per
    chunk, the tokens sampled after it: none for a prompt chunk that does not end its prompt, one
    for a decode step, and with a draft, one more for each draft token the picks confirm.
    `solo_threads`: the thread count to restore after a reproducible one-token step run on one
    thread (None: such steps run on the usual threads, see `decode_solo`). When llama.cpp finds no
    cells for the batched call, see `decode_batched`: the step may then compute fewer prompt rows
    (its chunks are cut in place, or left out of `out.batched`)."""
    sampled: list[list[Sampled]] = []
    groups = ([out.batched] if out.batched else []) + [[chunk] for chunk in out.solo]
    for group in groups:
        started = time.perf_counter()
        if group is out.batched:
            rows = decode_batched(runner, group, make_room)
            seconds = time.perf_counter() - started
        else:
            rows = decode_solo(runner, [chunk.item() for chunk in group], solo_threads)
            seconds = time.perf_counter() - started
        n_rows = sum(len(chunk.tokens) for chunk in group)
        if n_rows:
            metrics.record_decode(n_rows, prompt_rows(group), seconds)
        for chunk, row in zip(group, rows, strict=True):
            picks: list[Sampled] = []
            if row is not None:
                for i in range(len(chunk.draft) + 1):
                    expected = chunk.expected[i] if i < len(chunk.expected) else None
                    picks.append(sample(runner, chunk, row + i, expected))
                    if i == len(chunk.draft) or picks[-1].dead_end or picks[-1].token != chunk.draft[i]:
                        break
                if chunk.draft:
                    # The drafts after the first mismatch were computed on a wrong guess: their cells go.
                    end = chunk.start_pos + len(chunk.tokens)
                    runner.drop_cells(chunk.seq_id, end - len(chunk.draft) + len(picks) - 1, end)
            sampled.append(picks)
    return sampled


def decode_batched(runner: Runner, group: list[ScheduledChunk], make_room: Callable[[], bool]) -> list[int | None]:
    """The batched call. When llama.cpp finds no cells for it (nothing computed), `make_room` frees
    what the cache can spare (False: nothing) and the call runs again; while it still finds none, the
    step's prompt rows are halved, the later chunks cut first, as llama-server halves its batch: a
    sliding-window cache can hold cells two sequences share past both their windows (docs/decisions.md,
    "Sliding-window layers"). A request whose prompt chunk is cut goes on from there at the next
    step; one cut to nothing leaves the step. NoRoomForBatch when not even the decode rows fit."""
    with contextlib.suppress(NoRoomForBatch):
        return runner.decode([chunk.item() for chunk in group])
    if make_room():
        with contextlib.suppress(NoRoomForBatch):
            return runner.decode([chunk.item() for chunk in group])
    while rows := prompt_rows(group):
        log.info("llama.cpp found no KV cells for %d prompt rows: the step computes half", rows)
        keep_prompt_rows(group, rows // 2)
        with contextlib.suppress(NoRoomForBatch):
            return runner.decode([chunk.item() for chunk in group])
    raise NoRoomForBatch("llama.cpp found no KV cells for the step's decode rows")


def prompt_rows(group: list[ScheduledChunk]) -> int:
    """The rows of a step's chunks that compute prompts (not yet in the cache before the step)."""
    return sum(len(chunk.tokens) for chunk in group if not chunk.request.prompt_done)


def keep_prompt_rows(group: list[ScheduledChunk], keep: int) -> None:
    """Cut the prompt chunks of a step to `keep` rows in all, the earlier chunks kept first: a cut
    chunk no longer ends its prompt (nothing is sampled after it), and one cut to nothing leaves."""
    kept: list[ScheduledChunk] = []
    for chunk in group:
        if chunk.request.prompt_done:
            kept.append(chunk)
            continue
        n = min(len(chunk.tokens), keep)
        keep -= n
        if n == len(chunk.tokens):
            kept.append(chunk)
        elif n:
            chunk.tokens = chunk.tokens[:n]
            chunk.sample = False
            kept.append(chunk)
    group[:] = kept


def sample(runner: Runner, chunk: ScheduledChunk, row: int, expected: int | None = None) -> Sampled:
    """The pick of one logits row. `expected`: the token an earlier answer to the same greedy request
    put here (anchors.py); it is taken where the model's own pick beats it by less than NEAR_TIE."""
    try:
        token = runner.sample(chunk.seq_id, row)
    except GrammarDeadEnd as end:  # this request ends; the others in the step go on
        return Sampled(-1, dead_end=str(end), complete=end.complete)
    if expected is not None and token != expected and runner.logit_gap(row, expected, token) > -NEAR_TIE:
        token = expected
    params = chunk.request.params
    # Read from this step's logits row before the next decode overwrites it.
    logprob = runner.token_logprobs(row, token, params.top_logprobs) if params.logprobs else None
    return Sampled(token, logprob)


def decode_solo(runner: Runner, items: list[DecodeItem], restore_threads: int | None) -> list[int | None]:
    """A reproducible request's chunk, in its lane (runner.Lane). With flash attention its one-token
    steps run on one thread: llama.cpp's CPU flash attention splits 512 cells or more into one piece
    per thread and merges them, so the result would depend on the thread count, which changes with
    load; a single piece is bit-identical to the unsplit pass over fewer cells. Its matrix products
    compute each value on one thread, whatever the count."""
    if len(items[0].tokens) != 1 or restore_threads is None:
        return runner.decode(items)
    runner.set_threads(1)
    try:
        return runner.decode(items)
    finally:
        runner.set_threads(restore_threads)
