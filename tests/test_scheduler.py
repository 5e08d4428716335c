"""Scheduler and engine-loop logic with a fake runner: no model needed. Real-model tests are in test_engine.py."""

from __future__ import annotations

import time

import pytest

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import (
    Engine,
    FinishReason,
    OverloadedError,
    Priority,
    PromptTooLongError,
    SamplingParams,
)
from magnitude_jupyter.engine.prefix import ClearSequence, PrefixCopy
from magnitude_jupyter.engine.request import Request, RequestStatus
from magnitude_jupyter.engine.scheduler import REPRODUCIBLE_CHUNK, Scheduler

from .fakes import FakeRunner


def make_request(rid: str, prompt_len: int = 4, max_tokens: int = 4, priority=Priority.INTERACTIVE, **params):
    return Request(
        request_id=rid,
        prompt_tokens=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        priority=priority,
    )


def test_admits_by_kv_budget_and_fifo():
    s = Scheduler(ctx_size=20, max_running=4, n_batch=64, max_waiting=10)
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
    s = Scheduler(ctx_size=10, max_running=4, n_batch=64, max_waiting=10)
    s.add_request(make_request("batch1", 2, 2, Priority.BATCH))
    s.add_request(make_request("inter", 2, 2))
    assert [r.request_id for r in s.schedule().admitted] == ["inter", "batch1"]


def test_waiting_interactive_head_blocks_batch_admission():
    s = Scheduler(ctx_size=10, max_running=4, n_batch=64, max_waiting=10)
    first = make_request("first", 4, 4)
    s.add_request(first)
    s.schedule()
    s.add_request(make_request("inter", 3, 3))  # needs 6, only 2 free
    s.add_request(make_request("small-batch", 1, 1, Priority.BATCH))  # would fit, must wait its turn
    assert s.schedule().admitted == []


def test_too_long_is_rejected_with_numbers():
    s = Scheduler(ctx_size=100, max_running=2, n_batch=64, max_waiting=10, trained_context=80)
    with pytest.raises(
        PromptTooLongError, match=r"70 prompt tokens \+ 20 max_tokens = 90 tokens.*trained context is 80"
    ):
        s.add_request(make_request("x", 70, 20))


def test_queue_full_is_overload():
    s = Scheduler(ctx_size=100, max_running=1, n_batch=64, max_waiting=2)
    s.add_request(make_request("a"))  # will take the free slot at the next step: not counted
    s.add_request(make_request("b"))
    s.add_request(make_request("c"))
    with pytest.raises(OverloadedError):
        s.add_request(make_request("d"))


def test_prefill_is_chunked_and_decodes_go_first():
    s = Scheduler(ctx_size=1000, max_running=4, n_batch=8, max_waiting=10)
    running = make_request("running", 2, 10)
    s.add_request(running)
    out = s.schedule()
    s.advance(out.batched[0], 100)  # prompt done, first token sampled
    s.add_request(make_request("long", 20, 4))
    out = s.schedule()
    assert [(c.request.request_id, len(c.tokens), c.sample) for c in out.batched] == [
        ("running", 1, True),
        ("long", 7, False),
    ]


def test_reproducible_requests_are_scheduled_alone_with_fixed_chunks():
    s = Scheduler(ctx_size=1000, max_running=4, n_batch=8, max_waiting=10)
    s.add_request(make_request("batch", 6, 4))
    s.add_request(make_request("repro", 20, 4, reproducible=True))
    out = s.schedule()
    assert [c.request.request_id for c in out.batched] == ["batch"]
    assert [(c.request.request_id, len(c.tokens)) for c in out.solo] == [("repro", 8)]
    wide = Scheduler(ctx_size=1000, max_running=4, n_batch=512, max_waiting=10)
    wide.add_request(make_request("repro", 200, 4, reproducible=True))
    assert [len(c.tokens) for c in wide.schedule().solo] == [REPRODUCIBLE_CHUNK]  # never a tiled chunk


def fake_engine(**overrides) -> Engine:
    runner = FakeRunner(n_ctx=overrides.pop("n_ctx", 256), step_seconds=overrides.pop("step_seconds", 0.002))
    settings = Settings()
    engine = Engine(
        settings=settings, runner_factory=lambda es: runner, parallel=4, ctx_size=256, n_batch=16, **overrides
    )
    engine.fake = runner  # type: ignore[attr-defined]
    return engine.start()


