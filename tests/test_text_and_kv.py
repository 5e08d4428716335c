from __future__ import annotations

import pytest

from magnitude_jupyter.engine.budget import KVBudget
from magnitude_jupyter.engine.text import TextAssembler
from magnitude_jupyter.models.kvmath import kv_bytes_per_token, kv_cache_bytes, tokens_that_fit
from magnitude_jupyter.models.registry import bundled_model_path, read_model_info


def feed(assembler: TextAssembler, pieces: list[bytes]) -> list[str]:
    return [assembler.push(p) for p in pieces]


def test_utf8_split_across_tokens_is_held_until_complete():
    text = TextAssembler()
    euro = "€".encode()  # 3 bytes
    assert feed(text, [b"a", euro[:1], euro[1:2]]) == ["a", "", ""]
    assert text.push(euro[2:] + b"b") == "€b"
    assert text.flush() == ""


def test_stop_string_split_across_tokens():
    text = TextAssembler(stop=["END"])
    assert feed(text, [b"hello E", b"N"]) == ["hello ", ""]
    assert text.push(b"D more") == ""
    assert text.stopped_by == "END"
    assert text.push(b"ignored") == ""


def test_false_stop_prefix_is_released():
    text = TextAssembler(stop=["END"])
    assert text.push(b"EN") == ""
    assert text.push(b"X") == "ENX"
    assert text.push(b"E") == ""
    assert text.flush() == "E"


def test_earliest_of_several_stops_wins():
    text = TextAssembler(stop=["b", "a"])
    assert text.push(b"xxab") == "xx"
    assert text.stopped_by == "a"


class Shape:
    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.kv_heads_per_layer = (kv_heads,) * layers
        self.head_dim_k = self.head_dim_v = head_dim


def test_kv_bytes_per_token_uses_kv_heads_not_attention_heads():
    # SmolLM2-135M: 30 layers, 9 attention heads but 3 KV heads, head dim 64
    assert kv_bytes_per_token(Shape(30, 3, 64)) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(Shape(30, 3, 64), "q8_0") == pytest.approx(2 * 30 * 3 * 64 * 34 / 32)
    assert kv_cache_bytes(Shape(30, 3, 64), 8192) == 180 * 1024 * 1024  # llama.cpp reports 180 MiB
    assert tokens_that_fit(180 * 1024 * 1024, 23_040) == 8192
    with pytest.raises(ValueError, match="unknown KV cache type"):
        kv_bytes_per_token(Shape(1, 1, 1), "q3")


def test_bundled_model_metadata():
    path = bundled_model_path()
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    info = read_model_info(path)
    assert (info.architecture, info.layers, info.attention_heads, info.kv_heads) == ("llama", 30, 9, 3)
    assert (info.head_dim_k, info.head_dim_v, info.trained_context) == (64, 64, 8192)
    assert info.quantization == "Q4_1"
    assert info.has_chat_template and "<|im_start|>" in (info.chat_template or "")
    assert 130_000_000 < info.parameters < 140_000_000
    assert kv_bytes_per_token(info) == 23_040


def test_kv_budget_reserves_and_releases():
    budget = KVBudget(100)
    budget.reserve("a", 60)
    assert not budget.fits(41) and budget.fits(40)
    with pytest.raises(ValueError):
        budget.reserve("b", 41)
    assert budget.release("a") == 60 and budget.free == 100


def test_cells_held_for_requests_stay_counted_until_the_last_of_them_ends():
    budget = KVBudget(100)
    budget.reserve("a", 10)
    budget.reserve("b", 10)
    budget.hold(30, ["a", "b"])
    assert budget.free == 50 and budget.held == 30
    assert budget.release("a") == 10 and budget.free == 60 and budget.held == 30  # b holds them still
    assert budget.release("b") == 10 and budget.free == 100 and budget.held == 0
