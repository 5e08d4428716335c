"""Prompt-lookup drafts: guessed tokens are kept only as far as the model's own picks confirm them."""

from __future__ import annotations

import pytest

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams, draft_policy
from magnitude_jupyter.engine.draft_policy import DraftPolicy, StepCost, measure_step_costs
from magnitude_jupyter.engine.request import FinishReason, Request
from magnitude_jupyter.engine.scheduler import Scheduler
from magnitude_jupyter.engine.speculate import MAX_MATCH, MEMORY_KEY, AnswerMemory, Guess, NgramIndex

from .fakes import fake_engine


def test_the_index_guesses_what_followed_the_last_run_before():
    index = NgramIndex(3)
    index.extend([1, 2, 3, 4, 5, 6, 9, 1, 2])
    assert index.guess(4) is None  # (9, 1, 2) never occurred before
    index.extend([3])
    assert index.guess(4) == Guess([4, 5, 6, 9], 3)
    index.extend([7, 1, 2, 3])
    assert index.guess(3) == Guess([7, 1, 2], 3)  # the latest occurrence wins


def test_a_guess_says_how_long_its_match_is():
    index = NgramIndex()
    text = list(range(10, 40))
    index.extend([*text, 99, *text[:10]])
    assert index.guess(6) == Guess(text[10:16], 10)
    index = NgramIndex()
    index.extend([*text, 99, 98, *text[6:10]])  # only the last 4 tokens match
    assert index.guess(6) == Guess(text[10:16], 4)
    index = NgramIndex()
    index.extend([*text, 99, *text[:25]])
    assert index.guess(2).matched == MAX_MATCH


def test_the_answer_memory_guesses_an_earlier_answer_to_the_same_prompt_only():
    memory = AnswerMemory(capacity=200)
    header = [90, 91, 92]  # a chat template's turn header, which every prompt ends with
    memory.remember([1, 2, 3, 4, 5, 6, *header], [40, 41, 42, 43])
    memory.remember([7, 8, 9, 10, 11, 12, *header], [50, 51, 52])
    assert memory.guess([1, 2, 3, 4, 5, 6, *header], 3) == Guess([40, 41, 42], MEMORY_KEY + 1)
    assert memory.guess([1, 2, 3, 4, 5, 6, *header, 40, 41], 5) == Guess([42, 43], MEMORY_KEY + 3)  # not into the next
    assert memory.guess([0, 0, 0, 0, 0, 6, *header], 3) is None  # only the header and 1 token match
    for n in range(60):  # older answers make way for new ones, and the memory stays bounded
        memory.remember([n, n, n, n, n, n, *header], [n + 100] * 5)
    assert len(memory.tokens) <= 200 and memory.guess([1, 2, 3, 4, 5, 6, *header], 3) is None
    assert memory.guess([59] * 6 + header, 3) == Guess([159] * 3, MEMORY_KEY + 1)


def test_a_greedy_request_that_repeats_an_earlier_one_drafts_that_answer_from_its_first_step():
    s = Scheduler(ctx_size=1000, max_running=8, n_batch=128, max_waiting=10, draft_tokens=4, draft_max_sequences=8)
    assert s.drafts is not None
    gpu_like(s.drafts)
    prompt = [5, 9, 2, 7, 3, 8, 1, 6, 4]  # nothing in it repeats: the request alone guesses nothing
    first = request("first", prompt)
    s.add_request(first)
    (chunk,) = s.schedule().batched
    s.advance(chunk, [70])
    for token in (71, 72, 73, 74, 75):
        (chunk,) = s.schedule().batched
        assert not chunk.draft
        s.advance(chunk, [token])
    s.finish(first, FinishReason.LENGTH)
    s.add_request(request("again", prompt))
    (chunk,) = s.schedule().batched
    s.advance(chunk, [70])
    (chunk,) = s.schedule().batched
    assert chunk.draft == [71, 72, 73, 74]
    s.add_request(request("sampled", prompt, temperature=0.7))  # not a greedy request: never drafts
    assert all(not c.draft for c in s.schedule().batched if c.request.request_id == "sampled")


def cpu_like(policy: DraftPolicy) -> DraftPolicy:
    """Step costs of a small model on a 2-core CPU: a row costs most of a one-token step."""
    policy.cost = StepCost()
    for n in (1, 2, 5, 10, 20, 40):
        policy.cost.observe(n, 0.007 + 0.008 * n)
    return policy


