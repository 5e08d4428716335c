"""Scheduler and engine-loop logic with a fake runner: no model needed. Real-model tests are in test_engine.py.

The schedulers here charge by `admission: reserve`, whose arithmetic (prompt + max_tokens) these tests
pin; charging by estimate, growth and preemption are test_preemption.py's."""

from __future__ import annotations

import time

import pytest

from magnitude_jupyter.engine import (
    FinishReason,
    OverloadedError,
    Priority,
    PromptTooLongError,
    SamplingParams,
)
from magnitude_jupyter.engine.kv_ops import ClearSequence, CopyCells, RestoreSequence, SaveSequence
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS
from magnitude_jupyter.engine.request import Request, RequestStatus
from magnitude_jupyter.engine.scheduler import BRING_BACK_AFTER_IDLE_SECONDS, REPRODUCIBLE_CHUNK, Scheduler

from .conftest import wait_for
from .fakes import assert_cache_exact, fake_engine, make_request


def test_admits_by_kv_budget_and_fifo():
    s = Scheduler(admission="reserve", ctx_size=20, max_running=4, n_batch=64, max_waiting=10)
    a, b, c = make_request("a", 6, 4), make_request("b", 6, 4), make_request("c", 2, 2)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    # a and b take 20 cells; c would fit no more
    assert [r.request_id for r in out.admitted] == ["a", "b"]
    assert s.budget.free == 0 and c.status == RequestStatus.WAITING
    s.finish(a, FinishReason.CANCELLED)
    assert [r.request_id for r in s.schedule().admitted] == ["c"]


def test_interactive_before_batch():
    s = Scheduler(admission="reserve", ctx_size=10, max_running=4, n_batch=64, max_waiting=10)
    s.add_request(make_request("batch1", 2, 2, Priority.BATCH))
    s.add_request(make_request("inter", 2, 2))
    assert [r.request_id for r in s.schedule().admitted] == ["inter", "batch1"]


def test_waiting_interactive_head_blocks_batch_admission():
    s = Scheduler(admission="reserve", ctx_size=10, max_running=4, n_batch=64, max_waiting=10)
    first = make_request("first", 4, 4)
    s.add_request(first)
    s.schedule()
    s.add_request(make_request("inter", 3, 3))  # needs 6, only 2 free
    s.add_request(make_request("small-batch", 1, 1, Priority.BATCH))  # would fit, must wait its turn
    assert s.schedule().admitted == []


def test_too_long_is_rejected_with_numbers():
    s = Scheduler(admission="reserve", ctx_size=100, max_running=2, n_batch=64, max_waiting=10, trained_context=80)
    with pytest.raises(
        PromptTooLongError, match=r"70 prompt tokens \+ 20 max_tokens = 90 tokens.*trained context is 80"
    ):
        s.add_request(make_request("x", 70, 20))


def test_queue_full_is_overload():
    s = Scheduler(admission="reserve", ctx_size=100, max_running=1, n_batch=64, max_waiting=2)
    s.add_request(make_request("a"))  # will take the free slot at the next step: not counted
    s.add_request(make_request("b"))
    s.add_request(make_request("c"))
    with pytest.raises(OverloadedError):
        s.add_request(make_request("d"))


def test_prefill_is_chunked_and_decodes_go_first():
    s = Scheduler(admission="reserve", ctx_size=1000, max_running=4, n_batch=8, max_waiting=10)
    running = make_request("running", 2, 10)
    s.add_request(running)
    out = s.schedule()
    s.advance(out.batched[0], [100])  # prompt done, first token sampled
    s.add_request(make_request("long", 20, 4))
    out = s.schedule()
    assert [(c.request.request_id, len(c.tokens), c.sample) for c in out.batched] == [
        ("running", 1, True),
        ("long", 7, False),
    ]


