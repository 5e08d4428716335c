"""The prefix cache on a model with sliding-window layers (prefix_cache.py, "Sliding windows"): a
match is reused only where the window before its end is still in llama.cpp's cells, or as far as a
window checkpoint goes, no model needed. `starts` stands for llama.cpp: where each sequence's
windowed cells begin now."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine
from magnitude_jupyter.engine.kv_ops import KVOp
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.prefix_cache import Match, PrefixCache
from magnitude_jupyter.engine.ram_tier import RamTier, common_prefix_len
from magnitude_jupyter.engine.request import Request, SamplingParams
from magnitude_jupyter.engine.runner_api import apply_kv_ops

from .conftest import wait_for
from .fakes import FakeRunner, assert_cache_exact
from .test_prefix_cache import REQUEST_SEQ, apply

WINDOW = 8


def windowed_cache(starts: dict[int, int], ram_bytes: int = 0) -> PrefixCache:
    return PrefixCache(range(10, 20), ram_bytes=ram_bytes, window=WINDOW, sequence_start=lambda s: starts.get(s, 0))


def reusable(cache: PrefixCache, tokens: list[int]) -> int:
    """How much of `tokens` a request could go on from, as the scheduler asks."""
    return cache.continuable(cache.match(tokens, 99), tokens).length


def finish(runner: FakeRunner, cache: PrefixCache, tokens: list[int], match: Match | None = None) -> None:
    """A request computes `tokens` from the end of `match` and ends; its entry goes into the tree."""
    runner.end_sequence(REQUEST_SEQ)
    shared = match.length if match is not None and match.seq_id is not None else 0
    if shared:
        assert match is not None and match.seq_id is not None
        runner.copy_cells(match.seq_id, REQUEST_SEQ, 0, shared)
    runner.decode([DecodeItem(REQUEST_SEQ, tokens[shared:], shared, True)])
    ops: list[KVOp] = []
    cache.insert(tokens, REQUEST_SEQ, ops)
    apply(runner, cache, ops)
    runner.end_sequence(REQUEST_SEQ)
    cache.plan += 1  # the scheduler's next plan: the entry's cells are in llama.cpp now


def test_a_match_is_reused_while_the_window_before_its_end_is_held():
    runner, starts = FakeRunner(step_seconds=0), {}
    cache = windowed_cache(starts)
    turn = list(range(100, 140))
    finish(runner, cache, turn)
    leaf = cache.match(turn, 99).seq_id
    assert leaf is not None
    # Its end, and inside it while llama.cpp still holds every cell of the entry
    assert reusable(cache, [*turn, 5]) == 40
    assert reusable(cache, [*turn[:30], 7]) == 30
    # llama.cpp took the entry's oldest windowed cells for room: a match needs [length - 7, length)
    starts[leaf] = 26
    assert reusable(cache, [*turn[:30], 7]) == 0
    assert reusable(cache, [*turn[:33], 7]) == 33
    assert reusable(cache, [*turn, 5]) == 40


def test_an_entry_built_from_the_trees_cells_and_a_request_whose_own_start_moved_keeps_the_gap():
    runner, starts = FakeRunner(step_seconds=0), {}
    cache = windowed_cache(starts)
    system = list(range(1, 21))
    finish(runner, cache, [*system, 30, 31, 32])
    # The next request copies the system prompt, computes 40 tokens of its own, and llama.cpp has
    # dropped its windowed cells below position 50 meanwhile: below 50 the new entry has a gap.
    branch = [*system, *range(200, 240)]
    match = cache.continuable(cache.match(branch, 20), branch)
    assert match.length == 20
    starts[REQUEST_SEQ] = 50
    finish(runner, cache, branch, match)
    starts[REQUEST_SEQ] = 0
    assert reusable(cache, [*branch[:52], 9]) == 0  # needs 45..51
    assert reusable(cache, [*branch[:57], 9]) == 57  # needs 50..56
    assert reusable(cache, [*branch, 9]) == len(branch)
    # The shared system prompt is still reused through the first entry, whose cells are whole
    assert reusable(cache, [*system, 77]) == 20
    assert_cache_exact(runner, cache)


def test_a_saved_entry_comes_back_holding_only_the_window_at_its_end():
    runner, starts = FakeRunner(step_seconds=0), {}
    cache = windowed_cache(starts, ram_bytes=1 << 20)
    talk = list(range(100, 160))
    finish(runner, cache, talk)
    ops: list[KVOp] = []
    cache.clear(ops)
    apply(runner, cache, ops)
    assert cache.ram is not None and cache.ram.floors[tuple(talk)] == len(talk) - WINDOW + 1
    # llama.cpp leaves the cells the window has passed out of a saved state: only its end is of use
    partial = [*talk[:50], 3]
    usable = lambda n, floor: cache.window_start(n) >= floor  # noqa: E731 - as the scheduler asks
    assert cache.ram.best(partial, 99, usable)[:2] == ((), 0)
    tokens, n = cache.ram.best([*talk, 3], 99, usable)[:2]
    assert n == len(talk)
    floor = cache.ram.floors[tokens]
    data = cache.ram.pop(tokens)
    assert data is not None and cache.restore(tokens, data, ops, window_floor=floor)
    apply_kv_ops(runner, ops, cache.ram)
    assert reusable(cache, [*talk, 3]) == len(talk)
    assert reusable(cache, partial) == 0
    assert_cache_exact(runner, cache)


def test_a_saved_entry_that_comes_back_under_a_shared_prefix_keeps_the_trees_whole_window_below_it():
    """Restored below the system prompt the tree holds, an entry's windowed cells are the tree's (whole)
    there and the saved ones above: the next turn goes on from its end, not from scratch."""
    runner, starts = FakeRunner(step_seconds=0), {}
    cache = windowed_cache(starts, ram_bytes=1 << 20)
    system = list(range(1, 21))
    first, second = [*system, 30, 31, 32, 33], [*system, 40, 41, 42, 43]
    finish(runner, cache, first)
    finish(runner, cache, second, cache.continuable(cache.match(second, 20), second))
    ops: list[KVOp] = []
    assert cache.evict_one([(first, len(first))], ops)  # the second entry goes to the RAM tier
    apply(runner, cache, ops)
    assert reusable(cache, [*second, 9]) == 20
    assert cache.ram is not None
    tokens, n = cache.ram.best([*second, 9], 99)[:2]
    assert n == len(second)
    floor = cache.ram.floors[tokens]  # its window's start: above the shared prompt's end, inside it
    assert floor <= 20
    data = cache.ram.pop(tokens)
    assert data is not None and cache.restore(tokens, data, ops, window_floor=floor)
    apply_kv_ops(runner, ops, cache.ram)
    assert reusable(cache, [*second, 9]) == len(second)
    assert_cache_exact(runner, cache)


def test_without_a_window_every_match_is_reused():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    turn = list(range(100, 140))
    finish(runner, cache, turn)
    assert reusable(cache, [*turn[:3], 7]) == 3


def test_ctx_size_auto_gives_the_windowed_layers_their_windows_and_the_rest_to_context(tmp_path):
    import dataclasses

    from magnitude_jupyter.config import ConfigError, EngineSettings
    from magnitude_jupyter.engine.memory import KV_PADDING, _buffers, plan_kv, plan_memory, size_context
    from magnitude_jupyter.models.registry import read_model_info
    from magnitude_jupyter.models.tiny_models import write_tiny_model

    info = read_model_info(write_tiny_model(tmp_path / "tiny-gemma3.gguf", "gemma3"))  # window 64, 5 of 6 layers
    es = EngineSettings(
        parallel=2, prefix_cache_entries=4, prefix_cache_ram_mib=0, ctx_size="auto", flash_attention=True
    )
    layout = plan_kv(info, dataclasses.replace(es, ctx_size=4096))
    # 2 slots x 64 + 512, in blocks of 256: the cache's 4 entries take their ids from the slots
    assert (layout.window, layout.window_cells) == (64, 768)
    assert layout.bytes == 4096 * layout.global_bytes_per_token + 768 * layout.window_bytes_per_token
    budget = info.file_size + _buffers(info, es) + 768 * layout.window_bytes_per_token + 6000 * 128
    sizing = size_context(info, dataclasses.replace(es, memory_budget=int(budget)), 0)
    fits = [
        c
        for c in range(KV_PADDING, 8193, KV_PADDING)
        if plan_kv(info, es, c).bytes <= budget - info.file_size - _buffers(info, es)
    ]
    assert sizing.cells == fits[-1] == 5888
    assert "window cells" in sizing.reason and "(window 64 x 2 sequences + a batch)" in sizing.reason
    plan = plan_memory(info, dataclasses.replace(es, ctx_size=sizing.cells))
    assert plan.kv_cache == plan_kv(info, es, sizing.cells).bytes and plan.resident <= budget
    # With full-size windows every layer holds every cell: the same budget holds 1,536, short of one sequence
    with pytest.raises(ConfigError, match="1,536 cells at 768 bytes/token"):
        size_context(info, dataclasses.replace(es, memory_budget=int(budget), swa_full=True), 0)


def test_calibrations_capacity_counts_a_window_per_session(tmp_path):
    from magnitude_jupyter.calibrate.capacity import capacity_report
    from magnitude_jupyter.models.registry import read_model_info
    from magnitude_jupyter.models.tiny_models import write_tiny_model

    meta = read_model_info(write_tiny_model(tmp_path / "tiny-gemma3.gguf", "gemma3")).to_json()
    window = {"window": 64, "cells": 1024, "bytes_per_token": 640.0}
    status = {"kv_cells_total": 2048, "parallel": 2, "kv_window": window, "kv_bytes_planned": 2048 * 128 + 1024 * 640}
    report = capacity_report(meta, status, memory_bytes=2**20)
    assert report is not None and (report.bytes_per_token, report.window, report.window_bytes_per_token) == (
        128,
        64,
        640,
    )
    row = report.table[0]  # sessions of 512 tokens: each in the global layer, the last 64 in the windowed ones
    assert row["bytes_per_session"] == 512 * 128 + 64 * 640 and row["sessions"] == 2**20 // (512 * 128 + 64 * 640)
    assert report.predicted_kv_buffer_bytes == 2048 * 128 + 1024 * 640
    # A server that keeps full-size windows (no kv_window) is counted as full attention
    full = capacity_report(meta, {**status, "kv_window": None}, memory_bytes=2**20)
    assert full is not None and full.bytes_per_token == 768 and full.table[0]["bytes_per_session"] == 512 * 768


def test_an_entry_that_branches_off_takes_the_trees_whole_cells_below_the_branch():
    runner, starts = FakeRunner(step_seconds=0), {}
    cache = windowed_cache(starts)
    system = list(range(1, 21))
    finish(runner, cache, [*system, *range(30, 60)])
    # A short answer after the shared prompt: the request's own cells start at 10 (llama.cpp took
    # older ones), but below the branch (20) the new entry's cells are the first entry's, whole
    branch = [*system, 7, 8, 9]
    starts[REQUEST_SEQ] = 10
    finish(runner, cache, branch, cache.continuable(cache.match(branch, 20), branch))
    starts[REQUEST_SEQ] = 0
    match = cache.continuable(cache.match([*branch, 5], 99), [*branch, 5])
    leaf = cache.match(branch, 99).path[-1]
    assert match.length == 23 and match.seq_id == leaf.seq_id and leaf.window_floor == 0
    assert_cache_exact(runner, cache)


def test_window_checkpoints_and_saved_entries_share_the_ram_tier_checkpoints_giving_way_to_entries():
    ram = RamTier(100)
    ram.put((1, 2, 3), b"x" * 40)
    ram.put_window((1, 2), b"w" * 30)
    ram.put_window((1, 2, 3, 4, 5), b"v" * 20)
    prompt = [1, 2, 3, 4, 5, 6]
    assert ram.window_for(prompt, 0, 5) == (5, b"v" * 20)
    assert ram.window_for(prompt, 0, 4) == (2, b"w" * 30)  # at most `limit` tokens; now the latest used
    assert ram.window_for(prompt, 2, 4) is None  # more than `above` tokens
    assert ram.window_for([1, 9, 3, 4, 5], 0, 5) is None
    ram.put((7,), b"y" * 30)  # 120 bytes: the least recently used checkpoint goes, not the older entry
    assert list(ram.entries) == [(1, 2, 3), (7,)] and set(ram.windows) == {(1, 2)} and ram.bytes == 100
    ram.put_window((8,), b"z" * 40)  # a checkpoint makes room from whatever was used least recently
    assert list(ram.entries) == [(7,)] and set(ram.windows) == {(1, 2), (8,)} and ram.bytes == 100
    ram.put((9,), b"u" * 80)  # checkpoints first, then the least recently used entry
    assert list(ram.entries) == [(9,)] and not ram.windows and ram.bytes == 80


def windowed_engine(runner: FakeRunner, window: int = WINDOW, parallel: int = 2, ctx_size: int = 512) -> Engine:
    """An engine whose fake llama.cpp keeps each sequence's windowed cells for its last `window`
    positions only, as a busy sliding-window cache does. Idle entries stay in cells until an id or
    cells are needed (these tests are about which entry gives way, not about the idle clock)."""
    runner.sliding_window = window
    runner.sequence_start = lambda seq: max(0, max(runner.seqs.get(seq) or {0: 0}) - window + 1)  # type: ignore[method-assign]
    return Engine(
        settings=Settings(),
        runner_factory=lambda es: runner,
        parallel=parallel,
        ctx_size=ctx_size,
        n_batch=16,
        prefix_cache_spill_rows=0,
    ).start()


def test_a_turn_that_parts_from_the_last_answer_goes_on_from_the_window_checkpoint_its_prompt_left():
    runner = FakeRunner(n_ctx=512, step_seconds=0)
    engine = windowed_engine(runner)
    try:
        prompt = list(range(100, 140))
        engine.generate(prompt_tokens=prompt, params=SamplingParams(max_tokens=20))
        assert engine.stats().scheduler.prefix_cache_window_checkpoints == 1
        # The answer comes back otherwise: the match ends at the prompt's end, whose window has gone
        turn = engine.generate(prompt_tokens=[*prompt, 7, 8, 9], params=SamplingParams(max_tokens=3))
        status = engine.stats().scheduler
        assert turn.counts.cached == 40 and len(runner.windows_loaded) == 1
        assert status.prompt_tokens_window_checkpoint == 40 and turn.token_ids == [10, 11, 12]
        # llama.cpp finds no cells for a checkpoint: that request computes its prompt whole, the same
        runner.refuse_window_once = True
        again = engine.generate(prompt_tokens=[*prompt, 7, 8, 20], params=SamplingParams(max_tokens=3))
        status = engine.stats().scheduler
        assert again.counts.cached == 0 and again.token_ids == [21, 22, 23]
        assert status.prompt_tokens_window_checkpoint == 40 and len(runner.windows_loaded) == 1
    finally:
        engine.shutdown()


def test_a_windowed_models_entries_take_their_ids_from_the_request_slots():
    """llama.cpp gives a windowed layer a window per sequence id: the cache's entries hold the slots'
    own ids (two here), a conversation goes on in the sequence its last turn left, and entries that
    need an id more than they do go to the RAM tier and come back."""
    runner = FakeRunner(n_ctx=512, step_seconds=0)
    engine = windowed_engine(runner)  # parallel 2
    try:
        talks = [list(range(100 + 50 * i, 140 + 50 * i)) for i in range(3)]
        firsts = [engine.generate(prompt_tokens=t, params=SamplingParams(max_tokens=5)) for t in talks]
        assert engine.stats().scheduler.prefix_cache_entries == 2  # the third took the first's id
        copies = len(runner.copies)
        for talk, first in zip(talks, firsts, strict=True):
            turn = engine.generate(prompt_tokens=[*talk, *first.token_ids, 7, 8], params=SamplingParams(max_tokens=3))
            # its prompt and the answer's computed tokens: in the sequence it was handed, or restored
            assert turn.counts.cached == len(talk) + 4
        assert set(runner.started) <= {0, 1} and set(runner.seqs) <= {0, 1}
        assert runner.restored >= 1  # the first conversation came back from the RAM tier
        assert len(runner.copies) == copies  # no request copied a cache entry: each was handed its sequence
    finally:
        engine.shutdown()


def test_a_conversations_next_turn_takes_its_entrys_sequence_with_another_id_free():
    """A copy would keep the entry's id held beside the request's, for the same cells; a windowed
    model's ids are its request slots."""
    runner = FakeRunner(n_ctx=512, step_seconds=0)
    engine = windowed_engine(runner)  # parallel 2
    try:
        talk = list(range(100, 140))
        first = engine.generate(prompt_tokens=talk, params=SamplingParams(max_tokens=5))
        copies = len(runner.copies)
        turn = engine.generate(prompt_tokens=[*talk, *first.token_ids, 7, 8], params=SamplingParams(max_tokens=3))
        assert turn.counts.cached == len(talk) + 4
        assert len(runner.copies) == copies  # handed its sequence, not a copy of it
        assert engine.stats().scheduler.prefix_cache_entries == 1
    finally:
        engine.shutdown()


