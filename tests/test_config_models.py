from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from magnitude_jupyter.cli.main import main
from magnitude_jupyter.config import ConfigError, EngineSettings, load_settings
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS
from magnitude_jupyter.models.registry import (
    BUNDLED_ALIAS,
    ModelNotFoundError,
    bundled_model_path,
    read_model_info,
    resolve_model,
)


def test_defaults_without_a_file(tmp_path):
    settings = load_settings(tmp_path / "missing.yaml", environ={})
    assert settings.default_model == BUNDLED_ALIAS
    assert settings.engine.parallel == 8 and settings.engine.ctx_size == 8192
    assert settings.source is None


def test_file_and_env_overrides(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("default_model: mine\nengine:\n  parallel: 4\n  ctx_size: 4096\n")
    settings = load_settings(path, environ={"MAGNITUDE_PARALLEL": "2"})
    assert settings.default_model == "mine"
    assert settings.engine.parallel == 2 and settings.engine.ctx_size == 4096


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("engine:\n  parallel: many\n", "'parallel'"),
        ("engine:\n  paralel: 4\n", "engine.paralel"),
        ("modeldir: x\n", "'modeldir'"),
        ("engine: [1, 2]\n", "'engine'"),
        ("a: [unclosed\n", "not valid YAML"),
        ("- 1\n- 2\n", "top level must be a mapping"),
    ],
)
def test_broken_config_names_file_and_key(tmp_path, text, fragment):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_models_dir_and_paths(tmp_path):
    bundled = bundled_model_path()
    assert bundled is not None
    models = tmp_path / "models"
    models.mkdir()
    (models / "Other.gguf").symlink_to(bundled)
    # a link out of models_dir is served only when the config says so (test_untrusted_limits.py)
    (tmp_path / "config.yaml").write_text(f"models_dir: {models}\nmodels_dir_follow_links: true\n")
    settings = load_settings(tmp_path / "config.yaml", environ={})
    assert resolve_model(None, settings).alias == BUNDLED_ALIAS
    assert resolve_model("other", settings).source == "models_dir"
    assert resolve_model(str(bundled), settings).source == "path"
    with pytest.raises(ModelNotFoundError, match="known models: smollm2-135m, other"):
        resolve_model("nope", settings)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"), settings)


def test_cli_list_json_is_stable(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(tmp_path / "none.yaml"))
    result = CliRunner().invoke(main, ["list", "--json", "--show-details"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    (model,) = [m for m in data["models"] if m["id"] == BUNDLED_ALIAS]
    assert model["default"] is True and model["source"] == "bundled"
    details = model["details"]
    assert details["kv_bytes_per_token_f16"] == 23040
    # SmolLM2's matrices are Q4_1, which llama.cpp has no batched x86 kernel for, but its embedding is Q8_0
    assert set(details["weight_types"]) == {"Q4_1", "Q8_0"}
    assert details["unbatched_weight_types_x86"] == ["Q4_1"]
    assert 0.7 < details["unbatched_weight_share_x86"] < 0.85
    for key in (
        "architecture",
        "parameters",
        "quantization",
        "file_size",
        "trained_context",
        "layers",
        "attention_heads",
        "kv_heads",
        "head_dim_k",
        "head_dim_v",
        "sliding_window",
        "sliding_window_layers",
        "has_chat_template",
    ):
        assert key in details


def test_cli_list_human_and_broken_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(tmp_path / "none.yaml"))
    result = CliRunner().invoke(main, ["list", "--show-details"])
    assert result.exit_code == 0
    assert "23,040 bytes/token" in result.output and "KV heads" in result.output
    assert "not for 79% of the weights (Q4_1) on x86 CPUs" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  ctx_size: -3\n")
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(bad))
    result = CliRunner().invoke(main, ["list"])
    assert result.exit_code != 0
    assert str(bad) in result.output and "ctx_size" in result.output


def test_unbatched_weights_share():
    info = read_model_info(bundled_model_path())
    assert dataclasses.replace(info, weight_types={"Q8_0": 10, "F16": 5}).unbatched_weights() == (0.0, [])
    share, types = dataclasses.replace(info, weight_types={"Q4_1": 30, "Q6_K": 10, "Q4_K": 60}).unbatched_weights()
    assert share == 0.4 and types == ["Q4_1", "Q6_K"]
    assert dataclasses.replace(info, weight_types={}).unbatched_weights() == (0.0, [])


def test_idle_entries_move_after_the_cache_s_own_default_and_zero_keeps_them(tmp_path):
    assert EngineSettings().prefix_cache_spill_rows == SPILL_AFTER_ROWS
    path = tmp_path / "config.yaml"
    path.write_text("engine:\n  prefix_cache_spill_rows: 0\n")
    assert load_settings(path, environ={}).engine.prefix_cache_spill_rows == 0
    path.write_text("engine:\n  prefix_cache_spill_rows: -1\n")
    with pytest.raises(ConfigError, match="'prefix_cache_spill_rows' must be an integer >= 0"):
        load_settings(path, environ={})


def test_repack_takes_true_false_or_null(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("engine:\n  repack: false\n")
    assert load_settings(path, environ={}).engine.repack is False
    path.write_text("engine:\n  repack: sometimes\n")
    with pytest.raises(ConfigError, match="'repack' must be true, false or null"):
        load_settings(path, environ={})


def test_flash_attention_is_off_on_a_cpu_unless_set_or_a_quantized_v_needs_it(tmp_path):
    assert EngineSettings().flash_attention is None and not EngineSettings().uses_flash_attention
    assert EngineSettings(cache_type="q8_0").uses_flash_attention  # llama.cpp quantizes V only with it
    assert EngineSettings(cache_type="q8_0", cache_type_v="f16", flash_attention=False).uses_flash_attention is False
    assert EngineSettings(gpu_layers=99).uses_flash_attention
    path = tmp_path / "config.yaml"
    path.write_text("engine:\n  flash_attention: on\n")  # YAML reads a bare on/off as true/false
    assert load_settings(path, environ={}).engine.uses_flash_attention
    path.write_text("engine:\n  flash_attention: false\n  cache_type: q4_0\n")
    with pytest.raises(ConfigError, match="'flash_attention': false cannot hold a q4_0 V cache"):
        load_settings(path, environ={})
    path.write_text("engine:\n  flash_attention: sometimes\n")
    with pytest.raises(ConfigError, match="'flash_attention' must be true, false or null"):
        load_settings(path, environ={})