def test_reproducible_requests_are_scheduled_alone_with_fixed_chunks():
    s = Scheduler(admission="reserve", ctx_size=1000, max_running=4, n_batch=8, max_waiting=10)
    s.add_request(make_request("batch", 6, 4))
    s.add_request(make_request("repro", 20, 4, reproducible=True))
    out = s.schedule()
    assert [c.request.request_id for c in out.batched] == ["batch"]
    assert [(c.request.request_id, len(c.tokens)) for c in out.solo] == [("repro", 8)]
    wide = Scheduler(admission="reserve", ctx_size=1000, max_running=4, n_batch=512, max_waiting=10)
    wide.add_request(make_request("repro", 200, 4, reproducible=True))
    assert [len(c.tokens) for c in wide.schedule().solo] == [REPRODUCIBLE_CHUNK]  # never a tiled chunk


def test_engine_loop_batches_and_finishes_with_usage():
    with fake_engine() as engine:
        results = [engine.submit("5 6 7", params=SamplingParams(max_tokens=n, temperature=0)) for n in (3, 5)]
        texts = [engine.generate("1 2", params=SamplingParams(max_tokens=2, temperature=0)).text]
        for r in results:
            events = list(engine.stream(r.request_id))
            assert events[-1].finish_reason == "length"
            assert events[-1].counts == (3, 0, r.max_tokens, 0)  # prompt, cached, output, reasoning
        assert "".join(e.text for e in engine.stream(results[0].request_id)) == "8 9 10 "
        assert texts == ["3 4 "]
        # several sequences went through a single decode call at least once
        assert any(len({i.seq_id for i in call}) > 1 for call in engine.fake.calls)


def test_a_grammar_dead_end_ends_its_own_request_and_no_other():
    """The sampler found no token its grammar lets through: that request ends (an error, or whole when
    the grammar had reached its end), and the requests in the same step go on to their ends."""
    with fake_engine() as engine:
        engine.fake.dead_ends = {12: False, 22: True}
        stuck = engine.submit("9 10", params=SamplingParams(max_tokens=8, temperature=0))
        done = engine.submit("19 20", params=SamplingParams(max_tokens=8, temperature=0))
        beside = engine.submit("40 41", params=SamplingParams(max_tokens=4, temperature=0))
        finals = {r.request_id: list(engine.stream(r.request_id))[-1] for r in (stuck, done, beside)}
        assert finals[stuck.request_id].finish_reason == "error"
        assert "grammar" in (finals[stuck.request_id].error or "")
        assert "".join(e.text for e in engine.stream(stuck.request_id)) == "11 "
        assert finals[done.request_id].finish_reason == "stop" and finals[done.request_id].error is None
        assert finals[beside.request_id].finish_reason == "length"
        assert "".join(e.text for e in engine.stream(beside.request_id)) == "42 43 44 45 "


def test_the_panel_sees_where_a_request_came_from_and_the_first_words_it_asks():
    from magnitude_jupyter.engine.request import prompt_head

    with fake_engine() as engine:
        engine.generate("1 2", params=SamplingParams(max_tokens=2, temperature=0), origin="02.ipynb · cell 4")
        finished = engine.stats().recent[0]
        assert (finished.origin, finished.prompt_head) == ("02.ipynb · cell 4", "1 2")
        # An API client that names no origin is named by its `user`.
        engine.generate("3 4", params=SamplingParams(max_tokens=2, temperature=0), user="ada")
        assert engine.stats().recent[0].origin == "ada"
    long = "Name   three uses\nof a paperclip, one per line, and say which one is the oddest of them all"
    assert prompt_head(long, None) == "Name three uses of a paperclip, one per line, and say which…"
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert prompt_head(None, messages) == "hi" and prompt_head(None, None) is None


def test_a_step_llama_cpp_finds_no_cells_for_runs_again_once_idle_entries_are_given_back():
    with fake_engine() as engine:
        first = engine.generate("1 2 3", params=SamplingParams(max_tokens=4, temperature=0))
        assert engine.stats().scheduler.prefix_cache_entries == 1  # its tokens stay as an entry
        engine.fake.no_room_once = True
        again = engine.generate("7 8 9", params=SamplingParams(max_tokens=4, temperature=0))
        assert (first.text, again.text) == ("4 5 6 7 ", "10 11 12 13 ")  # nothing lost, nothing failed
        assert engine.fake.no_room_once is False
        assert engine.stats().scheduler.prefix_cache_entries == 1  # the idle entry went; the new one stays