def test_a_next_turn_takes_the_entry_running_requests_share_its_system_prompt_with():
    """The last entry under a shared system prompt holds that prompt's cells for the requests that
    copied it: its own conversation's next turn still takes its sequence (keeping those cells) and
    runs beside them, rather than waiting for them to end."""
    runner = FakeRunner(n_ctx=512, step_seconds=0.02)  # the long request lasts seconds: a margin
    engine = windowed_engine(runner, window=128)  # parallel 2: two ids; every prompt inside a window
    try:
        system = list(range(100, 164))
        talks = [[*system, *range(base, base + 10)] for base in (200, 300)]
        firsts = [engine.generate(prompt_tokens=t, params=SamplingParams(max_tokens=5)) for t in talks]
        long = engine.submit(prompt_tokens=[*system, 400, 401], params=SamplingParams(max_tokens=400))
        assert long.stream is not None and wait_for(lambda: long.output_tokens, what="the long request to start")
        # It took one entry's id; the other entry now holds the system prompt it shares.
        assert engine.scheduler is not None and engine.scheduler.cache is not None
        (kept,) = [i for i, t in enumerate(talks) if engine.scheduler.cache.match(t, len(t)).length == len(t)]
        talk, first = talks[kept], firsts[kept]
        turn = engine.generate(prompt_tokens=[*talk, *first.token_ids, 7, 8], params=SamplingParams(max_tokens=3))
        assert long.finish_reason is None  # it ran beside the long request, not after it
        assert turn.counts.cached == len(talk) + 4
        long.stream.wait_final(60)
        assert long.finish_reason is not None and long.finish_reason.value == "length"
    finally:
        engine.shutdown()


