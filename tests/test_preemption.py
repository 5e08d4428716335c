"""KV cells on demand (`admission: estimate`): admission by the answers' likely length, growth,
preemption and exact resumption, with a fake runner. The real engine's test is in test_engine.py."""

from __future__ import annotations

import time

import pytest

from magnitude_jupyter.engine import FinishReason, Priority, SamplingParams
from magnitude_jupyter.engine.kv_ops import ForgetSuspended, SuspendSequence
from magnitude_jupyter.engine.output_lengths import MIN_SAMPLES, PRIOR_TOKENS, OutputLengths
from magnitude_jupyter.engine.request import Request, RequestStatus
from magnitude_jupyter.engine.scheduler import Scheduler

from .fakes import fake_engine, make_request


def seen_short_answers(lengths: OutputLengths, tokens: int = 10, priority=Priority.INTERACTIVE) -> None:
    for _ in range(MIN_SAMPLES):
        lengths.record(priority, None, tokens)


def run_to_end(s: Scheduler, requests: list[Request], steps: int = 10_000) -> None:
    """Step the scheduler as the engine does, every sampled token being the fed one plus one."""
    for _ in range(steps):
        if all(r.is_finished for r in requests):
            return
        out = s.schedule()
        for chunk in out.batched + out.solo:
            request = chunk.request
            sampled = [chunk.tokens[-1] + 1] if chunk.sample else []
            s.advance(chunk, sampled)
            if len(request.output_tokens) >= request.max_tokens:
                s.finish(request, FinishReason.LENGTH)
        check_charges(s)
    raise AssertionError("the requests did not finish")


def check_charges(s: Scheduler) -> None:
    """Every running request holds the cells it has written; the budget never overflows."""
    for r in s.running:
        assert r.num_computed_tokens - r.cache_shared <= s.budget.reserved[r.request_id]
    assert s.budget.used <= s.budget.total


def test_the_estimate_follows_what_was_measured_and_never_passes_the_cap():
    lengths = OutputLengths()
    assert lengths.estimate(Priority.INTERACTIVE, None, 4096) == PRIOR_TOKENS
    assert lengths.estimate(Priority.INTERACTIVE, None, 100) == 100
    for n in range(1, 101):
        lengths.record(Priority.BATCH, None, n)
    assert 90 <= lengths.estimate(Priority.BATCH, None, 4096) <= 92  # the 90th percentile
    assert 90 <= lengths.estimate(Priority.INTERACTIVE, None, 4096) <= 92  # no answers of its own: everyone's
    for _ in range(MIN_SAMPLES):
        lengths.record(Priority.BATCH, "agent", 2000)
    assert lengths.estimate(Priority.BATCH, "agent", 4096) > 2000  # a client with its own history
    assert lengths.estimate(Priority.BATCH, "agent", 512) == 512


def test_estimate_admits_beyond_the_sum_of_caps_where_reserve_admits_one():
    reserve = Scheduler(ctx_size=128, max_running=4, n_batch=64, max_waiting=10)
    estimate = Scheduler(ctx_size=128, max_running=4, n_batch=64, max_waiting=10, admission="estimate")
    seen_short_answers(estimate.lengths)
    for s in (reserve, estimate):
        for i in range(4):
            s.add_request(make_request(f"r{i}", 4, 100))
    assert len(reserve.schedule().admitted) == 1
    assert len(estimate.schedule().admitted) == 4
    assert estimate.budget.used == 4 * (4 + 11)  # prompt + the 90th percentile of 10-token answers, + 1


def test_cells_running_out_preempt_and_every_answer_finishes_whole():
    s = Scheduler(ctx_size=128, max_running=4, n_batch=64, max_waiting=10, admission="estimate", cache_sequences=4)
    seen_short_answers(s.lengths)
    requests = [make_request(f"r{i}", 4, 100) for i in range(4)]
    for r in requests:
        s.add_request(r)
    run_to_end(s, requests)
    assert s.preemptions > 0 and s.preempted_cells > 0
    for r in requests:
        assert r.finish_reason == FinishReason.LENGTH and r.output_tokens == list(range(5, 105))
    assert s.make_stats().preempted_waiting == 0