def test_engine_loop_batches_and_finishes_with_usage():
    with fake_engine() as engine:
        results = [engine.submit("5 6 7", params=SamplingParams(max_tokens=n, temperature=0)) for n in (3, 5)]
        texts = [engine.generate("1 2", params=SamplingParams(max_tokens=2, temperature=0)).text]
        for r in results:
            events = list(engine.stream(r.request_id))
            assert events[-1].finish_reason == "length"
            assert events[-1].usage == {
                "prompt_tokens": 3,
                "completion_tokens": r.max_tokens,
                "total_tokens": 3 + r.max_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        assert "".join(e.text for e in engine.stream(results[0].request_id)) == "8 9 10 "
        assert texts == ["3 4 "]
        # several sequences went through a single decode call at least once
        assert any(len({i.seq_id for i in call}) > 1 for call in engine.fake.calls)


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
        assert stats.kv_cells_reserved == 0 and stats.running == 0
        assert engine.fake.cells == {}


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


def test_prefix_is_copied_from_a_running_request_and_kept_in_the_slot():
    s = Scheduler(ctx_size=1000, max_running=4, n_batch=64, max_waiting=10, min_prefix_tokens=8)
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
    assert second.num_computed_tokens == second.cached_tokens == 40
    copies = [op for op in out.kv_ops if isinstance(op, PrefixCopy)]
    assert [(c.src_seq, c.dst_seq, c.length) for c in copies] == [
        (first.seq_id, second.seq_id, 40),
        (first.seq_id, s.prefix_slot.seq_id, 40),
    ]
    assert s.prefix_slot.tokens == shared
    # prefill continues after the copied cells
    chunk = next(c for c in out.batched if c.request is second)
    assert chunk.start_pos == 40 and chunk.tokens == [3, 4, 5]
    # the 40 shared cells are counted once, though three sequences hold them
    second.num_computed_tokens = len(second.prompt_tokens)
    assert s.kv_cells_held() == 42 + 3
    # once both are gone, the slot still serves the prefix, and holds its cells alone
    s.finish(first, FinishReason.STOP)
    s.finish(second, FinishReason.STOP)
    assert s.kv_cells_held() == s.prefix_slot.length == len(second.prompt_tokens)  # the last one to finish
    third = make_request("third", 4, 4)
    third.prompt_tokens = [*shared, 9]
    s.add_request(third)
    out = s.schedule()
    assert [(c.src_seq, c.length) for c in out.kv_ops if isinstance(c, PrefixCopy)] == [(s.prefix_slot.seq_id, 40)]
    third.num_computed_tokens = len(third.prompt_tokens)
    assert s.kv_cells_held() == len(second.prompt_tokens) + 1


def test_slot_is_evicted_when_a_request_needs_its_cells():
    s = Scheduler(ctx_size=100, max_running=4, n_batch=64, max_waiting=10, min_prefix_tokens=8)
    s.prefix_slot.tokens = list(range(50))
    s.budget.reserve("<prefix slot>", 50)
    big = make_request("big", 60, 30)
    s.add_request(big)
    out = s.schedule()
    assert out.admitted == [big] and s.prefix_slot.tokens == []
    assert any(isinstance(op, ClearSequence) for op in out.kv_ops)


def test_reproducible_requests_never_share_cells():
    s = Scheduler(ctx_size=1000, max_running=4, n_batch=64, max_waiting=10, min_prefix_tokens=8)
    s.prefix_slot.tokens = list(range(1, 41))
    s.budget.reserve("<prefix slot>", 40)
    r = make_request("r", 50, 4, reproducible=True)
    s.add_request(r)
    out = s.schedule()
    assert r.cached_tokens == 0 and not out.kv_ops


def test_a_finishing_request_leaves_its_prompt_in_the_slot():
    s = Scheduler(ctx_size=1000, max_running=4, n_batch=64, max_waiting=10, min_prefix_tokens=8)
    shared = list(range(200, 240))
    first = make_request("first", 4, 4)
    first.prompt_tokens = [*shared, 1]
    s.add_request(first)
    s.schedule()
    first.num_computed_tokens, first.output_tokens = len(first.prompt_tokens), [7]
    seq = first.seq_id
    assert s.finish(first, FinishReason.STOP) == seq
    ops = s.take_pending_kv_ops()
    assert [type(op).__name__ for op in ops] == ["ClearSequence", "PrefixCopy"]
    assert (ops[1].src_seq, ops[1].dst_seq, ops[1].length) == (seq, s.prefix_slot.seq_id, 41)
    assert s.budget.reserved == {"<prefix slot>": 41} and s.take_pending_kv_ops() == []
    # the next request with the same start copies it from the slot instead of computing it
    second = make_request("second", 4, 4)
    second.prompt_tokens = [*shared, 2]
    s.add_request(second)
    s.schedule()
    assert second.cached_tokens == 40


def test_thread_governor_gives_llama_cpp_the_cores_others_leave_free():
    from magnitude_jupyter.engine.threads import ThreadGovernor

    governor = ThreadGovernor(max_threads=4, cores=4)
    assert [governor.threads_for(busy) for busy in (0.0, 0.3, 0.5, 1.0, 2.2, 3.9, 8.0)] == [4, 4, 3, 3, 2, 1, 1]
    assert ThreadGovernor(max_threads=2, cores=8).threads_for(0.0) == 2  # never more than asked for
    assert governor.update(0.0) is None  # the first reading only starts the clock
