"""Batching changes nothing but rounding: teacher forcing at the runner level, on the real model.

llama.cpp on CPU is not batch-invariant, so logits differ slightly between a sequence fed alone
and among others; a sequence-id, position or logits-row mix-up would make them differ wildly.
"""

from __future__ import annotations

import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.request import SamplingParams
from magnitude_jupyter.engine.runner import LlamaRunner, repack_weights
from magnitude_jupyter.engine.runner_api import NoRoomForBatch
from magnitude_jupyter.engine.threads import threads_free_now

pytestmark = pytest.mark.model

TARGETS = [
    "The history of the bicycle begins in the early nineteenth century, when",
    "Write a detailed essay about climate change and its effects on",
    "The quick brown fox",
]
OTHERS = [
    "Write a recipe for pancakes:",
    "def quicksort(xs):",
    "Three facts about the moon:",
    "Dear team, I am writing to",
    "The mitochondria is",
    "SELECT name FROM users WHERE",
    "Once upon a time there was a dragon who",
    "In 1969, astronauts",
]
STEPS = 64
TARGET_SEQ = 5  # not seq 0 and not batch row 0: an index mix-up must show


@pytest.fixture(scope="module")
def runner(model_path):
    # the cores others leave free: a thread on a busy core stalls every step (engine/threads.py)
    r = LlamaRunner(model_path, n_ctx=4096, n_seq_max=9, n_batch=512, n_threads=threads_free_now(2))
    yield r
    r.close()


def greedy_continuation(runner: LlamaRunner, prompt: list[int], n: int) -> list[int]:
    runner.start_sequence(0, SamplingParams(temperature=0), prompt, len(prompt))
    (row,) = runner.decode([DecodeItem(0, prompt, 0, True)])
    out = []
    for i in range(n):
        token = runner.sample(0, row)
        out.append(token)
        (row,) = runner.decode([DecodeItem(0, [token], len(prompt) + i, True)])
    runner.end_sequence(0)
    return out