def test_a_step_llama_cpp_finds_too_few_cells_for_computes_fewer_prompt_rows_and_loses_nothing():
    """As a sliding-window cache whose old cells two sequences share runs short: the step's prompt
    rows are halved until the batch fits, and the prompt goes on at the next steps."""
    with fake_engine() as engine:
        running = engine.submit("1", params=SamplingParams(max_tokens=40, temperature=0))
        assert running.stream is not None and wait_for(lambda: running.output_tokens, what="a request to decode")
        engine.fake.room_for = 4
        calls = len(engine.fake.calls)
        late = engine.generate(" ".join(str(t) for t in range(40, 60)), params=SamplingParams(max_tokens=3))
        final = running.stream.wait_final(60)
        assert late.text == "60 61 62 " and late.finish_reason == "length"
        assert final is not None and final.finish_reason == "length" and running.output_text.split()[-1] == "41"
        assert max(sum(len(item.tokens) for item in call) for call in engine.fake.calls[calls:]) <= 4
        assert engine.stats().scheduler.running == 0


def test_engine_stop_string_and_cancel_frees_kv():
    with fake_engine() as engine:
        result = engine.generate("1", params=SamplingParams(max_tokens=10, temperature=0, stop=["4"]))
        assert result.text == "2 3 " and result.finish_reason == "stop"
        request = engine.submit("1", params=SamplingParams(max_tokens=200, temperature=0))
        stream = engine.stream(request.request_id)
        next(stream)
        assert engine.cancel(request.request_id)
        events = list(stream)
        assert events[-1].finish_reason == "cancelled"
        stats = engine.stats().scheduler
        assert stats.running == 0 and stats.kv_cells_reserved == stats.prefix_cache_cells > 0
        # nothing leaked: the only cells left are the cache's (what was computed before the cancel)
        assert engine.fake.live_cells() == stats.prefix_cache_cells


def test_abandoned_request_is_cancelled_after_grace():
    # 200 tokens at 20 ms a step take 4 s: far longer than the grace period
    with fake_engine(grace_seconds=0.3, step_seconds=0.02) as engine:
        request = engine.submit("1", params=SamplingParams(max_tokens=200, temperature=0))
        deadline = time.monotonic() + 30
        while not request.is_finished and time.monotonic() < deadline:
            time.sleep(0.05)  # watch the request, without reading its stream
        assert request.finish_reason == FinishReason.CANCELLED, request.finish_reason
        assert "grace period" in (request.error or "")
        assert len(request.output_tokens) < 200
        # re-attaching after it was cancelled still replays everything up to the cancel
        events = list(engine.stream(request.request_id, timeout=5))
        assert events[-1].finish_reason == "cancelled" and len(events) == len(request.output_tokens) + 1


def test_shutdown_cancels_running_and_closes_runner():
    engine = fake_engine()
    request = engine.submit("1", params=SamplingParams(max_tokens=200, temperature=0))
    engine.shutdown()
    assert engine.state == "stopped" and engine.fake.closed
    assert request.is_finished
    assert list(engine.stream(request.request_id))[-1].is_final


def cached_scheduler(ctx_size: int = 1000, **kw) -> Scheduler:
    return Scheduler(
        admission="reserve", ctx_size=ctx_size, max_running=4, n_batch=64, max_waiting=10, cache_sequences=8, **kw
    )


def copies(ops) -> list[tuple[int, int, int, int]]:
    return [(op.src_seq, op.dst_seq, op.start, op.end) for op in ops if isinstance(op, CopyCells)]


