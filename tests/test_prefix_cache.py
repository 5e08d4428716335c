"""The prefix cache's tree against a model of llama.cpp's cells (tests/fakes.py): exact, with no model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from magnitude_jupyter.engine.kv_ops import KVOp
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS, PrefixCache
from magnitude_jupyter.engine.ram_tier import RamTier
from magnitude_jupyter.engine.runner_api import apply_kv_ops

from .fakes import FakeRunner, assert_cache_exact

REQUEST_SEQ = 0  # the request slot the tests compute tokens in


def apply(runner: FakeRunner, cache: PrefixCache, ops: list[KVOp]) -> None:
    """What the engine does with the cache's operations (the engine's own function)."""
    apply_kv_ops(runner, ops, cache.ram)
    ops.clear()


def finish(runner: FakeRunner, cache: PrefixCache, tokens: list[int], copied_from: int | None = None, shared: int = 0):
    """A request computes `tokens` (after copying `shared` of them from a cache entry) and ends."""
    runner.end_sequence(REQUEST_SEQ)
    if shared:
        assert copied_from is not None
        runner.copy_cells(copied_from, REQUEST_SEQ, 0, shared)
    runner.decode([DecodeItem(REQUEST_SEQ, tokens[shared:], shared, True)])
    ops: list[KVOp] = []
    cache.insert(tokens, REQUEST_SEQ, ops)
    apply(runner, cache, ops)
    runner.end_sequence(REQUEST_SEQ)


def test_a_conversation_grows_one_entry_and_matches_every_turn():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    turn1 = list(range(100, 140))
    finish(runner, cache, turn1)
    assert cache.entries == 1 and cache.match([*turn1, 5], 99).length == 40
    turn2 = turn1 + list(range(200, 230))
    match = cache.match(turn2, len(turn2) - 1)
    finish(runner, cache, turn2, copied_from=match.seq_id, shared=match.length)
    assert cache.entries == 1 and cache.cells == 70  # the same entry, grown: no cell twice
    assert_cache_exact(runner, cache)


def test_diverging_prompts_share_their_common_head_once():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    system = list(range(1, 31))
    a, b, c = [*system, 40, 41, 42], [*system, 50, 51], [*system, 40, 41, 60]
    for tokens in (a, b, c):
        match = cache.match(tokens, len(tokens))
        finish(runner, cache, tokens, copied_from=match.seq_id, shared=match.length)
    assert cache.entries == 3
    assert cache.cells == 30 + 3 + 2 + 1  # the system prompt's cells exist once
    assert cache.match([*system, 40, 41, 99], 99).length == 32
    assert_cache_exact(runner, cache)


def test_eviction_takes_the_least_recently_used_unpinned_leaf_and_folds_its_parent():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    head = list(range(1, 21))
    old, pinned, fresh = [*head, 31, 32], [*head, 41, 42, 43], list(range(500, 510))
    for tokens in (old, pinned, fresh):
        finish(runner, cache, tokens)
    ops: list[KVOp] = []
    # `pinned` is in use by a running request that copied all of it: it must stay
    freed = cache.evict(2, ops, pinned=[(pinned, len(pinned))])
    apply(runner, cache, ops)
    assert freed == 2 and cache.match(old, 99).length == 20 and cache.match(pinned, 99).length == 23
    assert_cache_exact(runner, cache)  # `head` folded into the surviving leaf, held by its sequence
    cache.evict(10**6, ops, pinned=[(pinned, len(pinned))])
    apply(runner, cache, ops)
    assert cache.entries == 1 and cache.match(pinned, 99).length == 23
    assert_cache_exact(runner, cache)


def test_out_of_sequence_ids_the_oldest_entry_makes_room():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 12))
    for start in (100, 200, 300):
        finish(runner, cache, list(range(start, start + 10)))
    assert cache.entries == 2 and cache.match(list(range(100, 110)), 99).length == 0
    assert cache.match(list(range(300, 310)), 99).length == 10
    assert_cache_exact(runner, cache)


def test_the_ram_tier_brings_an_evicted_conversation_back():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20), ram_bytes=1 << 20)
    system = list(range(1, 21))
    talk = system + list(range(100, 150))
    other = [*system, 7, 8, 9]
    finish(runner, cache, talk)
    finish(runner, cache, other)
    ops: list[KVOp] = []
    cache.evict(50, ops, pinned=[(other, len(other))])
    apply(runner, cache, ops)
    assert cache.match(talk, 999).length == 20 and runner.saved == 1
    tokens, n = cache.ram.best([*talk, 5], 999)[:2]
    assert n == len(talk)
    assert cache.restore(tokens, cache.ram.pop(tokens), ops)
    apply(runner, cache, ops)
    assert cache.match(talk, 999).length == len(talk) and runner.restored == 1
    assert_cache_exact(runner, cache)  # the shared system prompt is the tree's own cells, not a second copy


def test_random_workloads_keep_the_tree_exact():
    rng = random.Random(7)
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 18), ram_bytes=1 << 16)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    for _ in range(300):
        action = rng.random()
        if action < 0.7:
            tokens = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            match = cache.match(tokens, len(tokens) - 1)
            finish(runner, cache, tokens, copied_from=match.seq_id, shared=match.length)
            if rng.random() < 0.3:
                prefixes.append(tokens)
        elif action < 0.9:
            ops: list[KVOp] = []
            cache.evict(rng.randrange(1, 60), ops)
            apply(runner, cache, ops)
        elif cache.ram is not None and cache.ram.entries:
            tokens = rng.choice(list(cache.ram.entries))
            ops = []
            if cache.match(tokens, len(tokens)).length < len(tokens) and cache.restore(
                tokens, cache.ram.pop(tokens), ops
            ):
                apply(runner, cache, ops)
        assert_cache_exact(runner, cache)


def test_an_idle_entry_moves_to_the_ram_tier_and_a_shared_or_used_one_stays():
    cache = PrefixCache(range(10, 20), ram_bytes=1 << 20, spill_after_rows=64)
    runner = FakeRunner(step_seconds=0)
    system = list(range(1, 21))
    idle, busy, running = system + list(range(100, 140)), system + list(range(200, 240)), [*system, 7, 8, 9]
    for tokens in (idle, busy, running):
        finish(runner, cache, tokens)
    pins = [(running, len(running))]  # a request runs on the third entry's cells
    ops: list[KVOp] = []
    assert cache.spill_idle(54, ops, pins) == 0  # not idle for long enough yet
    cache.touch(cache.match(busy, 999))  # the second one is used again meanwhile
    assert cache.spill_idle(20, ops, pins) == 1
    apply(runner, cache, ops)
    assert runner.saved == 1 and cache.spilled_entries == 1 and len(cache.ram.entries) == 1
    assert cache.match(idle, 999).length == len(system) and cache.match(busy, 999).length == len(busy)
    assert cache.match(running, 999).length == len(running)  # pinned: idle as long, and kept
    assert_cache_exact(runner, cache)
    tokens, n = cache.ram.best([*idle, 5], 999)[:2]
    assert n == len(idle) and cache.restore(tokens, cache.ram.pop(tokens), ops)
    apply(runner, cache, ops)
    assert cache.match(idle, 999).length == len(idle)
    assert_cache_exact(runner, cache)


def test_what_a_waiting_turn_could_take_stays_whole_where_its_match_ends_inside_an_entry():
    """A next turn may spell its last answer otherwise (the tokenizer's tokens, not the model's): its
    match ends inside its entry, and respelling walks on from there, so the whole entry stays; a
    prompt that matches the system prompt only holds that much of the others."""
    cache = PrefixCache(range(10, 20), ram_bytes=1 << 20, spill_after_rows=1)
    runner = FakeRunner(step_seconds=0)
    system = list(range(1, 21))
    mine, other = system + list(range(100, 140)), system + list(range(200, 240))
    for tokens in (mine, other):
        finish(runner, cache, tokens)
    respelled = [*mine[:30], 77, 78]  # diverges inside its entry
    new = [*system, 300, 301]  # a new conversation: the system prompt only
    pins = cache.reachable([respelled, new])
    ops: list[KVOp] = []
    assert cache.spill_idle(5, ops, pins) == 1  # the other one's own part moves out
    apply(runner, cache, ops)
    assert cache.match(mine, 999).length == len(mine) and cache.match(other, 999).length == len(system)
    assert cache.reachable([[5, 6, 7]]) == []
    assert_cache_exact(runner, cache)


def test_an_idle_entry_the_ram_tier_has_no_room_for_stays_in_its_cells():
    """Moved out, it would be lost, or push out an entry saved before it: an idle entry moves only
    into room the RAM tier has. What a token takes is known from the model (`saved_bytes_per_token`)
    or from the states saved so far."""
    runner = FakeRunner(step_seconds=0)
    cache = PrefixCache(range(10, 20), ram_bytes=1000, saved_bytes_per_token=24.0)  # 41 tokens at most
    first, second, big = list(range(1, 41)), list(range(200, 240)), list(range(300, 360))
    for tokens in (first, second, big):
        finish(runner, cache, tokens)
    ops: list[KVOp] = []
    assert cache.spill_idle(SPILL_AFTER_ROWS + 1, ops) == 1  # the oldest; then no room for the second
    apply(runner, cache, ops)
    assert list(cache.ram.entries) == [tuple(first)] and cache.ram.bytes > 1000 - 24 * len(second)
    assert cache.match(second, 999).length == len(second) and cache.match(big, 999).length == len(big)
    assert_cache_exact(runner, cache)

    unknown = PrefixCache(range(10, 20), ram_bytes=1000)  # nothing known until a state is saved
    assert unknown.ram is not None and unknown.ram.has_room(10**6)
    unknown.ram.put(tuple(first), b"x" * 400)  # 10 bytes a token
    assert unknown.ram.has_room(60) and not unknown.ram.has_room(61)


def test_the_tail_past_what_a_running_request_shares_moves_and_the_shared_part_stays():
    # A prompt asked again shares the prompt's cells of the entry the first answer left, not that
    # answer: the answer's cells only cost every row (llama.cpp attends over every cell in use).
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20), ram_bytes=1 << 20)
    prompt, answer = list(range(1, 31)), list(range(100, 140))
    finish(runner, cache, prompt + answer)
    entry_seq = cache.match(prompt, 999).seq_id
    runner.copy_cells(entry_seq, REQUEST_SEQ, 0, len(prompt))  # the request asking again copies the prompt
    pins = [([*prompt, 7], len(prompt))]
    ops: list[KVOp] = []
    assert cache.spill_idle(SPILL_AFTER_ROWS + 1, ops, pins) == 1
    apply(runner, cache, ops)
    assert cache.match(prompt + answer, 999).length == len(prompt) and cache.cells == len(prompt)
    assert runner.tokens_of(REQUEST_SEQ) == prompt  # the running request lost nothing
    assert runner.live_cells() == len(prompt)
    assert cache.spill_idle(10 * SPILL_AFTER_ROWS, ops, pins) == 0  # what is shared stays
    runner.end_sequence(REQUEST_SEQ)
    assert_cache_exact(runner, cache)
    tokens, n = cache.ram.best(prompt + answer, 999)[:2]
    assert n == len(prompt + answer) and cache.restore(tokens, cache.ram.pop(tokens), ops)
    apply(runner, cache, ops)
    assert cache.match(prompt + answer, 999).length == len(prompt + answer)
    assert_cache_exact(runner, cache)


def test_under_pressure_the_unshared_tail_of_an_entry_gives_its_cells():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    prompt, answer = list(range(1, 31)), list(range(100, 140))
    finish(runner, cache, prompt + answer)
    runner.copy_cells(cache.match(prompt, 999).seq_id, REQUEST_SEQ, 0, len(prompt))
    pins = [([*prompt, 7], len(prompt))]
    assert cache.evictable_cells(pins) == len(answer)
    ops: list[KVOp] = []
    assert cache.evict(10, ops, pins) == len(answer)
    apply(runner, cache, ops)
    assert runner.tokens_of(REQUEST_SEQ) == prompt and cache.match(prompt + answer, 999).length == len(prompt)
    assert cache.evict(10, ops, pins) == 0 and not ops  # the shared part stays
    runner.end_sequence(REQUEST_SEQ)
    assert_cache_exact(runner, cache)


def test_without_a_ram_tier_idle_entries_stay_until_their_cells_are_needed():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20))
    finish(runner, cache, list(range(1, 41)))
    ops: list[KVOp] = []
    assert cache.spill_idle(10 * SPILL_AFTER_ROWS, ops) == 0 and not ops
    assert cache.entries == 1


def test_saved_entries_come_back_newest_first_within_the_cells_allowed():
    runner, cache = FakeRunner(step_seconds=0), PrefixCache(range(10, 20), ram_bytes=1 << 20)
    system = list(range(1, 21))
    old, new, big = system + list(range(100, 130)), system + list(range(200, 230)), list(range(300, 400))
    for tokens in (old, new, big):
        finish(runner, cache, tokens)
    ops: list[KVOp] = []
    assert cache.spill_idle(SPILL_AFTER_ROWS + 1, ops) == 3  # old, then new, then big: the newest saved last
    apply(runner, cache, ops)
    assert cache.entries == 0 and cache.cells == 0 and len(cache.ram.entries) == 3
    # 99 cells allowed: `big` (100, saved last) never fits; `new` (saved after `old`) comes back first,
    # with the system prompt, then `old` shares that and adds its own 30
    for expected in (new, old):
        assert cache.bring_back_one(99, ops)
        apply(runner, cache, ops)
        assert cache.match(expected, 999).length == len(expected)
    assert cache.cells == len(system) + 60
    assert not cache.bring_back_one(99, ops) and list(cache.ram.entries) == [tuple(big)]
    assert_cache_exact(runner, cache)
    # a saved state the tree holds in full by now is only dropped
    cache.ram.put(tuple(new[:30]), b"[]")
    assert cache.bring_back_one(99, ops) and not ops and list(cache.ram.entries) == [tuple(big)]


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "pop", "window", "drop_window"]), st.integers(0, 5), st.integers(1, 40)),
        max_size=40,
    )
)
def test_the_ram_tier_keeps_its_byte_counts_exact(actions):
    """`has_room` reads a running count of the saved entries' bytes: it matches what the tier holds
    through puts, pops, checkpoints and evictions, and the tier stays within its limit. A saved
    entry coming in pushes out another only once no checkpoint is left."""
    ram = RamTier(capacity_bytes=100)
    for action, key, size in actions:
        tokens = tuple(range(key + 1))
        if action == "put":
            before = set(ram.entries)
            ram.put(tokens, bytes(size))
            assert not (before - {tokens} - set(ram.entries)) or not ram.windows  # checkpoints go first
        elif action == "pop":
            ram.pop(tokens)
        elif action == "window":
            ram.put_window(tokens, bytes(size))
        else:
            ram.drop_window(tokens)
        assert ram.entry_bytes == sum(len(data) for data in ram.entries.values())
        assert ram.bytes == ram.entry_bytes + sum(len(data) for data in ram.windows.values()) <= 100