def test_an_entry_running_requests_share_gives_its_id_to_a_turn_whose_own_entry_the_ram_tier_holds():
    """Every id held, by running requests and the entry holding the system prompt they copied: the next
    turn of a conversation moved to the RAM tier brings its entry back into that entry's id and runs
    beside them; the system prompt's cells stay counted, once, until the last of them ends."""
    runner = FakeRunner(n_ctx=1024, step_seconds=0.02)  # the long requests last seconds: a margin
    engine = windowed_engine(runner, window=128, parallel=3, ctx_size=1024)  # every prompt inside a window
    try:
        system = list(range(100, 164))
        talks = [[*system, *range(base, base + 10)] for base in (200, 300, 500)]
        firsts = [engine.generate(prompt_tokens=t, params=SamplingParams(max_tokens=5)) for t in talks]
        scheduler = engine.scheduler
        assert scheduler is not None and scheduler.cache is not None
        # Copies the system prompt; the oldest entry (the first conversation's) gives it its id.
        long = engine.submit(prompt_tokens=[*system, 400, 401], params=SamplingParams(max_tokens=300))
        assert long.stream is not None and wait_for(lambda: long.output_tokens, what="the long request to start")
        (moved,) = [i for i, t in enumerate(talks) if scheduler.cache.match(t, 99).length == len(system)]
        # Another conversation goes on in its entry's sequence: the last entry holds the system prompt.
        other = next(i for i in range(3) if i != moved)
        going = engine.submit(
            prompt_tokens=[*talks[other], *firsts[other].token_ids, 7, 8], params=SamplingParams(max_tokens=200)
        )
        assert going.stream is not None and wait_for(lambda: going.output_tokens, what="the next turn to start")
        turn = engine.generate(
            prompt_tokens=[*talks[moved], *firsts[moved].token_ids, 7, 8], params=SamplingParams(max_tokens=3)
        )
        assert long.finish_reason is None and going.finish_reason is None  # it ran beside them
        assert turn.counts.cached == len(talks[moved]) + 4 and runner.restored >= 1
        assert scheduler.budget.held == len(system)  # their copies of it, counted once
        going.stream.wait_final(60)
        long.stream.wait_final(60)
        wait_for(lambda: scheduler.budget.held == 0, what="the hold to go")
    finally:
        engine.shutdown()