def test_a_prefix_comes_from_a_running_request_then_from_the_cache():
    s = cached_scheduler()
    shared = list(range(100, 140))  # 40 shared tokens
    first = make_request("first", 4, 4)
    first.prompt_tokens = [*shared, 1, 2]
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens = len(first.prompt_tokens)  # its prompt is in the cache now
    first.output_tokens = [7]
    second = make_request("second", 4, 4)
    second.prompt_tokens = [*shared, 3, 4, 5]
    s.add_request(second)
    out = s.schedule()
    assert second.num_computed_tokens == second.cached_tokens == 40 and second.cache_shared == 0
    assert copies(out.kv_ops) == [(first.seq_id, second.seq_id, 0, 40)]
    chunk = next(c for c in out.batched if c.request is second)  # prefill continues after the copied cells
    assert chunk.start_pos == 40 and chunk.tokens == [3, 4, 5]
    second.num_computed_tokens, second.output_tokens = len(second.prompt_tokens), [8]
    assert s.kv_cells_held() == 42 + 3  # the 40 shared cells are counted once

    # once `first` ends, its tokens are a cache entry, and the next request copies from there
    seq = first.seq_id
    s.finish(first, FinishReason.STOP)
    ops = s.take_pending_kv_ops()
    (entry,) = s.cache.leaves()
    assert copies(ops) == [(seq, entry.seq_id, 0, 42)] and s.cache.cells == 42
    third = make_request("third", 4, 4)
    third.prompt_tokens = [*shared, 1, 2, 9]
    s.add_request(third)
    out = s.schedule()
    assert copies(out.kv_ops) == [(entry.seq_id, third.seq_id, 0, 42)] and third.cache_shared == 42
    # the 42 cells are the cache's: the request reserves only what it adds
    assert s.budget.reserved[third.request_id] == third.kv_cells - 42
    assert s.budget.used == s.cache.cells + sum(s.budget.reserved[r.request_id] for r in s.running)


def test_cache_entries_nobody_runs_on_are_evicted_for_a_request_that_needs_their_cells():
    s = cached_scheduler(ctx_size=100)
    old = make_request("old", 50, 10)
    s.add_request(old)
    s.schedule()
    old.num_computed_tokens = 50
    s.finish(old, FinishReason.STOP)
    s.take_pending_kv_ops()
    assert s.cache.cells == 50 and s.budget.free == 50
    big = make_request("big", 60, 30)
    big.prompt_tokens = [5000 + i for i in range(60)]
    s.add_request(big)
    out = s.schedule()
    assert out.admitted == [big] and s.cache.cells == 0
    assert any(isinstance(op, ClearSequence) for op in out.kv_ops)


def test_an_entry_a_running_request_shares_is_never_evicted_under_it():
    s = cached_scheduler(ctx_size=120)
    first = make_request("first", 60, 4)
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens = 60
    s.finish(first, FinishReason.STOP)
    s.take_pending_kv_ops()
    reader = make_request("reader", 61, 4)
    reader.prompt_tokens = [*first.prompt_tokens, 99]
    s.add_request(reader)
    s.schedule()
    assert reader.cache_shared == 60
    hungry = make_request("hungry", 50, 10)
    hungry.prompt_tokens = [7000 + i for i in range(50)]
    s.add_request(hungry)
    out = s.schedule()
    assert hungry not in out.admitted and s.cache.cells == 60  # it waits; the shared entry stays
    s.finish(reader, FinishReason.STOP)
    s.take_pending_kv_ops()
    assert hungry in s.schedule().admitted  # now the entry could go


def test_reproducible_requests_never_copy_cells():
    s = cached_scheduler()
    first = make_request("first", 50, 4)
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens = 50
    s.finish(first, FinishReason.STOP)
    s.take_pending_kv_ops()
    r = make_request("r", 50, 4, reproducible=True)
    r.prompt_tokens = [*first.prompt_tokens, 1]
    s.add_request(r)
    out = s.schedule()
    assert r.cached_tokens == 0 and not copies(out.kv_ops)


def test_thread_governor_gives_llama_cpp_the_cores_others_leave_free():
    from magnitude_jupyter.engine.threads import ThreadGovernor

    governor = ThreadGovernor(max_threads=4, cores=4)
    assert [governor.threads_for(busy) for busy in (0.0, 0.3, 0.5, 1.0, 2.2, 3.9, 8.0)] == [4, 4, 3, 3, 2, 1, 1]
    assert ThreadGovernor(max_threads=2, cores=8).threads_for(0.0) == 2  # never more than asked for
    assert governor.update(0.0) is None  # the first reading only starts the clock