def alone_and_batched_logits(runner: LlamaRunner, target: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Logits of the same forced token sequence, fed alone and fed among 8 other sequences."""
    prompt = runner.tokenize(target)
    forced = greedy_continuation(runner, prompt, STEPS)

    # Alone: the target sequence by itself.
    alone = []
    (row,) = runner.decode([DecodeItem(TARGET_SEQ, prompt, 0, True)])
    alone.append(runner.logits(row))
    for i, token in enumerate(forced[:-1]):
        (row,) = runner.decode([DecodeItem(TARGET_SEQ, [token], len(prompt) + i, True)])
        alone.append(runner.logits(row))
    runner.end_sequence(TARGET_SEQ)
    assert runner.sequence_length(TARGET_SEQ) == 0

    # Among 8 others: the same tokens, each step in one decode with 8 other sequences around it.
    others = dict(zip([s for s in range(9) if s != TARGET_SEQ], [runner.tokenize(t) for t in OTHERS], strict=True))
    position = {seq: 0 for seq in others}
    feed = dict(others)  # what each other sequence is fed next: its prompt, then its own greedy token
    batched = []
    target_feed, target_pos = prompt, 0
    for i in range(STEPS):
        items = [DecodeItem(seq, feed[seq], position[seq], True) for seq in sorted(others) if seq < TARGET_SEQ]
        items.append(DecodeItem(TARGET_SEQ, target_feed, target_pos, True))
        items += [DecodeItem(seq, feed[seq], position[seq], True) for seq in sorted(others) if seq > TARGET_SEQ]
        rows = runner.decode(items)
        for item, row in zip(items, rows, strict=True):
            logits = runner.logits(row)
            if item.seq_id == TARGET_SEQ:
                batched.append(logits)
            else:
                position[item.seq_id] += len(item.tokens)
                feed[item.seq_id] = [int(np.argmax(logits))]
        target_pos += len(target_feed)
        target_feed = [forced[i]]
    for seq in range(9):
        runner.end_sequence(seq)

    return alone, batched


def test_batched_logits_match_alone_up_to_rounding(runner):
    steps = agree = 0
    deltas = []
    for target in TARGETS:
        alone, batched = alone_and_batched_logits(runner, target)
        assert len(alone) == len(batched) == STEPS
        for step, (a, b) in enumerate(zip(alone, batched, strict=True)):
            top2 = np.sort(a)[-2:]
            margin = top2[1] - top2[0]
            same = int(np.argmax(a)) == int(np.argmax(b))
            steps += 1
            agree += same
            deltas.append(float(np.mean(np.abs(a - b))))
            if margin > 2.0:
                assert same, f"{target!r} step {step}: top token differs although the alone margin is {margin:.2f}"
    assert agree / steps >= 0.95, f"top token agrees at only {agree}/{steps} steps"
    assert float(np.median(deltas)) < 1.0, f"median mean |Δlogit| {np.median(deltas):.3f}: more than rounding"


def test_tokenize_roundtrip_and_pieces(runner):
    tokens = runner.tokenize("Hello, world! Ünïcödé €", add_special=False)
    text = b"".join(runner.token_to_piece(t) for t in tokens).decode()
    assert text == "Hello, world! Ünïcödé €"
    assert runner.is_eog(runner.tokenize("<|im_end|>", add_special=False)[0])


def test_copied_prefix_continues_like_the_original(runner):
    prompt = runner.tokenize(
        "You are a careful assistant who answers questions about geography with short, precise sentences. "
        "Always name the continent. Question: where is the city of Lyon?"
    )
    assert len(prompt) >= 30
    (row,) = runner.decode([DecodeItem(0, prompt, 0, True)])
    computed = runner.logits(row)
    runner.copy_cells(0, 1, 0, 24)
    (row,) = runner.decode([DecodeItem(1, prompt[24:], 24, True)])
    copied = runner.logits(row)
    assert int(np.argmax(copied)) == int(np.argmax(computed))
    assert float(np.mean(np.abs(copied - computed))) < 0.5
    runner.end_sequence(0)
    assert runner.sequence_length(1) == len(prompt)  # the shared cells stay while seq 1 holds them
    runner.end_sequence(1)
    assert runner.sequence_length(1) == 0


def test_a_batch_llama_cpp_finds_no_cells_for_leaves_them_as_they_were_and_a_smaller_one_runs(model_path):
    """What the engine does with a step short of cells (engine/step.py, `decode_batched`) rests on
    this: llama_decode's 1 computes nothing and changes no cell, so the step can run again with
    fewer prompt rows, and gives what those rows give computed afresh."""
    runner = LlamaRunner(model_path, n_ctx=1024, n_seq_max=2, n_batch=512, n_threads=threads_free_now(2))
    try:
        words = runner.tokenize("The tide came in over the flat grey sand while the gulls argued. " * 80)
        fill, probe = words[:960], words[960:1060]
        assert len(probe) == 100
        runner.decode([DecodeItem(0, fill[:480], 0, False)])
        runner.decode([DecodeItem(0, fill[480:], 480, False)])  # 64 of the 1,024 cells left
        with pytest.raises(NoRoomForBatch):
            runner.decode([DecodeItem(1, probe, 0, True)])
        assert (runner.sequence_length(0), runner.sequence_length(1)) == (960, 0)
        (row,) = runner.decode([DecodeItem(1, probe[:50], 0, True)])
        after_refusal = runner.logits(row)
        runner.end_sequence(1)
        runner.end_sequence(0)
        (row,) = runner.decode([DecodeItem(1, probe[:50], 0, True)])
        afresh = runner.logits(row)
        assert int(np.argmax(after_refusal)) == int(np.argmax(afresh))
        assert float(np.mean(np.abs(after_refusal - afresh))) < 0.05
        runner.end_sequence(1)
    finally:
        runner.close()


def test_a_saved_sequence_restores_bit_for_bit(model_path):
    """The prefix cache's RAM tier: a sequence saved to bytes and loaded into another id gives the
    very same logits (one thread: nothing else changes how attention groups the cells)."""
    r = LlamaRunner(model_path, n_ctx=2048, n_seq_max=4, n_batch=512, n_threads=1)
    try:
        tokens = r.tokenize("Here is my plan: " + " ".join(f"step{j}" for j in range(120)))
        probe = r.tokenize(" And then?", add_special=False)
        r.decode([DecodeItem(0, tokens, 0, False)])
        original = r.logits(r.decode([DecodeItem(0, probe, len(tokens), True)])[0])
        r.drop_cells(0, len(tokens), -1)
        saved = r.save_sequence(0)
        r.end_sequence(0)
        assert r.sequence_length(0) == 0 and r.restore_sequence(1, saved)
        assert r.sequence_length(1) == len(tokens)
        restored = r.logits(r.decode([DecodeItem(1, probe, len(tokens), True)])[0])
        assert np.array_equal(original, restored)
    finally:
        r.close()


def test_compacting_the_cells_keeps_every_sequence_and_what_it_shares(model_path):
    """compaction.py: the cells in use move to the front, and every sequence keeps its positions, the
    cells it shares and what attention reads (its logits, up to rounding); with nothing freed since
    the last time, or over the byte limit, nothing moves."""
    r = LlamaRunner(model_path, n_ctx=2048, n_seq_max=4, n_batch=512, n_threads=1)
    try:
        assert r.compact_cells(1 << 30) is None  # nothing freed yet
        a = r.tokenize("Here is my plan: " + " ".join(f"step{j}" for j in range(80)))
        b = r.tokenize("A list of rivers: " + " ".join(f"river{j}" for j in range(60)))
        probe = r.tokenize(" And then?", add_special=False)
        r.decode([DecodeItem(0, a, 0, False), DecodeItem(1, b, 0, False)])
        r.copy_cells(1, 2, 0, 20)  # seq 2 shares seq 1's first 20 cells
        r.drop_cells(0, 40, -1)  # a hole where seq 0's tail was
        r.end_sequence(1)  # seq 1's cells but the shared ones go
        before = [r.logits(r.decode([DecodeItem(s, probe, n, True)])[0]) for s, n in ((0, 40), (2, 20))]
        r.drop_cells(0, 40, -1)
        r.drop_cells(2, 20, -1)
        assert r.compact_cells(16) is None  # over the limit
        moved = r.compact_cells(1 << 30)
        assert moved is not None and moved > 0
        assert [r.sequence_length(s) for s in range(3)] == [40, 0, 20]
        assert [r.sequence_start(s) for s in (0, 2)] == [0, 0]
        assert r.compact_cells(1 << 30) is None  # nothing freed since
        after = [r.logits(r.decode([DecodeItem(s, probe, n, True)])[0]) for s, n in ((0, 40), (2, 20))]
        # CPU flash attention sums V in half precision tile by tile, so cells in other tiles round
        # otherwise; another sequence's cells differ several times more.
        for x, y in zip(before, after, strict=True):
            assert float(np.mean(np.abs(x - y))) < 0.3
        assert float(np.mean(np.abs(after[0] - after[1]))) > 0.6  # the probe tells the two apart
    finally:
        r.close()


def test_repack_setting_wins_and_its_default_avoids_the_builds_amx_kernels():
    amx_built = b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()
    assert repack_weights(None) is not amx_built
    assert repack_weights(True) is True and repack_weights(False) is False


def test_a_long_prompt_decodes_with_the_default_settings(model_path):
    """On a CPU with AMX, the pinned llama.cpp's AMX kernels die of SIGILL on the first matrix product
    of a long enough prompt (runner.repack_weights): a child process decodes a 64-token one, so a crash
    fails this test instead of ending the test run."""
    script = f"""
from magnitude_jupyter.engine.request import SamplingParams
from magnitude_jupyter.engine.runner import LlamaRunner
from magnitude_jupyter.engine.plan import DecodeItem
r = LlamaRunner({str(model_path)!r}, n_ctx=1024, n_seq_max=2, n_batch=512, n_threads=2)
tokens = r.tokenize("A long prompt for a wide matrix product. " * 12)
assert len(tokens) >= 64, len(tokens)
r.start_sequence(0, SamplingParams(temperature=0), tokens, len(tokens))
(row,) = r.decode([DecodeItem(0, tokens, 0, True)])
print("next token", r.sample(0, row), "repack", r.repack)
r.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "next token" in done.stdout


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_lets_nothing_through_ends_its_request_and_never_reaches_llama_cpps_accept(runner, temperature):
    """`[z-a]` parses in llama.cpp but matches nothing: its sampler would pick a refused token and its
    grammar abort the process. The engine's language check refuses it first (gbnf_check.py); here it is
    handed to the runner directly, past that check, to show the sampler's own guard."""
    from magnitude_jupyter.engine.runner_api import GrammarDeadEnd

    prompt = runner.tokenize("Say hi.")
    params = SamplingParams(temperature=temperature, seed=1, grammar="root ::= [z-a]")
    runner.start_sequence(0, params, prompt, len(prompt))
    (row,) = runner.decode([DecodeItem(0, prompt, 0, True)])
    with pytest.raises(GrammarDeadEnd) as ended:
        runner.sample(0, row)
    assert not ended.value.complete
    runner.end_sequence(0)
    assert greedy_continuation(runner, prompt, 2)  # the runner goes on serving