def test_the_ram_tier_counts_as_holding_more_only_where_a_restore_would_bring_it_back():
    """With no id free, an entry running requests share is evicted for a waiting turn only if the RAM
    tier holds more of the turn's prompt: as the restore itself decides, a saved entry whose kept
    window lies above where the prompt parts from it holds nothing for it."""
    engine = windowed_engine(FakeRunner(n_ctx=512, step_seconds=0))
    try:
        scheduler = engine.scheduler
        assert scheduler is not None and scheduler.cache is not None and scheduler.cache.ram is not None
        saved = list(range(100, 140))
        scheduler.cache.ram.put(tuple(saved), b"state", window_floor=len(saved) - WINDOW + 1)

        def turn(prompt: list[int]) -> Request:
            return Request(request_id="turn", prompt_tokens=prompt, params=SamplingParams(), max_tokens=4)

        parted = [*saved[:20], 600, 601]
        assert scheduler.cache.ram.best(parted, 99).length == 20  # it shares 20 tokens, below the window
        assert not scheduler._ram_gives_more(turn(parted), 4)
        assert scheduler._ram_gives_more(turn([*saved, 7, 8]), 4)  # a turn going on from its end
        assert not scheduler._ram_gives_more(turn([*saved, 7, 8]), len(saved) - 1)  # no more than the tree
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_windowed_conversations_never_hold_more_cells_than_the_budget_counts(seed):
    """Conversations sharing a system prompt on a windowed model, more of them than ids, turns of
    random lengths: after every step llama.cpp's cells in use are within what the budget counts
    (hand-overs, evictions and holds included), and at the end no hold is left and the cache is exact."""
    rng = random.Random(seed)
    runner = FakeRunner(n_ctx=1024, step_seconds=0.001)
    engine = windowed_engine(runner, window=128, parallel=3, ctx_size=1024)  # every prompt inside a window
    scheduler = engine.scheduler
    assert scheduler is not None and scheduler.cache is not None
    steps: list[tuple[int, int]] = []  # (cells in use, cells the budget counts) after each step
    decode = runner.decode

    def counted_decode(items: list[DecodeItem]) -> list[int | None]:
        rows = decode(items)
        steps.append((runner.live_cells(), scheduler.budget.used))
        return rows

    runner.decode = counted_decode  # type: ignore[method-assign]
    system = list(range(100, 164))
    plans = [(1000 + 100 * i, [rng.randint(2, 12) for _ in range(3)]) for i in range(6)]

    def converse(base: int, answers: list[int]) -> None:
        tokens = [*system, *range(base, base + 10)]
        for turn, max_tokens in enumerate(answers):
            result = engine.generate(prompt_tokens=tokens, params=SamplingParams(max_tokens=max_tokens))
            tokens = [*tokens, *result.token_ids, 7, 20 + turn]

    try:
        talks = [threading.Thread(target=converse, args=plan) for plan in plans]
        for talk in talks:
            talk.start()
        for talk in talks:
            talk.join(120)
        assert not any(talk.is_alive() for talk in talks)
        assert steps and all(live <= counted for live, counted in steps), [s for s in steps if s[0] > s[1]][:3]
        wait_for(lambda: not scheduler.running and scheduler.budget.held == 0, what="every hold to go")
    finally:
        engine.shutdown()
    assert_cache_exact(runner, scheduler.cache)  # the engine stopped: nothing moves entries now