# A vocabulary where one text has two spellings: 10 + 11 spell what 20 spells ("{" + "\"" = "{\""),
# and token 0 is a special token with no text.
PIECES = {10: b"{", 11: b'"', 20: b'{"', 12: b"name", 13: b'":', 14: b" 1", 15: b"}", 0: b""}


def spell(token: int) -> bytes:
    return PIECES.get(token, f"<{token}>".encode())


def test_a_prompt_that_spells_a_cached_answer_otherwise_reuses_the_answers_cells():
    s = cached_scheduler(spell=spell)
    history = list(range(100, 140))
    first = make_request("first", 4, 8)
    first.prompt_tokens = [*history, 1]
    s.add_request(first)
    s.schedule()
    # the model answered {"name": 1} in its own tokens: "{" then "\"" where the tokenizer writes "{\""
    first.num_computed_tokens = len(first.prompt_tokens) + 6
    first.output_tokens = [10, 11, 12, 13, 14, 15]
    s.finish(first, FinishReason.STOP)
    s.take_pending_kv_ops()
    # the next turn sends that answer back as text, tokenized the tokenizer's way, then goes on
    turn = make_request("turn", 4, 4)
    turn.prompt_tokens = [*history, 1, 20, 12, 13, 14, 15, 0, 2, 3]
    s.add_request(turn)
    out = s.schedule()
    (entry,) = s.cache.leaves()
    assert turn.prompt_tokens == [*history, 1, 10, 11, 12, 13, 14, 15, 0, 2, 3]  # the cache's spelling
    assert copies(out.kv_ops) == [(entry.seq_id, turn.seq_id, 0, 47)] and turn.cached_tokens == 47
    assert s.cache.respelled_tokens == 6

    # the cache's spelling is kept only as far as the text is the same
    edited = make_request("edited", 4, 4)
    edited.prompt_tokens = [*history, 1, 20, 12, 13, 99, 2]
    s.add_request(edited)
    s.schedule()
    assert edited.prompt_tokens == [*history, 1, 10, 11, 12, 13, 99, 2] and edited.cached_tokens == 45
    other = make_request("other", 4, 4)
    other.prompt_tokens = [*history, 1, 99, 20, 2]
    s.add_request(other)
    s.schedule()
    assert other.prompt_tokens == [*history, 1, 99, 20, 2] and other.cached_tokens == 41


def test_without_a_spelling_the_match_stays_token_for_token():
    s = cached_scheduler()
    first = make_request("first", 4, 8)
    first.prompt_tokens = list(range(100, 141))
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens, first.output_tokens = 43, [10, 11]
    s.finish(first, FinishReason.STOP)
    turn = make_request("turn", 4, 4)
    turn.prompt_tokens = [*range(100, 141), 20, 2]
    s.add_request(turn)
    s.schedule()
    assert turn.cached_tokens == 41 and turn.prompt_tokens[-2:] == [20, 2]


def _entry_of(s: Scheduler, rid: str, prompt: list[int]) -> None:
    """Run a request whose prompt is `prompt` to its end: the cache keeps it as an entry."""
    req = make_request(rid)
    req.prompt_tokens = prompt
    s.add_request(req)
    s.schedule()
    req.num_computed_tokens = len(prompt)
    s.finish(req, FinishReason.STOP)
    s.take_pending_kv_ops()


