"""Capacity levers on the real bundled model: quantized KV caches, a cache sized from a memory budget,
how the weights are loaded, and the measured price in accuracy of each cache type."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from magnitude_jupyter.cli.main import main
from magnitude_jupyter.config import ConfigError, EngineSettings, Settings
from magnitude_jupyter.engine import Engine, SamplingParams
from magnitude_jupyter.engine.memory import KV_PADDING, _buffers, _output_buffer, cache_sequences, size_context
from magnitude_jupyter.engine.runner import LlamaRunner, load_mode
from magnitude_jupyter.models.kvmath import kv_bytes_per_token
from magnitude_jupyter.models.registry import read_model_info

pytestmark = pytest.mark.model
MiB = 2**20


@pytest.mark.parametrize(
    ("cache_type", "cache_type_v", "label", "bytes_per_token"),
    [
        ("f16", None, "f16", 23_040),
        ("q8_0", None, "q8_0", 12_240),
        ("q4_0", None, "q4_0", 6_480),
        ("q8_0", "f16", "q8_0/f16", 17_640),
    ],
)
def test_each_cache_type_loads_answers_and_allocates_what_was_predicted(
    cache_type, cache_type_v, label, bytes_per_token
):
    settings = {"cache_type": cache_type, "cache_type_v": cache_type_v}
    with Engine(settings=Settings(), parallel=2, ctx_size=1024, threads=2, **settings) as engine:
        result = engine.generate("The capital of France is", params=SamplingParams(max_tokens=6, temperature=0))
        stats = engine.stats()
    assert result.finish_reason in ("stop", "length") and result.text.strip()
    assert stats.kv_cache_type == label and stats.kv_bytes_per_token == bytes_per_token
    # llama.cpp logs the buffer in MiB with two decimals: equal up to that rounding.
    assert stats.kv_buffer_bytes_reported is not None
    assert abs(stats.kv_buffer_bytes_reported - 1024 * bytes_per_token) <= 0.005 * MiB


@pytest.mark.parametrize("flash_attention", [True, False])
def test_both_attention_kernels_load_answer_and_say_which_runs(flash_attention):
    with Engine(settings=Settings(), parallel=2, ctx_size=1024, threads=2, flash_attention=flash_attention) as engine:
        result = engine.generate("The capital of France is", params=SamplingParams(max_tokens=6, temperature=0))
        stats = engine.stats()
    assert result.finish_reason in ("stop", "length") and result.text.strip()
    assert stats.flash_attention is flash_attention


def test_a_cache_type_llama_cpp_does_not_take_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'cache_type' must be one of f16, q8_0, q4_0.*got 'q2_k'"):
        EngineSettings(cache_type="q2_k")
    with pytest.raises(ConfigError, match="only with ctx_size: auto"):
        EngineSettings(memory_budget="1GiB")
    with pytest.raises(ConfigError, match="'memory_budget' must be bytes"):
        EngineSettings(ctx_size="auto", memory_budget="lots")
    env = {"MAGNITUDE_CONFIG": str(tmp_path / "none.yaml"), "MAGNITUDE_RUNTIME_DIR": str(tmp_path / "rt")}
    result = CliRunner().invoke(main, ["serve", "--cache-type", "q2_k", "--port", "0"], env=env)
    assert result.exit_code != 0 and "'q2_k' is not one of 'f16', 'q8_0', 'q4_0'" in result.output


def test_ctx_size_auto_holds_what_the_budget_leaves_for_the_cache(model_path):
    info = read_model_info(model_path)
    es = EngineSettings(parallel=4, ctx_size="auto", memory_budget=0.5, cache_type="q8_0", prefix_cache_ram_mib=64)
    free, reserve = 1536 * MiB, 512 * MiB
    sizing = size_context(info, es, reserve, available_memory=lambda: free)
    budget = (free - reserve) // 2
    left = budget - info.file_size - _buffers(info, es) - 64 * MiB
    expected = int(left // kv_bytes_per_token(info, "q8_0")) // KV_PADDING * KV_PADDING
    assert sizing.budget_bytes == budget and sizing.cells == expected and 8192 <= expected < 4 * 8192
    assert f"{expected:,} cells" in sizing.reason and "12,240 bytes/token (q8_0)" in sizing.reason

    # No more than `parallel` sequences of the trained context, however much memory there is.
    roomy = dataclasses.replace(es, memory_budget="64GiB")
    assert size_context(info, roomy, reserve).cells == 4 * info.trained_context

    small = dataclasses.replace(es, memory_budget="300MiB", cache_type="f16")
    with pytest.raises(ConfigError) as err:
        size_context(info, small, reserve)
    assert "one sequence of the trained context needs 8,192 cells" in str(err.value)
    assert "300 MiB" in str(err.value) and "23,040 bytes/token (f16)" in str(err.value)


def test_an_engine_sized_auto_runs_with_the_cells_it_planned(model_path):
    with Engine(
        settings=Settings(), parallel=2, ctx_size="auto", memory_budget="530MiB", threads=2, cache_type="q4_0"
    ) as engine:
        assert engine.context_sizing is not None
        cells = engine.context_sizing.cells
        result = engine.generate("Hello", params=SamplingParams(max_tokens=4, temperature=0))
        stats = engine.stats()
    assert result.text and stats.scheduler.kv_cells_total == cells == engine.engine_settings.ctx_size
    assert stats.context_sizing and "ctx_size auto" in stats.context_sizing
    assert stats.kv_buffer_bytes_reported is not None
    assert abs(stats.kv_buffer_bytes_reported - cells * 6_480) <= 0.005 * MiB


def test_weights_load_mapped_or_read_and_locked_or_not(model_path):
    import llama_cpp

    assert load_mode(False, None) == llama_cpp.LLAMA_LOAD_MODE_AUTO  # the default is llama.cpp's own
    assert load_mode(False, True) == llama_cpp.LLAMA_LOAD_MODE_MMAP
    assert load_mode(True, None) == llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    assert load_mode(False, False) == llama_cpp.LLAMA_LOAD_MODE_NONE
    with Engine(settings=Settings(), parallel=1, ctx_size=512, threads=2, mmap=False) as engine:
        read = engine.generate("The capital of France is", params=SamplingParams(max_tokens=6, temperature=0))
    with Engine(settings=Settings(), parallel=1, ctx_size=512, threads=2) as engine:
        mapped = engine.generate("The capital of France is", params=SamplingParams(max_tokens=6, temperature=0))
    assert read.token_ids == mapped.token_ids


def test_the_quality_measurement_finds_f16_exact_and_q4_0_not(model_path):
    from magnitude_jupyter.probes.kv_quality import first_divergence, measure

    text = "The history of the bicycle begins in the early nineteenth century, when a German inventor built"
    f16, q4 = measure(model_path, [text], cache_types=("f16", "q4_0"), greedy=8)
    assert (f16.top1_agreement, f16.mean_abs_dlogit, f16.divergence) == (1.0, 0.0, [None])
    assert q4.positions == f16.positions > 10 and q4.mean_abs_dlogit > 0 and 0 < q4.top1_agreement <= 1
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2]) is None


def test_calibrate_compares_cache_types_on_engines_of_its_own(tmp_path):
    env = {"MAGNITUDE_CONFIG": str(tmp_path / "none.yaml"), "MAGNITUDE_PROFILES_DIR": str(tmp_path / "profiles")}
    html = tmp_path / "types.html"
    args = ["calibrate", "--cache-types", "f16,q4_0", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4"]
    result = CliRunner().invoke(main, [*args, "--html", str(html)], env=env)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines() if line[:4] in ("f16 ", "q4_0")}
    assert rows["f16"][1] == "23,040" and rows["q4_0"][1] == "6,480"
    assert int(rows["q4_0"][2].replace(",", "")) > 3 * int(rows["f16"][2].replace(",", "")), "q4_0 holds 3.5x"
    assert html.exists() and "q4_0 (6,480 B\\u002ftoken)" in html.read_text()  # plotly escapes "/"
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2, "a profile per type, archived apart"
    refused = CliRunner().invoke(main, [*args, "--url", "http://127.0.0.1:9"], env=env)
    assert refused.exit_code != 0 and "restarts the engine for each type" in refused.output


def test_the_prefix_cache_asks_llama_cpp_for_the_sequences_it_is_given_and_the_plan_counts_their_rows(
    engine, model_path
):
    # The shared engine: parallel 9, default prefix_cache_entries (64). Each sequence of a context
    # holds a resident logits row (benchmarks/server_memory.py), so the cache asks for no more.
    assert engine.runner.n_seq_max == 9 + EngineSettings().prefix_cache_entries == 73
    info = read_model_info(model_path)
    few, many = (EngineSettings(parallel=4, prefix_cache_entries=n) for n in (8, 200))
    assert _buffers(info, many) - _buffers(info, few) == 192 * info.vocab_size * 4
    capped = EngineSettings(parallel=200, prefix_cache_entries=200)  # llama.cpp holds 256 in all
    assert _buffers(info, capped) - _buffers(info, EngineSettings(parallel=200, prefix_cache_entries=56)) == 0
    with pytest.raises(ConfigError, match="prefix_cache_entries"):
        EngineSettings(prefix_cache_entries=0)


@pytest.mark.parametrize("flash_attention", [True, False])
def test_the_plan_counts_the_compute_buffer_llama_cpp_reserves(model_path, flash_attention):
    # Without flash attention a step's attention scores outgrow its logits past a few thousand cells.
    info = read_model_info(model_path)
    es = EngineSettings(parallel=2, ctx_size=16384, flash_attention=flash_attention)
    runner = LlamaRunner(  # shaped as the engine makes it: steps of n_batch, computed n_ubatch at a time
        model_path,
        es.cells,
        es.parallel + cache_sequences(es),
        n_batch=es.n_batch,
        n_ubatch=es.n_ubatch,
        flash_attention=es.uses_flash_attention,
    )
    try:
        reported = runner.compute_buffer_bytes
    finally:
        runner.close()
    planned = _buffers(info, es, es.cells) - _output_buffer(info, es)
    assert reported is not None and abs(planned - reported) <= 0.15 * reported, (planned, reported)