def test_entries_holding_every_id_never_keep_requests_from_running_side_by_side():
    runner = FakeRunner(n_ctx=512, step_seconds=0.01)
    engine = windowed_engine(runner)
    try:
        for base in (100, 200):  # two entries: both ids held
            engine.generate(prompt_tokens=list(range(base, base + 30)), params=SamplingParams(max_tokens=3))
        assert engine.stats().scheduler.prefix_cache_entries == 2
        runner.calls.clear()
        requests = [
            engine.submit(prompt_tokens=list(range(base, base + 30)), params=SamplingParams(max_tokens=20))
            for base in (300, 400)
        ]
        for request in requests:
            assert request.stream is not None
            request.stream.wait_final(30)
        assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in requests)
        assert max(len(call) for call in runner.calls) == 2  # they decoded together
        assert set(runner.seqs) <= {0, 1}
    finally:
        engine.shutdown()


@pytest.mark.model
@pytest.mark.parametrize("window", [512, 1024])
def test_a_windowed_models_kv_cache_is_the_size_llama_server_gives_it(tmp_path, window):
    """`--parallel 4 --ctx-size 8192` on a windowed model: llama.cpp's KV buffer is what llama-server
    makes for `-np 4 --kv-unified -c 8192` (its arithmetic written out here), and the plan says the same;
    then a conversation on it reuses its last turn."""
    from magnitude_jupyter.cli.models import _model_details
    from magnitude_jupyter.config import EngineSettings
    from magnitude_jupyter.engine.memory import plan_kv
    from magnitude_jupyter.models.kvmath import kv_bytes_per_token
    from magnitude_jupyter.models.registry import read_model_info, resolve_model
    from magnitude_jupyter.models.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny-gemma3.gguf", "gemma3", sliding_window=window)
    info = read_model_info(path)
    engine = Engine(str(path), settings=Settings(), parallel=4, ctx_size=8192, flash_attention=True).start()
    try:
        windowed = info.windowed_layers
        glob = kv_bytes_per_token(info, "f16", "f16", [not w for w in windowed])
        swa = kv_bytes_per_token(info, "f16", "f16", windowed)
        # llama-server: window x 4 sequences + a 512-token ubatch, in blocks of 256, within the context
        swa_cells = min(8192, -(-(window * 4 + 512) // 256) * 256)
        llama_server = 8192 * glob + swa_cells * swa
        stats = engine.stats()
        assert stats.kv_buffer_bytes_reported == pytest.approx(llama_server, rel=0.05)
        assert plan_kv(info, engine.engine_settings).bytes == pytest.approx(llama_server, rel=0.05)
        # `magnitude list --show-details` plans the same for these settings
        settings = Settings(engine=EngineSettings(parallel=4, ctx_size=8192), models_dir=tmp_path)
        details = _model_details(resolve_model(str(path), settings), settings)
        assert details["kv_cache_planned"]["bytes"] == pytest.approx(llama_server, rel=0.05)
        prompt = "The sky is blue and the grass is green. " * 40
        first = engine.generate(prompt, params=SamplingParams(max_tokens=8, temperature=0))
        again = engine.generate(prompt + first.text + " And", params=SamplingParams(max_tokens=4, temperature=0))
        assert again.counts.cached >= first.counts.prompt
    finally:
        engine.shutdown()


def test_of_saved_entries_that_share_as_much_of_a_prompt_the_longest_comes_back():
    """A conversation's earlier turns are saved entries too; the prompt of its next turn spells the
    last answers otherwise (the tokenizer's tokens, not the model's), so several entries share the
    same tokens with it. The latest turn, the longest, holds what the respelling walks on."""
    ram = RamTier(1000)
    first_turn = (1, 2, 3, 40, 41)  # the model's spelling of its answer starts at 40
    second_turn = (1, 2, 3, 40, 41, 42, 7, 8, 9, 50, 51)
    ram.put(first_turn, b"a" * 10)
    ram.put(second_turn, b"b" * 10)
    ram.put((1, 2, 9), b"c" * 10)
    prompt = [1, 2, 3, 44, 45, 7, 8, 9, 52, 53]  # the answer's text tokenized otherwise: 44, 45
    found = ram.best(prompt, 99)
    assert (found.tokens, found.length) == (second_turn, 3)
    assert (found.longest_tokens, found.longest) == (second_turn, 3)
    assert ram.best(prompt, 99, lambda n, floor: False)[:2] == ((), 0)


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.lists(st.integers(0, 3), max_size=40),
    st.one_of(st.none(), st.integers(0, 50)),
)
def test_the_shared_prefix_is_what_a_token_by_token_walk_finds(a, b, limit):
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    walked = next((i for i in range(n) if a[i] != b[i]), n)
    assert common_prefix_len(a, b, limit) == common_prefix_len(tuple(a), b, limit) == walked