def test_a_saved_entry_comes_back_for_the_few_prompt_tokens_it_adds_to_the_tree():
    """Restoring costs less than computing one prompt row (prompt_start.RAM_RESTORE_GAIN), so a saved
    entry that covers only 5 tokens more than the KV cache holds is brought back, not recomputed."""
    s = cached_scheduler(cache_ram_bytes=1 << 20, cache_spill_rows=0)  # the held entry stays in cells
    head, tail = list(range(100, 120)), [7, 8, 9, 10, 11]
    for rid, prompt in (("held", [*head, 50, 51]), ("saved", [*head, *tail])):
        _entry_of(s, rid, prompt)
    ops: list = []
    saved = next(leaf for leaf in s.cache.leaves() if leaf.tokens[-1] == tail[-1])
    s.cache._drop(saved, ops)  # what spill_idle does to an idle entry
    s.cache.ram.put(tuple([*head, *tail]), b"state")
    back = make_request("back")
    back.prompt_tokens = [*head, *tail, 60, 61]
    s.add_request(back)
    out = s.schedule()
    assert any(isinstance(op, RestoreSequence) for op in out.kv_ops)
    assert back.cached_tokens == len(head) + len(tail) and s.cache.restored_tokens == len(tail)


SAVED_PROMPT, IDLE_PROMPT = list(range(100, 130)), list(range(200, 230))


def _step_as_an_idle_entry_moves(prompt: list[int]) -> tuple[Scheduler, Request, list]:
    """An entry of SAVED_PROMPT in the RAM tier, one of IDLE_PROMPT in cells, and a request decoding;
    then a step with a request of `prompt` waiting, where the idle entry's 40-row clock runs out (30
    rows of its own prompt and 30 of the decoding request's). The scheduler, that request, the
    step's operations."""
    s = cached_scheduler(cache_ram_bytes=1 << 20, cache_spill_rows=40)
    _entry_of(s, "saved", SAVED_PROMPT)
    ops: list = []
    assert s.cache.spill_idle(s.cache.spill_after_rows + 1, ops) == 1
    (saved,) = [op.tokens for op in ops if isinstance(op, SaveSequence)]
    s.cache.ram.put(saved, b"state")  # what the engine does with the save
    _entry_of(s, "idle", IDLE_PROMPT)
    busy = make_request("busy", 30, 50)
    s.add_request(busy)
    s.advance(s.schedule().batched[0], [5])
    request = make_request("next")
    request.prompt_tokens = prompt
    s.add_request(request)
    return s, request, s.schedule().kv_ops


def test_idle_entries_move_out_before_a_step_admits_so_a_restored_one_lands_in_their_cells():
    """llama.cpp puts a restored entry in the first free run of cells from the lowest it freed last:
    an entry moved out before the restore gives it its cells, where after it the restore lands above
    every cell in use (docs/decisions.md, "Idle entries move out before admission")."""
    s, back, ops = _step_as_an_idle_entry_moves([*SAVED_PROMPT, 1, 2])
    kinds = [type(op) for op in ops]
    assert kinds.index(SaveSequence) < kinds.index(ClearSequence) < kinds.index(RestoreSequence)
    assert back.cached_tokens == len(SAVED_PROMPT) and s.cache.spilled_entries == 2


def test_an_entry_a_waiting_request_takes_next_does_not_move_out_just_before():
    s, turn, ops = _step_as_an_idle_entry_moves([*IDLE_PROMPT, 1, 2])
    assert not [op for op in ops if isinstance(op, (SaveSequence, RestoreSequence))]
    assert turn.cached_tokens == len(IDLE_PROMPT) and s.cache.spilled_entries == 1