def test_without_a_prefix_cache_a_preempted_request_computes_its_context_again():
    s = Scheduler(ctx_size=128, max_running=4, n_batch=64, max_waiting=10, admission="estimate")
    seen_short_answers(s.lengths)
    requests = [make_request(f"r{i}", 4, 100) for i in range(3)]
    for r in requests:
        s.add_request(r)
    s.schedule()
    preempted: list[Request] = []
    for _ in range(2000):
        out = s.schedule()
        resumed = [c for c in out.batched if c.request.preemptions and not c.request.prompt_done]
        for chunk in resumed:  # the context again: prompt and answer but its last token, no pick
            assert not chunk.sample
            assert chunk.tokens == chunk.request.context_tokens[chunk.start_pos : chunk.start_pos + len(chunk.tokens)]
            preempted.append(chunk.request)
        for chunk in out.batched:
            s.advance(chunk, [chunk.tokens[-1] + 1] if chunk.sample else [])
            if len(chunk.request.output_tokens) >= chunk.request.max_tokens:
                s.finish(chunk.request, FinishReason.LENGTH)
        if all(r.is_finished for r in requests):
            break
    assert preempted, "no request was preempted and resumed"
    assert all(r.output_tokens == list(range(5, 105)) for r in requests)


def test_the_victim_is_the_lowest_priority_then_the_latest_admitted():
    s = Scheduler(ctx_size=64, max_running=4, n_batch=64, max_waiting=10, admission="estimate")
    seen_short_answers(s.lengths, 4)
    seen_short_answers(s.lengths, 4, Priority.BATCH)
    inter = make_request("inter", 4, 50)
    early_batch, late_batch = make_request("b1", 4, 50, Priority.BATCH), make_request("b2", 4, 50, Priority.BATCH)
    for r in (inter, early_batch, late_batch):
        s.add_request(r)
    s.schedule()
    assert all(r.status == RequestStatus.RUNNING for r in (inter, early_batch, late_batch))
    run_to_end(s, [inter])
    assert inter.preemptions == 0  # the interactive one grew; batch rows gave way
    assert late_batch.preemptions >= 1
    assert late_batch.preemptions >= early_batch.preemptions


def test_a_preempted_request_resumes_before_requests_that_came_after_it():
    s = Scheduler(ctx_size=64, max_running=4, n_batch=64, max_waiting=10, admission="estimate")
    seen_short_answers(s.lengths, 4)
    first, second = make_request("first", 4, 50), make_request("second", 4, 50)
    s.add_request(first)
    s.add_request(second)
    s.schedule()
    while not second.preemptions:
        out = s.schedule()
        for chunk in out.batched:
            s.advance(chunk, [chunk.tokens[-1] + 1] if chunk.sample else [])
    later = make_request("later", 4, 4)
    s.add_request(later)
    queue = list(s.waiting[Priority.INTERACTIVE])
    assert queue.index(second) < queue.index(later)
    run_to_end(s, [first, second, later])
    assert second.admission_number < later.admission_number


def test_reserve_mode_never_preempts():
    s = Scheduler(ctx_size=128, max_running=4, n_batch=64, max_waiting=10, cache_sequences=4)
    requests = [make_request(f"r{i}", 4, 100) for i in range(4)]
    for r in requests:
        s.add_request(r)
    run_to_end(s, requests)
    assert s.preemptions == 0


def test_a_preempted_lane_is_saved_whole_and_given_back_its_state():
    s = Scheduler(ctx_size=64, max_running=4, n_batch=64, max_waiting=10, admission="estimate")
    seen_short_answers(s.lengths, 4, Priority.BATCH)
    lane = make_request("lane", 4, 20, Priority.BATCH, reproducible=True)
    grower = make_request("grower", 4, 55)
    s.add_request(lane)
    s.add_request(grower)
    s.schedule()
    assert s.budget.reserved["lane"] == 24  # a lane is made at its full size: charged for all of it
    suspends = []
    for _ in range(100):
        out = s.schedule()
        suspends += [op for op in out.kv_ops if isinstance(op, SuspendSequence)]
        for chunk in out.batched + out.solo:
            s.advance(chunk, [chunk.tokens[-1] + 1] if chunk.sample else [])
        if lane.preemptions:
            break
    assert lane.preemptions == 1 and lane.num_computed_tokens > 0  # its cells kept, in the saved state
    (op,) = suspends
    op.keep(b"state")
    assert lane.suspended_state == b"state"
    s.finish(lane, FinishReason.CANCELLED)
    assert lane.suspended_state is None
    assert any(isinstance(op, ForgetSuspended) for op in s.take_pending_kv_ops())


