"""llama.cpp's whole-cache state with its cells grouped by sequence (engine/kv_state.py), on real
states: the bundled model's one cache, and a tiny Gemma 3's two (global layers and a window), with
flash attention on and off (V rows stored per cell, or transposed)."""

from __future__ import annotations

import numpy as np
import pytest

from magnitude_jupyter.engine.kv_state import grouped_by_sequence
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.runner import LlamaRunner, _save_state
from magnitude_jupyter.models.tiny_models import write_tiny_model

pytestmark = pytest.mark.model


def interleaved(r: LlamaRunner) -> list[np.ndarray]:
    """Two sequences whose cells alternate (decoded a token each per step, as a server's answers lie),
    a third copying the first's start; each one's logits for a probe token after."""
    a = r.tokenize("Here is my plan: " + " ".join(f"step{j}" for j in range(20)))
    b = r.tokenize("A list of rivers: " + " ".join(f"river{j}" for j in range(20)))
    n = min(len(a), len(b))
    r.decode([DecodeItem(0, a[:4], 0, False), DecodeItem(1, b[:4], 0, False)])
    for k in range(4, n):
        r.decode([DecodeItem(0, [a[k]], k, False), DecodeItem(1, [b[k]], k, False)])
    r.copy_cells(0, 2, 0, 8)
    r.drop_cells(1, n - 3, -1)  # a freed cell, so a compaction is due
    return [r.logits(r.decode([DecodeItem(s, probe(r), m, True)])[0]) for s, m in ((0, n), (1, n - 3), (2, 8))]


def same_bytes(grouped: np.ndarray | None, state: bytearray) -> bool:
    return grouped is not None and grouped.tobytes() == bytes(state)


def probe(r: LlamaRunner) -> list[int]:
    return r.tokenize(" And", add_special=False)[:1]


@pytest.fixture(params=["bundled", "windowed"])
def runner(request, model_path, tmp_path):
    if request.param == "bundled":
        r = LlamaRunner(model_path, n_ctx=512, n_seq_max=4, n_batch=512, n_threads=1)
    else:
        path = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", sliding_window=64)
        r = LlamaRunner(path, n_ctx=512, n_seq_max=4, n_batch=512, n_threads=1, flash_attention=False)
    yield r
    r.close()


def test_a_state_grouped_by_nothing_is_the_same_bytes(runner):
    interleaved(runner)
    state = _save_state(runner.ctx, -1)
    assert same_bytes(grouped_by_sequence(state, []), state)  # every field parsed, every row where it was
    grouped = grouped_by_sequence(state, [1, 0])
    assert grouped is not None and len(grouped) == len(state) and not same_bytes(grouped, state)


def test_grouped_cells_keep_every_sequence_and_what_attention_reads(runner, request):
    before = interleaved(runner)
    for seq, length in ((0, 1), (1, 1), (2, 1)):  # the probes' cells go: the sequences as they were
        runner.drop_cells(seq, runner.sequence_length(seq) - length, -1)
    lengths = [runner.sequence_length(s) for s in range(3)]
    assert runner.compact_cells(1 << 30, order=[1, 2, 0]) is not None
    assert [runner.sequence_length(s) for s in range(3)] == lengths
    state = _save_state(runner.ctx, -1)
    assert same_bytes(grouped_by_sequence(state, [1, 2, 0]), state)  # already in that order
    assert not same_bytes(grouped_by_sequence(state, [0, 1]), state)
    positions = [lengths[0], lengths[1], 8]
    after = [
        runner.logits(runner.decode([DecodeItem(s, probe(runner), m, True)])[0])
        for s, m in zip(range(3), positions, strict=True)
    ]
    # Cells in other tiles round otherwise (compaction's test, test_runner.py); another sequence differs more.
    for x, y in zip(before, after, strict=True):
        assert float(np.mean(np.abs(x - y))) < 0.3
    if request.node.callspec.params["runner"] == "bundled":  # a tiny model's layers add nothing to tell them apart
        assert float(np.mean(np.abs(after[0] - after[1]))) > 0.6


def test_bytes_that_are_not_a_state_are_left_alone():
    assert grouped_by_sequence(b"", [0]) is None
    assert grouped_by_sequence(b"\x01\x00\x00\x00\xff\xff\xff\xff\x01\x00\x00\x00\x05\x00\x00\x00junk", [0]) is None