def test_an_entry_moved_out_while_others_decode_comes_back_once_nothing_runs():
    """An entry idle while another request decodes moves to the RAM tier (its cells slow every row);
    once nothing runs they cost nothing, and it comes back, in steps that have nothing to decode. Its
    cells must be loaded then: the tree has already given it a sequence id and counts its cells."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with fake_engine(prefix_cache_entries=2, n_batch=32, min_prefix_tokens=4) as engine:
        engine.generate("1 2 3 4 5 6 7 8", params=greedy)  # an entry of 11 cells: 1 ... 11
        engine.generate("50 51 52 53 54 55", params=SamplingParams(max_tokens=SPILL_AFTER_ROWS + 8, temperature=0))
        cache = engine.scheduler.cache
        deadline = time.monotonic() + 10
        while (cache.ram.entries or not cache.spilled_entries) and time.monotonic() < deadline:
            time.sleep(0.01)
        with engine._lock:
            assert cache.spilled_entries == 1 and not cache.ram.entries and cache.restored_tokens == 11
            assert engine.fake.restored == 1 and cache.entries == 2
            assert_cache_exact(engine.fake, cache)
        turn = engine.generate("1 2 3 4 5 6 7 8 9 10 11 40", params=greedy)
        assert turn.counts.cached == 11
        for prompt in ("70 71 72 73 74", "80 81 82 83 84"):  # the sequence ids go round again
            assert engine.generate(prompt, params=greedy).finish_reason == "length"
        time.sleep(0.05)
        with engine._lock:
            assert_cache_exact(engine.fake, cache)


def test_a_request_llama_cpp_cannot_start_fails_alone_and_the_step_goes_on():
    """A lane llama.cpp cannot allocate fails the reproducible request that needed it, not the
    requests decoding in the same step."""
    with fake_engine() as engine:
        start = engine.fake.start_sequence

        def start_sequence(seq_id, params, prompt_tokens, cells):
            if params.reproducible:
                raise RuntimeError("llama.cpp could not create a lane of 256 cells")
            start(seq_id, params, prompt_tokens, cells)

        engine.fake.start_sequence = start_sequence
        running = engine.submit("1 2", params=SamplingParams(max_tokens=60, temperature=0))
        stream = engine.stream(running.request_id)
        next(stream)  # decoding: the next step admits the reproducible request beside it
        refused = engine.generate("5 6", params=SamplingParams(max_tokens=4, temperature=0, reproducible=True))
        assert refused.finish_reason == "error" and "could not create a lane" in refused.error
        events = list(stream)
        assert events[-1].finish_reason == "length" and events[-1].error is None
        stats = engine.stats().scheduler
        assert stats.running == 0 and engine.fake.live_cells() == stats.prefix_cache_cells
        assert engine.generate("1 2", params=SamplingParams(max_tokens=3, temperature=0)).finish_reason == "length"


def test_a_restore_that_fails_while_nothing_runs_empties_the_cache_and_the_engine_serves_on():
    """llama.cpp may find no room for a saved state: the tree already counts its cells, so it cannot
    be trusted any more, and the cache starts over, unsaved (what it holds may not be what it says)."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with fake_engine(prefix_cache_entries=2, n_batch=32, min_prefix_tokens=4) as engine:
        engine.fake.restore_sequence = lambda seq_id, data: False
        engine.generate("1 2 3 4 5 6 7 8", params=greedy)
        engine.generate("50 51 52 53 54 55", params=SamplingParams(max_tokens=SPILL_AFTER_ROWS + 8, temperature=0))
        cache = engine.scheduler.cache
        deadline = time.monotonic() + 10
        while (cache.ram.entries or cache.entries) and time.monotonic() < deadline:
            time.sleep(0.01)
        with engine._lock:
            assert cache.spilled_entries == 1 and not cache.ram.entries and cache.entries == 0
            assert engine.scheduler.budget.used == 0
            assert_cache_exact(engine.fake, cache)
        turn = engine.generate("1 2 3 4 5 6 7 8 9 10 11 40", params=greedy)
        assert turn.finish_reason == "length" and turn.counts.cached == 0


def test_saved_entries_wait_for_a_second_of_idleness_to_come_back():
    """Not in the gap between one client's requests, where they would go out again 64 rows later."""
    s = cached_scheduler(cache_ram_bytes=1 << 20)
    req = make_request("saved")
    req.prompt_tokens = list(range(100, 130))
    s.add_request(req)
    s.schedule(now=10.0)
    req.num_computed_tokens = len(req.prompt_tokens)
    s.finish(req, FinishReason.STOP)
    s.take_pending_kv_ops()
    ops: list = []
    assert s.cache.spill_idle(SPILL_AFTER_ROWS + 1, ops) == 1 and s.cache.entries == 0
    (saved,) = [op.tokens for op in ops if isinstance(op, SaveSequence)]
    s.cache.ram.put(saved, b"state")  # what the engine does with the save
    assert not s.schedule(now=20.0).kv_ops  # idle from here
    assert not s.schedule(now=20.0 + BRING_BACK_AFTER_IDLE_SECONDS / 2).kv_ops
    back = s.schedule(now=20.0 + BRING_BACK_AFTER_IDLE_SECONDS).kv_ops
    assert [type(op) for op in back] == [RestoreSequence] and s.cache.entries == 1 and not s.cache.ram.entries
    assert s.budget.used == s.cache.cells == len(saved) > 0


