"""The engine on the real bundled model: nothing here is mocked."""

from __future__ import annotations

import threading
import time

import pytest

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, Priority, PromptTooLongError, SamplingParams
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS

from .conftest import wait_for

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "Explain what a KV cache is in one sentence.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Translate 'good morning' into Spanish:",
    "A haiku about autumn leaves:",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def wait_idle(engine, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats().scheduler
        if stats.running == 0 and stats.waiting == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {engine.stats().scheduler}")


def busy_batch(engine, n=8, max_tokens=96):
    return [
        engine.submit(PROMPTS[i % len(PROMPTS)], params=greedy(max_tokens, ignore_eos=True), priority=Priority.BATCH)
        for i in range(n)
    ]


def test_reproducible_request_is_identical_under_load(engine):
    messages = [{"role": "user", "content": "Tell me about the history of the bicycle."}]
    params = greedy(48, reproducible=True)
    alone = engine.generate(messages=messages, params=params)
    wait_idle(engine)

    batch = busy_batch(engine)
    # the batch runs when the request arrives: 8 sequences decode beside its lane (a state, not a time)
    wait_for(lambda: engine.stats().scheduler.running >= 8, what="the batch running")
    loaded = engine.generate(messages=messages, params=params)
    assert loaded.token_ids == alone.token_ids
    assert loaded.text == alone.text and alone.counts.output > 0
    for r in batch:
        list(engine.stream(r.request_id))

    # sampled, seeded and reproducible: the same seed gives the same text, under load too
    sampled = SamplingParams(max_tokens=32, temperature=0.9, seed=1234, reproducible=True)
    first = engine.generate(messages=messages, params=sampled)
    busy_batch(engine, n=4, max_tokens=48)
    second = engine.generate(messages=messages, params=sampled)
    assert first.token_ids == second.token_ids
    other = engine.generate(messages=messages, params=SamplingParams(**{**sampled.to_json(), "seed": 99}))
    assert other.token_ids != first.token_ids
    wait_idle(engine)


def test_reproducible_requests_started_together_each_answer_as_alone(engine):
    # Each runs in a lane of its own (runner.Lane): in one shared cache, cells freed below a running
    # reproducible sequence took its next tokens out of order, and 2-4 of them started together
    # gave a different 8th token about half the time.
    params = greedy(24, ignore_eos=True, reproducible=True)
    prompts = PROMPTS[:4]
    alone = [engine.generate(p, params=params).token_ids for p in prompts]
    for _ in range(2):
        together = [engine.submit(p, params=params) for p in prompts]
        busy = busy_batch(engine, n=4, max_tokens=40)
        for r in together:
            r.stream.wait_final(120)
        assert [list(r.output_tokens) for r in together] == alone
        for r in busy:
            list(engine.stream(r.request_id))
    wait_idle(engine)  # under the engine's lock, as each request's lane goes with it
    assert engine.runner.lanes == 0


def test_a_reproducible_answer_does_not_depend_on_the_thread_count():
    # The engine changes its thread count with the machine's load (engine/threads.py); a lane without
    # flash attention decodes on all of them. Past 256 cells: attention over more than one block.
    params = greedy(200, ignore_eos=True, reproducible=True)
    prompt = "Write a long story about a lighthouse keeper. " * 12
    answers = []
    for threads in (1, 2):
        with Engine(settings=Settings(), parallel=2, ctx_size=2048, threads=threads) as engine:
            answers.append(engine.generate(prompt, params=params).token_ids)
    assert answers[0] == answers[1] and len(answers[0]) == 200


def test_cancel_mid_generation_gives_kv_back(engine):
    request = engine.submit(PROMPTS[3], params=greedy(400, ignore_eos=True))
    events = engine.stream(request.request_id)
    for _ in range(5):
        next(events)
    seq_id = request.seq_id
    assert seq_id is not None and engine.runner.sequence_length(seq_id) > 0
    assert engine.stats().scheduler.kv_cells_reserved >= len(request.prompt_tokens) + len(request.output_tokens)
    assert engine.cancel(request.request_id)
    rest = list(events)
    assert rest[-1].finish_reason == "cancelled"
    status = wait_idle(engine)
    assert status.kv_cells_reserved == status.prefix_cache_cells == status.kv_cells_used
    assert engine.runner.sequence_length(seq_id) == 0
    assert rest[-1].counts.output == len(request.output_tokens) >= 5


def test_too_long_prompt_is_rejected_with_the_numbers_and_max_tokens_is_a_cap(engine):
    long_prompt = "word " * 9000
    with pytest.raises(PromptTooLongError, match=r"the prompt is \d+ tokens, but this model's context holds 8192"):
        engine.submit(long_prompt, params=greedy(16))
    capped = engine.submit("hello", params=greedy(9000))  # max_tokens is a cap: the context's room
    assert capped.max_tokens == 8192 - len(capped.prompt_tokens)
    engine.cancel(capped.request_id)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit("hello", params=SamplingParams(max_tokens=-1))
    assert engine.generate("Hello", params=greedy(4)).counts.output >= 1  # still serving


def test_stop_strings(engine):
    free = engine.generate("Count: 1, 2, 3, 4, 5, 6,", params=greedy(24))
    assert " 8" in free.text, free.text
    stopped = engine.generate("Count: 1, 2, 3, 4, 5, 6,", params=greedy(24, stop=[" 8"]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(" 8")]


def test_replay_from_event_n_equals_suffix(engine):
    request = engine.submit(PROMPTS[1], params=greedy(40, ignore_eos=True))
    full = list(engine.stream(request.request_id))
    # one event per token; the last token rides on the final event
    assert full[-1].is_final and len(full) == 40
    assert [t for e in full for t in e.token_ids] == request.output_tokens
    for n in (0, 1, 17, 39, 40):
        assert list(engine.stream(request.request_id, after=n)) == full[n:]
    # a reader that joins mid-generation and one that re-attaches get the same text
    request = engine.submit(PROMPTS[2], params=greedy(40, ignore_eos=True))
    first_part = []
    for event in engine.stream(request.request_id):
        first_part.append(event)
        if len(first_part) == 7:
            break  # the "client" disconnects
    resumed = list(engine.stream(request.request_id, after=first_part[-1].id))
    whole = list(engine.stream(request.request_id))
    assert "".join(e.text for e in first_part + resumed) == "".join(e.text for e in whole)


def test_sixteen_concurrent_requests_finish_with_correct_usage(engine):
    lengths = [4 + 7 * i for i in range(16)]
    results: dict[int, object] = {}

    def client(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        results[i] = (prompt, engine.generate(prompt, params=greedy(lengths[i], ignore_eos=True)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 16
    for i, (prompt, result) in results.items():
        assert result.finish_reason == "length"
        assert result.counts.output == lengths[i] == len(result.token_ids)
        assert result.counts.prompt == len(engine.tokenize(prompt))
        assert result.timings["ttft_ms"] > 0 and result.timings["total_ms"] >= result.timings["ttft_ms"]
    wait_idle(engine)


def test_chat_template_and_eos(engine):
    result = engine.generate(messages=[{"role": "user", "content": "Say hi."}], params=greedy(64))
    assert result.text.strip()
    assert "<|im_end|>" not in result.text
    assert result.finish_reason in ("stop", "length")


def test_ignore_eos_never_samples_an_end_token(engine):
    """As llama.cpp's server does it: the answer runs to max_tokens without end-of-generation tokens,
    whose text the answer would not show (a resent conversation would then tokenize otherwise).
    Whether any text tokenizes back to the same tokens depends on the tokens sampled, which depend on
    the CPU: only what holds by construction is asserted."""
    messages = [{"role": "user", "content": "Say hi."}]
    natural = engine.generate(messages=messages, params=greedy(64))
    assert natural.finish_reason == "stop"  # the model wants to end here: what ignore_eos must override
    runner = engine.runner
    # Reproducible: computed the same way whatever ran before. Otherwise drafts from the earlier
    # answers to this prompt (the answer memory) can change the batch, and on two threads a
    # near-tie with it, giving a run of tokens that tokenizes back otherwise; that is not what
    # this test is about.
    for params in (
        greedy(64, ignore_eos=True, reproducible=True),  # argmax
        greedy(64, ignore_eos=True, repeat_penalty=1.1, reproducible=True),  # the sampler chain
    ):
        result = engine.generate(messages=messages, params=params)
        assert result.finish_reason == "length" and len(result.token_ids) == 64
        assert not [t for t in result.token_ids if runner.is_eog(t)], result.token_ids
        assert "<|im_end|>" not in result.text and "<|endoftext|>" not in result.text
    wait_idle(engine)


def test_rows_with_a_shared_prefix_reuse_its_cells(engine):
    system = (
        "You are a sentiment classifier for product reviews. Read the review and answer with exactly one "
        "word, positive or negative, in lower case, with no punctuation and no explanation at all. "
    )
    reviews = ["I loved it.", "It broke after a day.", "Works great, would buy again.", "Terrible support."]
    first = engine.submit(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": reviews[0]}],
        params=greedy(24, ignore_eos=True),
        priority=Priority.BATCH,
    )
    next(engine.stream(first.request_id))  # its prompt is in the cache
    rest = [
        engine.generate(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": r}],
            params=greedy(4),
            priority=Priority.BATCH,
        )
        for r in reviews[1:]
    ]
    for result in rest:
        cached = result.counts.cached
        assert cached >= 32 and cached < result.counts.prompt
        assert result.text.strip()
    list(engine.stream(first.request_id))
    status = wait_idle(engine)
    assert status.prefix_cache_cells >= 32 and status.kv_cells_reserved == status.prefix_cache_cells


def chat(engine, messages, max_tokens=24, **kw):
    return engine.generate(messages=messages, params=greedy(max_tokens, **kw))


def test_each_turn_of_a_conversation_reuses_everything_before_it(engine):
    messages = [{"role": "system", "content": "You are a patient teacher who answers in two sentences."}]
    previous = 0  # prompt + answer tokens of the turn before
    for question in ["What is a lighthouse?", "Who keeps it?", "Is that job still done?"]:
        messages.append({"role": "user", "content": question})
        result = chat(engine, messages)
        cached = result.counts.cached
        if previous:
            # everything up to the end of the last answer was cached; only the new turn is computed
            assert cached >= previous - 2 and cached < result.counts.prompt, (cached, previous)
        previous = result.counts.prompt + result.counts.output
        messages.append({"role": "assistant", "content": result.text})
    assert engine.stats().scheduler.prefix_cache_entries >= 1


def test_a_repeated_prompt_is_served_from_the_cache(engine):
    messages = [{"role": "user", "content": "Name three uses of a paperclip, one per line."}]
    cold = chat(engine, messages, 32)
    warm = chat(engine, messages, 32)
    # the chat template's head may be cached from earlier requests; the question is not
    assert cold.counts.cached < cold.counts.prompt - 10
    # all but the last prompt token (which must be computed for its logits) came from the cache
    assert warm.counts.cached == warm.counts.prompt - 1
    # the same answer up to float noise: where cells sit in the shared cache changes how llama.cpp's
    # attention groups them, so long greedy runs may part; the start does not
    assert warm.token_ids[:4] == cold.token_ids[:4]
    # A reproducible request computes everything, always, in a context of its own (runner.Lane).
    lone = chat(engine, messages, 32, reproducible=True)
    assert lone.counts.cached == 0
    assert lone.token_ids[:4] == cold.token_ids[:4]


def test_cache_pressure_evicts_entries_and_never_hurts_a_running_request():
    # A small cache (1,024 cells) that a few prompts overflow, beside a request that runs throughout.
    with Engine(settings=Settings(), parallel=2, ctx_size=1024, prefix_cache_ram_mib=0) as small:
        runs = small.submit("Count slowly: one, two, three,", params=greedy(200, ignore_eos=True))
        reader = threading.Thread(target=lambda: list(small.stream(runs.request_id)))
        reader.start()  # a reader stays attached: the grace period never applies
        for i in range(6):
            prompt = f"Topic {i}: " + " ".join(f"word{i}x{j}" for j in range(60))
            assert chat(small, [{"role": "user", "content": prompt}], 4).finish_reason in ("stop", "length")
        reader.join(120)
        final = list(small.stream(runs.request_id))[-1]
        assert final.finish_reason == "length" and final.counts.output == 200
        stats = wait_idle(small)
        looked_up = stats.prompt_tokens_looked_up
        assert stats.prefix_cache_cells < looked_up  # entries were evicted to make room
        assert stats.kv_cells_used == stats.prefix_cache_cells == stats.kv_cells_reserved <= 1024


def test_an_evicted_conversation_comes_back_from_ram_as_if_it_never_left():
    talk = [{"role": "user", "content": "Here is my plan: " + " ".join(f"step{j}" for j in range(120))}]
    others = [
        [{"role": "user", "content": f"Other {i}: " + " ".join(f"w{i}x{j}" for j in range(80))}] for i in range(3)
    ]
    next_token = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=5)

    def follow_up(evict: bool):
        with Engine(settings=Settings(), parallel=2, ctx_size=1024, prefix_cache_ram_mib=64) as small:
            first = chat(small, talk, 16)
            if evict:  # other prompts push the conversation out of the KV cache, into RAM (~10 MB each)
                for other in others:
                    chat(small, other, 2)
                assert small.stats().scheduler.prefix_cache_ram_entries >= 1
            follow = [*talk, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
            request = small.submit(messages=follow, params=next_token)
            (token_event, *_) = [e for e in small.stream(request.request_id) if e.logprobs]
            counts = request.token_counts()
            return token_event.logprobs[0], counts.cached, small.stats().scheduler

    kept, kept_cached, _ = follow_up(evict=False)
    restored, restored_cached, stats = follow_up(evict=True)
    assert stats.prompt_tokens_restored >= 405 - 32  # all but the chat template's head, which stayed in the tree
    assert restored_cached == kept_cached >= 405  # the whole first turn came back
    # The same next token. Not the same logits to the last bit: where cells sit in the shared cache
    # changes how llama.cpp's attention groups them (the restore itself is exact: test_runner.py).
    assert restored.token == kept.token


def test_a_conversation_idle_while_others_decode_moves_to_ram_and_comes_back_whole():
    """No cache pressure at all: the entry moves because holding its cells slows every row decoded
    (prefix_cache.SPILL_AFTER_ROWS); once nothing runs it comes back into the KV cache, and its next
    turn starts from it instead of recomputing it."""
    talk = [{"role": "user", "content": "Here is my plan: " + " ".join(f"step{j}" for j in range(120))}]
    with Engine(settings=Settings(), parallel=2, ctx_size=4096, prefix_cache_ram_mib=64) as eng:
        first = chat(eng, talk, 16)
        # A plain prompt: it shares no chat-template head with the conversation (which would pin it).
        eng.generate(prompt="Count slowly: one, two, three,", params=greedy(SPILL_AFTER_ROWS + 16, ignore_eos=True))
        deadline = time.monotonic() + 30
        stats = wait_idle(eng)
        while stats.prefix_cache_ram_entries and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = eng.stats().scheduler
        assert stats.prefix_cache_spilled >= 1
        assert stats.prefix_cache_ram_entries == 0 and stats.prefix_cache_ram_bytes == 0
        assert stats.prompt_tokens_restored >= 405 - 32  # back, but for the template head the tree kept
        assert stats.prefix_cache_cells < stats.kv_cells_total // 4  # no pressure made it move
        follow = [*talk, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
        result = chat(eng, follow, 4)
        assert result.counts.cached >= 405  # the whole first turn


def test_step_counts_account_for_every_row_llama_decode_computed(engine):
    before = engine.stats()
    result = chat(engine, [{"role": "user", "content": "Count from one to twenty, in words."}], 24, ignore_eos=True)
    after = engine.stats()
    assert before.steps is not None and after.steps is not None
    counts = result.counts
    computed_prompt = counts.prompt - counts.cached
    refused = (after.draft_tokens_total - after.draft_accepted_total) - (
        before.draft_tokens_total - before.draft_accepted_total
    )
    rows = after.steps.decode_rows - before.steps.decode_rows
    assert after.steps.decode_prompt_rows - before.steps.decode_prompt_rows == computed_prompt
    # every answer token but the last is decoded once (the last is sampled, never decoded; a guess the
    # picks confirmed is one of them), plus the guesses they refused
    assert rows == computed_prompt + counts.output - 1 + refused
    calls = after.steps.decode_calls - before.steps.decode_calls
    assert 1 <= calls <= rows
    decode_s = after.steps.decode_seconds - before.steps.decode_seconds
    step_s = after.steps.step_seconds - before.steps.step_seconds
    assert 0 < decode_s <= step_s


def test_a_reproducible_answer_is_the_same_across_a_preemption():
    """Under `admission: estimate` an interactive answer that runs long takes the cells of a batch
    request's lane: the lane is saved, restored later, and its answer is the one it gives alone."""
    lane_params = greedy(150, ignore_eos=True, reproducible=True)
    lane_prompt = "Describe the water cycle in detail, step by step."
    with Engine(settings=Settings(), parallel=2, ctx_size=256, admission="estimate") as small:
        assert small.scheduler is not None
        for priority in Priority:  # answers so far were short: new ones are charged for 16 tokens
            for _ in range(8):
                small.scheduler.lengths.record(priority, None, 15)
        lane = small.submit(lane_prompt, params=lane_params, priority=Priority.BATCH)
        grower = small.submit(
            "Write a long story about a lighthouse keeper.",
            params=SamplingParams(max_tokens=200, temperature=0.8, seed=7, ignore_eos=True),
        )
        for request in (lane, grower):
            assert request.stream is not None
            final = request.stream.wait_final(300)
            assert final.finish_reason == "length" and final.error is None
        assert lane.preemptions == 1 and grower.preemptions == 0
        assert small.stats().scheduler.preemptions == 1
        preempted = list(lane.output_tokens)
        alone = small.generate(lane_prompt, params=lane_params)
    assert len(preempted) == 150
    assert preempted == alone.token_ids


def test_the_attention_kernel_is_measured_at_load_and_remembered_only_when_trusted(tmp_path, monkeypatch):
    """On a quiet machine the probe measures and the next load remembers; on a busy one (CI runs beside
    a CPU hog) the CPU family's default runs and nothing is remembered. Either way the engine says
    which kernel runs and how it was chosen."""
    monkeypatch.setenv("MAGNITUDE_ATTENTION_FILE", str(tmp_path / "attention.json"))
    with Engine(settings=Settings(), parallel=2, ctx_size=1024) as first:
        stats = first.stats()
        assert stats.flash_attention_reason is not None
        assert stats.flash_attention_reason.startswith(f"flash attention {'on' if stats.flash_attention else 'off'}")
        assert stats.flash_attention_source in ("measured", "default")
        if stats.flash_attention_source == "measured":
            assert "measured at load" in stats.flash_attention_reason
        else:
            assert "the default for" in stats.flash_attention_reason and "next load" in stats.flash_attention_reason
        assert first.generate("The capital of France is", params=greedy(4)).finish_reason in ("length", "stop")
    assert (tmp_path / "attention.json").exists() == (stats.flash_attention_source == "measured")
    with Engine(settings=Settings(), parallel=2, ctx_size=1024) as second:
        if stats.flash_attention_source == "measured":
            assert second.stats().flash_attention_source == "remembered"
            assert "measured at an earlier load" in (second.stats().flash_attention_reason or "")
            assert second.stats().flash_attention == stats.flash_attention
        else:
            assert second.stats().flash_attention_source in ("measured", "default")
    with Engine(settings=Settings(), parallel=2, ctx_size=1024, flash_attention=False) as fixed:
        assert fixed.stats().flash_attention_source == "set"
        assert fixed.stats().flash_attention_reason == "flash attention off: set"