def gpu_like(policy: DraftPolicy) -> DraftPolicy:
    """A few more rows are nearly free (in place of the costs a real engine timed at load)."""
    policy.cost = StepCost()
    for n in (1, 2, 5, 10, 20, 40):
        policy.cost.observe(n, 0.010 + 0.00001 * n)
    return policy


def test_step_costs_are_learned_from_the_steps():
    cost = cpu_like(DraftPolicy(6)).cost
    assert cost.seconds(8) == pytest.approx(0.071)
    assert cost.seconds(1000) == pytest.approx(8.007)  # beyond the largest step seen: the last slope
    only_one = DraftPolicy(6).cost
    only_one.observe(1, 0.010)
    assert only_one.seconds(3) == pytest.approx(0.020)  # one size seen: a row costs half a one-token step


def test_step_costs_are_timed_at_load_the_fastest_of_each_size_counting():
    """measure_step_costs times steps of 1, 2, 4, ... rows, the sizes in turn, the fastest of each
    kept (a fake clock: the second round of each size is the slow one)."""
    clock = iter(range(10_000))
    timed: list[int] = []

    def fake_clock() -> float:
        return next(clock) * 0.001

    def decode(n: int) -> None:
        timed.append(n)
        for _ in range(n * (1 + (timed.count(n) == 2))):  # each row a millisecond, the 2nd round twice that
            next(clock)

    original = draft_policy.time.perf_counter
    draft_policy.time.perf_counter = fake_clock
    try:
        cost = measure_step_costs(decode, 7)
    finally:
        draft_policy.time.perf_counter = original
    assert timed == [1, 2, 4, 7] * draft_policy.MEASURED_REPEATS
    assert [n for n, _ in cost.points()] == [1, 2, 4, 7]
    assert [t for _, t in cost.points()] == pytest.approx([0.002, 0.003, 0.005, 0.008])


def test_the_same_guesses_get_the_same_plan_whatever_was_drafted_and_timed_before():
    """Decisions come from counts and the costs fixed at load: what other requests' drafts kept
    moves /status's figures, never the next plan (the same greedy request answers the same)."""
    guess = Guess(list(range(6)), 12)
    policy = cpu_like(DraftPolicy(6))
    first = policy.plan([(guess, NgramIndex())], 1, 1, 100)
    for _ in range(50):
        policy.acceptance.record(12, 6, 0, NgramIndex())  # others' drafts all refused
    assert policy.plan([(guess, NgramIndex())], 1, 1, 100) == first
    assert policy.snapshot()["drafts_counted"]["12-15"] == 50


def test_drafts_run_long_where_rows_are_cheap_and_short_or_none_where_they_are_not():
    long_guess, short_guess = Guess(list(range(6)), 12), Guess(list(range(6)), 4)
    assert gpu_like(DraftPolicy(6)).plan([(long_guess, NgramIndex())], 1, 1, 100) == [6]
    cpu = cpu_like(DraftPolicy(6))
    one = cpu.plan([(long_guess, NgramIndex())], 1, 1, 100)[0]
    assert 1 <= one < 6  # one sequence: a near-certain guess pays for a few rows
    assert cpu.plan([(short_guess, NgramIndex())], 1, 1, 100)[0] <= 1  # a 4-token match: a coin toss
    # Eight sequences share the step: each extra row slows all eight, so only the likeliest pay, if any.
    eight = cpu.plan([(long_guess, NgramIndex())] * 8, 8, 8, 100)
    assert sum(eight) < 8 * one
    assert cpu.plan([(short_guess, NgramIndex())] * 8, 8, 8, 100) == [0] * 8
    # Rows that are nearly free still stop at the step's room, the likeliest (first) positions first.
    assert gpu_like(DraftPolicy(6)).plan([(long_guess, NgramIndex())] * 8, 8, 8, 10) == [2, 2, 1, 1, 1, 1, 1, 1]