def scoped(rid: str, tokens: list[int], scope: str | None) -> Request:
    request = make_request(rid, 4, 4)
    request.prompt_tokens, request.cache_scope = list(tokens), scope
    return request


def run_and_finish(s: Scheduler, request: Request) -> None:
    s.add_request(request)
    s.schedule()
    request.num_computed_tokens, request.output_tokens = len(request.prompt_tokens), [7]
    s.finish(request, FinishReason.STOP)
    s.take_pending_kv_ops()


def test_a_scoped_request_shares_cache_entries_only_within_its_scope():
    """Without scopes, a second user's identical prefix reports cached tokens: a timing oracle."""
    s = cached_scheduler()
    prompt = list(range(100, 140))
    run_and_finish(s, scoped("alice-1", prompt, "salt:alice"))
    bob = scoped("bob", [*prompt, 1], "salt:bob")
    anonymous = scoped("anon", [*prompt, 2], None)
    alice = scoped("alice-2", [*prompt, 3], "salt:alice")
    for request in (bob, anonymous, alice):
        s.add_request(request)
        s.schedule()
    assert bob.cached_tokens == 0 and anonymous.cached_tokens == 0
    assert alice.cached_tokens == 40  # the whole entry: prompt and answer cells up to the last prompt token


def test_a_running_request_of_another_scope_lends_no_cells():
    s = cached_scheduler()
    prompt = list(range(100, 140))
    first = scoped("first", [*prompt, 1], "salt:a")
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens, first.output_tokens = len(first.prompt_tokens), [7]
    other, same = scoped("other", [*prompt, 2], "salt:b"), scoped("same", [*prompt, 3], "salt:a")
    s.add_request(other)
    s.add_request(same)
    s.schedule()
    assert other.cached_tokens == 0 and same.cached_tokens == 40


@pytest.mark.parametrize("scope", [None, "salt:a"])
def test_scoped_answers_are_no_drafts_for_anyone(scope):
    s = cached_scheduler(draft_tokens=6)
    request = scoped("a", list(range(100, 140)), scope)
    request.params.temperature = 0
    assert request.params.draftable
    run_and_finish(s, request)
    assert bool(s.answers.tokens) == (scope is None)


def test_prompts_that_start_alike_wait_for_the_first_to_compute_what_they_share():
    s = cached_scheduler(ctx_size=4000)
    system = list(range(1000, 1300))  # 300 shared tokens: an agent's system prompt
    requests = []
    for i in range(3):
        request = make_request(f"agent-{i}", 4, 4)
        request.prompt_tokens = [*system, 10 + i, 20 + i]
        s.add_request(request)
        requests.append(request)
    first, *others = requests
    out = s.schedule()
    assert out.admitted == [first] and all(r.status == RequestStatus.WAITING for r in others)
    while first.num_computed_tokens < len(system):  # the first computes the shared part alone
        (chunk,) = out.batched
        assert chunk.request is first
        s.advance(chunk, [7] if chunk.sample else [])
        out = s.schedule()
    assert set(out.admitted) == set(others)
    for other in others:  # they copy it, and compute only their own tokens
        assert other.cached_tokens >= len(system) and (first.seq_id, other.seq_id, 0, other.cached_tokens) in copies(
            out.kv_ops
        )
    # a prompt that shares little with the running one is admitted at once, beside it
    s2 = cached_scheduler(ctx_size=4000)
    lead, short = make_request("lead", 4, 4), make_request("short", 4, 4)
    lead.prompt_tokens, short.prompt_tokens = [*system, 1], [*system[:40], 2]
    s2.add_request(lead)
    s2.add_request(short)
    assert set(s2.schedule().admitted) == {lead, short}