@pytest.mark.parametrize("prefix_reuse", [True, False])
def test_engine_answers_whole_across_preemptions_and_streams_keep_flowing(prefix_reuse):
    with fake_engine(admission="estimate", n_ctx=128, ctx_size=128, prefix_reuse=prefix_reuse) as engine:
        assert engine.scheduler is not None
        seen_short_answers(engine.scheduler.lengths)
        requests = [
            engine.submit(f"{i * 1000 + 1} {i * 1000 + 2}", params=SamplingParams(max_tokens=90, temperature=0))
            for i in range(4)
        ]
        for i, request in enumerate(requests):
            events = list(engine.stream(request.request_id, timeout=30))
            assert events[-1].finish_reason == "length" and events[-1].error is None
            text = "".join(e.text for e in events)
            assert text == "".join(f"{i * 1000 + 3 + n} " for n in range(90))
        stats = engine.stats().scheduler
        assert stats.preemptions > 0 and stats.preempted_waiting == 0 and stats.running == 0
        assert not engine.fake.parked  # every kept sampler went back to its request
        assert any(r.timings().preempted_ms is not None for r in requests)


def test_engine_resumes_a_preempted_lane_from_its_saved_state():
    # The lane holds 39 of 64 cells (admitted beside the grower with a growth step to spare); the
    # grower runs out past 20 tokens, long before the lane's 35 are done, whichever is admitted
    # first (the other up to 13 steps later): a preemption by construction.
    with fake_engine(admission="estimate", n_ctx=64, ctx_size=64, parallel=2, step_seconds=0.01) as engine:
        assert engine.scheduler is not None
        seen_short_answers(engine.scheduler.lengths, 4, Priority.BATCH)
        lane = engine.submit(
            "1 2 3 4", params=SamplingParams(max_tokens=35, temperature=0, reproducible=True), priority="batch"
        )
        grower = engine.submit("101 102 103 104", params=SamplingParams(max_tokens=50, temperature=0))
        for request, n in ((lane, 35), (grower, 50)):
            events = list(engine.stream(request.request_id, timeout=30))
            assert events[-1].finish_reason == "length"
            assert "".join(e.text for e in events) == "".join(f"{request.prompt_tokens[-1] + 1 + k} " for k in range(n))
        assert lane.preemptions >= 1 and engine.fake.restored >= 1
        assert not engine.fake.parked


def test_cancelling_a_preempted_request_forgets_what_was_kept_for_it():
    # Slow steps: the victim stays preempted for the grower's remaining ~25 steps (most of a second).
    with fake_engine(admission="estimate", n_ctx=64, ctx_size=64, parallel=2, step_seconds=0.03) as engine:
        assert engine.scheduler is not None
        seen_short_answers(engine.scheduler.lengths, 4)
        seen_short_answers(engine.scheduler.lengths, 4, Priority.BATCH)
        victim = engine.submit("1 2 3 4", params=SamplingParams(max_tokens=50, temperature=0), priority="batch")
        grower = engine.submit("101 102 103 104", params=SamplingParams(max_tokens=55, temperature=0))
        for _ in range(3000):
            if victim.preempted_time is not None or victim.is_finished:
                break
            time.sleep(0.005)
        assert victim.preempted_time is not None, "the batch request was not preempted"
        engine.cancel(victim.request_id)
        assert list(engine.stream(victim.request_id, timeout=30))[-1].finish_reason == "cancelled"
        assert list(engine.stream(grower.request_id, timeout=30))[-1].finish_reason == "length"
        assert not engine.fake.parked
        assert engine.stats().scheduler.preempted_waiting == 0


def test_calibration_says_where_preemptions_began_to_cost():
    from magnitude_jupyter.calibrate.records import Level
    from magnitude_jupyter.calibrate.report import preemption_text

    def level(c: int, tok_s: float, preempted: int | None) -> Level:
        return Level(16, 0, 1.0, 1.0, 100, tok_s, concurrency=c, preemptions=preempted)

    assert preemption_text([level(1, 10, 0), level(2, 19, None)]) is None
    grew = preemption_text([level(1, 10, 0), level(2, 19, 3)])
    assert grew == "preemptions (KV cells charged by estimate): 3 in 16 requests at 2; throughput still grew with them"
    cost = preemption_text([level(1, 10, 0), level(2, 19, 3), level(4, 15, 9)])
    assert cost is not None
    assert cost.endswith("from 4 they cost more than the concurrency gains (lower parallel, or admission: reserve)")