def test_a_sequence_whose_guesses_fail_stops_drafting_and_one_whose_guesses_hold_drafts_more():
    policy = cpu_like(DraftPolicy(6))
    guess = Guess(list(range(6)), 8)
    failing, holding = NgramIndex(), NgramIndex()
    before = policy.plan([(guess, NgramIndex())], 1, 1, 100)[0]
    assert before > 0
    # The same match class: most of its drafts are kept (another sequence's), this one's are not.
    for _ in range(20):
        policy.acceptance.record(8, 6, 6, holding)
    for _ in range(3):
        policy.acceptance.record(8, 2, 0, failing)
    fresh = policy.plan([(guess, NgramIndex())], 1, 1, 100)[0]
    assert fresh > 0  # the class still guesses well ...
    assert policy.plan([(guess, failing)], 1, 1, 100) == [0]  # ... but not for this sequence
    assert policy.plan([(guess, holding)], 1, 1, 100)[0] > before


def request(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Request:
    params.setdefault("temperature", 0)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


COUNTING = list(range(1, 21))
REPEATING = [*COUNTING, *COUNTING[:9]]  # its next token is 10: then 10 tokens match the start


def scheduled_after_one_token(s: Scheduler) -> dict[str, tuple[list[int], int]]:
    out = s.schedule()
    for chunk in out.batched + out.solo:
        s.advance(chunk, [10])
    out = s.schedule()
    return {c.request.request_id: (c.draft, len(c.tokens)) for c in out.batched + out.solo}


def test_only_greedy_requests_get_drafts_and_never_past_max_tokens():
    s = Scheduler(ctx_size=1000, max_running=8, n_batch=128, max_waiting=10, draft_tokens=4, draft_max_sequences=8)
    assert s.drafts is not None
    gpu_like(s.drafts)
    s.add_request(request("greedy", REPEATING))
    s.add_request(request("sampled", REPEATING, temperature=0.7))
    s.add_request(request("short", REPEATING, max_tokens=3))
    drafts = scheduled_after_one_token(s)
    assert drafts["greedy"] == ([11, 12, 13, 14], 5)
    assert drafts["short"] == ([11], 2)  # 1 sampled + 1 drafted + the pick after it = max_tokens 3
    assert drafts["sampled"] == ([], 1)


def test_a_reproducible_request_never_drafts_and_others_draft_beside_it():
    # Its lane (runner.Lane) keeps its cells apart: the holes refused drafts leave are not among them.
    s = Scheduler(ctx_size=1000, max_running=8, n_batch=128, max_waiting=10, draft_tokens=4, draft_max_sequences=8)
    assert s.drafts is not None
    gpu_like(s.drafts)
    s.add_request(request("greedy", REPEATING))
    s.add_request(request("repro", REPEATING, reproducible=True))
    drafts = scheduled_after_one_token(s)
    assert drafts["repro"] == ([], 1) and drafts["greedy"][0]


def test_a_draft_that_promises_less_than_the_noise_is_not_decoded():
    # A second row at 90% of a one-token step: a near-certain guess would make the step 5% faster
    # per token on paper, less than a step time's own drift; a third of a step pays clearly.
    guess, index = Guess([1, 2, 3, 4, 5, 6], MAX_MATCH), NgramIndex()
    for row_cost, drafts in ((0.9, False), (0.33, True)):
        policy = DraftPolicy(6)
        for n in (1, 2, 4, 8):
            policy.cost.observe(n, 0.010 * (1 + row_cost * (n - 1)))
        assert (sum(policy.plan([(guess, index)], 1, 1, 100)) > 0) is drafts


def test_no_drafts_in_a_step_that_carries_a_prompt():
    # A request waiting for its first token would wait for the drafts' rows as well.
    s = Scheduler(ctx_size=1000, max_running=8, n_batch=128, max_waiting=10, draft_tokens=4, draft_max_sequences=8)
    assert s.drafts is not None
    gpu_like(s.drafts)
    s.add_request(request("greedy", REPEATING))
    (chunk,) = s.schedule().batched
    s.advance(chunk, [10])
    s.add_request(request("newcomer", [7, 3, 5]))
    out = s.schedule()
    assert {c.request.request_id: c.draft for c in out.batched} == {"greedy": [], "newcomer": []}
    for chunk in out.batched:
        s.advance(chunk, [11 if chunk.request.request_id == "greedy" else 8])
    drafts = {c.request.request_id: c.draft for c in s.schedule().batched}
    assert drafts == {"greedy": [12, 13, 14, 15], "newcomer": []}  # the prompt is in: drafts again


def test_no_drafts_while_more_sequences_decode_than_allowed():
    s = Scheduler(ctx_size=1000, max_running=8, n_batch=128, max_waiting=10, draft_tokens=4, draft_max_sequences=1)
    assert s.drafts is not None
    gpu_like(s.drafts)
    for rid in "ab":
        s.add_request(request(rid, REPEATING))
    out = s.schedule()
    for chunk in out.batched:
        s.advance(chunk, [10])
    assert all(not c.draft for c in s.schedule().batched)


# The fake "model" continues every token with the next integer, so a prompt that counts up and then
# starts over makes drafts it confirms; one that went on differently before makes drafts it refuses.
CONFIRMED = " ".join(map(str, REPEATING))
REFUSED = "1 2 3 4 5 6 7 8 9 30 31 32 33 1 2 3 4 5 6 7 8"


def test_drafts_give_the_tokens_one_token_steps_give_in_fewer_steps():
    for prompt in (CONFIRMED, REFUSED):
        results = {}
        for draft in (0, 4):
            with fake_engine(draft_tokens=draft, n_batch=32) as engine:
                at_load = len(engine.fake.calls)  # with drafts, the steps timed at load
                result = engine.generate(prompt, params=SamplingParams(max_tokens=9, temperature=0))
                stats, calls = engine.stats(), len(engine.fake.calls) - at_load
                # Refused drafts left no cells: the cache holds exactly what it says it holds.
                assert engine.fake.live_cells() == stats.scheduler.prefix_cache_cells
            results[draft] = (result.text, result.token_ids, result.counts, calls, stats)
        assert results[4][:3] == results[0][:3]
        first = 10 if prompt == CONFIRMED else 9
        assert results[0][1] == list(range(first, first + 9))
        drafted = results[4][4]
        if prompt == CONFIRMED:
            assert drafted.draft_accepted_total > 0 and results[4][3] < results[0][3]
        else:
            assert drafted.draft_tokens_total > 0 and drafted.draft_accepted_total == 0
        assert results[0][4].draft_tokens_total == 0


def test_an_answer_that_ends_inside_a_confirmed_draft_keeps_nothing_after_its_end():
    with fake_engine(draft_tokens=4, n_batch=32) as engine:
        result = engine.generate(CONFIRMED, params=SamplingParams(max_tokens=20, temperature=0, stop=["13 "]))
        assert result.finish_reason == "stop" and result.text == "10 11 12 "
        assert result.token_ids == [10, 11, 12, 13] and result.counts.output == 4
        assert engine.stats().draft_accepted_total > 0
        assert engine.get_request(result.request_id).ngrams is None  # freed with the request
        follow = engine.generate(CONFIRMED + " 10 11 12 13 14", params=SamplingParams(max_tokens=2, temperature=0))
        # The next turn finds the first turn's computed tokens in the cache, and nothing it did not compute.
        assert follow.text == "15 16 " and follow.counts.cached >= len(REPEATING)


def test_the_real_model_gives_the_same_tokens_with_and_without_drafts(model_path):
    # One llama.cpp thread: with two, llama.cpp's flash attention splits a one-token step's cells
    # between the threads and the rounding differs from a step of several tokens (near-ties can tip).
    prompt = "Repeat after me three times: the quick brown fox jumps over the lazy dog."
    messages = [{"role": "user", "content": prompt}]
    answers = {}
    for draft in (0, 4):
        engine = Engine(settings=Settings(), parallel=2, ctx_size=2048, threads=1, draft_tokens=draft)
        engine.start()
        if engine.scheduler is not None and engine.scheduler.drafts is not None:
            # On one CPU thread a row costs as much as a one-token step, so the policy would rightly
            # not draft at all: give it the costs of a machine where rows are cheap (a GPU's).
            gpu_like(engine.scheduler.drafts)
        try:
            result = engine.generate(messages=messages, params=SamplingParams(max_tokens=64, temperature=0))
            answers[draft] = (result.token_ids, engine.stats())
        finally:
            engine.shutdown()
    assert answers[4][0] == answers[0][0]
    assert answers[4][1].draft_accepted_total > 0, "the answer repeats its prompt: drafts should be confirmed"
    assert answers[0][1].draft_tokens_total == 0
