"""Many models in one process: the pool loads on demand, evicts the least recently used idle model,
never unloads a busy one, honours keep_alive, plans memory, and isolates a broken file.

Real engines on the bundled model and a second model re-encoded from it (Q8_0), both small."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from magnitude_jupyter.config import EngineSettings, ModelSettings, Settings, load_settings, parse_keep_alive
from magnitude_jupyter.engine import SamplingParams
from magnitude_jupyter.engine.memory import plan_memory
from magnitude_jupyter.engine.pool import ModelLoadError, ModelPool, NoRoomError
from magnitude_jupyter.models.registry import ModelNotFoundError, read_model_info

from .conftest import wait_for

SECOND = "smollm2-135m-q8_0"
SMALL = EngineSettings(parallel=2, ctx_size=1024, prefix_cache_ram_mib=0)


def small_settings(models_dir: Path, **pool: object) -> Settings:
    return Settings(models_dir=models_dir, engine=SMALL, **pool)  # type: ignore[arg-type]


def answer(pool: ModelPool, model: str | None, max_tokens: int = 4, **use: object) -> tuple[str, float | None]:
    with pool.use(model, **use) as (engine, load_ms):  # type: ignore[arg-type]
        request = engine.submit("The sky is", params=SamplingParams(max_tokens=max_tokens, temperature=0))
    assert request.stream is not None
    wait_for(lambda: request.is_finished, what="the answer")
    return request.output_text, load_ms


def resident(pool: ModelPool) -> list[str]:
    return sorted(r.entry.alias for r in pool.residents())


def test_two_models_stay_resident_and_answer(models_dir):
    pool = ModelPool(small_settings(models_dir)).start()
    try:
        first, _ = answer(pool, None)
        second, load_ms = answer(pool, SECOND)
        assert load_ms is not None and load_ms > 0, "the first request to a model counts its load"
        assert resident(pool) == sorted(["smollm2-135m", SECOND])
        again, load_ms = answer(pool, f"{SECOND}.gguf")  # the file name names it too
        assert load_ms is None, "a resident model does not load again"
        assert second == again
        assert first and second
    finally:
        pool.shutdown()


def test_least_recently_used_idle_model_makes_room(models_dir):
    pool = ModelPool(small_settings(models_dir, max_loaded_models=1)).start()
    try:
        answer(pool, None)
        _, load_ms = answer(pool, SECOND)
        assert load_ms is not None
        assert resident(pool) == [SECOND], "max_loaded_models 1: the default made room"
        _, load_ms = answer(pool, None)
        assert load_ms is not None, "the first model's next request reloads it"
        assert resident(pool) == ["smollm2-135m"]
        default = pool.resident(None)
        assert default is not None and default.keep_alive == -1, "the default, reloaded, stays again"
    finally:
        pool.shutdown()


def test_a_busy_model_is_never_unloaded_under_its_requests(models_dir):
    pool = ModelPool(small_settings(models_dir, max_loaded_models=1)).start()
    try:
        with pool.use(None) as (engine, _):
            long = engine.submit("Count:", params=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        wait_for(lambda: long.output_tokens, what="the long request to start")
        with pytest.raises(NoRoomError, match="busy"), pool.use(SECOND, timeout=0.5):
            pass
        assert not long.is_finished, "the running request was not cut short"
        assert resident(pool) == ["smollm2-135m"]
        engine.cancel(long.request_id)
        _, load_ms = answer(pool, SECOND)  # once idle, it makes room
        assert load_ms is not None and resident(pool) == [SECOND]
    finally:
        pool.shutdown()


def test_keep_alive_zero_unloads_once_idle_and_unload_waits_for_idle(models_dir):
    pool = ModelPool(small_settings(models_dir)).start()
    try:
        answer(pool, SECOND, keep_alive=0.0)
        wait_for(lambda: SECOND not in resident(pool), what="keep_alive 0 to unload the model")
        assert "smollm2-135m" in resident(pool), "the default model stays"
        with pool.use(SECOND) as (engine, _):
            busy = engine.submit("Count:", params=SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        assert pool.unload(SECOND) is False, "a busy model unloads when idle, not now"
        assert SECOND in resident(pool)
        engine.cancel(busy.request_id)
        wait_for(lambda: SECOND not in resident(pool), what="the deferred unload")
        # The default model loads in the background from `start`: on a busy machine it may load still.
        wait_for(lambda: not any(r.busy for r in pool.residents()), what="the default model's load")
        assert pool.unload("smollm2-135m") is True and resident(pool) == []
    finally:
        pool.shutdown()


@pytest.mark.model  # the other model answers
def test_a_broken_file_fails_only_its_own_requests(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    pool = ModelPool(small_settings(tmp_path)).start()
    try:
        with pytest.raises(ModelLoadError) as err:
            answer(pool, "broken")
        assert "broken.gguf" in str(err.value) and "cannot be loaded" in str(err.value)
        assert pool.failure("broken") is not None
        text, _ = answer(pool, None)
        assert text, "the other models keep serving"
    finally:
        pool.shutdown()


def test_memory_plan_and_a_budget_too_small(models_dir):
    info = read_model_info(models_dir / f"{SECOND}.gguf")
    plan = plan_memory(info, SMALL)
    assert plan.weights == info.file_size
    assert plan.kv_cache == 1024 * 23040  # 30 layers x 3 KV heads x 64 x (K + V) x 2 bytes per token
    assert plan.resident == plan.weights + plan.kv_cache + plan.buffers
    tight = ModelPool(small_settings(models_dir), available_memory=lambda: 600 << 20)  # a 512 MiB reserve
    with pytest.raises(ModelLoadError, match=r"needs \d+ MiB .* free beyond the 512 MiB reserve"):
        tight.checkout(SECOND)


def test_memory_makes_room_before_the_count_does(models_dir):
    plan = plan_memory(read_model_info(models_dir / f"{SECOND}.gguf"), SMALL)
    machine = (512 << 20) + plan.ceiling + (plan.ceiling // 2)  # room for one model, not two
    pool: ModelPool

    def available() -> int:  # what the OS would say: loaded models hold their memory
        return machine - sum(r.plan.resident for r in pool.residents() if r.engine.ready)

    pool = ModelPool(small_settings(models_dir, max_loaded_models=3), available_memory=available)
    try:
        answer(pool, None)
        answer(pool, SECOND)
        assert resident(pool) == [SECOND], "the idle default made room in memory"
    finally:
        pool.shutdown()


def test_clients_name_registry_models_only(models_dir, tmp_path):
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes((models_dir / f"{SECOND}.gguf").read_bytes()[:1024])
    pool = ModelPool(small_settings(models_dir))
    with pytest.raises(ModelNotFoundError, match="this server serves"):
        pool.resolve(str(outside))
    assert pool.resolve(str(models_dir / f"{SECOND}.gguf")).alias == SECOND


def test_per_model_settings_win_and_validate(tmp_path, models_dir):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"models_dir: {models_dir}\nmax_loaded_models: 3\nkeep_alive: 2m\n"
        f"models:\n  {SECOND}:\n    parallel: 3\n    ctx_size: 2048\n"
        "    chat_template: '{{ messages[0].content }}'\n"
    )
    settings = load_settings(config, environ={})
    assert settings.keep_alive == 120.0 and settings.max_loaded_models == 3
    own = ModelSettings({"parallel": 3, "ctx_size": 2048}, "{{ messages[0].content }}")
    assert settings.model_settings(SECOND) == own
    pool = ModelPool(settings, overrides={"parallel": 5})
    entry = pool.resolve(SECOND)
    assert (pool.engine_settings(entry).parallel, pool.engine_settings(entry).ctx_size) == (3, 2048)
    assert pool.engine_settings(pool.default_entry).parallel == 5, "the server's flag for the others"
    config.write_text(f"models:\n  {SECOND}:\n    parallel: 0\n")
    with pytest.raises(Exception, match=f"models.{SECOND}: engine setting 'parallel'"):
        load_settings(config, environ={})
    config.write_text(f"models:\n  {SECOND}:\n    speed: 11\n")
    with pytest.raises(Exception, match=f"unknown key 'models.{SECOND}.speed'"):
        load_settings(config, environ={})


def test_keep_alive_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive(30) == 30 and parse_keep_alive("1h") == 3600
    assert parse_keep_alive(-1) == -1 and parse_keep_alive("0") == 0
    for bad in ("soon", True, "5x", None):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


def test_load_time_shows_in_the_request_timings(models_dir):
    pool = ModelPool(small_settings(models_dir))
    try:
        started = time.monotonic()
        with pool.use(SECOND) as (engine, load_ms):
            request = engine.submit(
                "Hi", params=SamplingParams(max_tokens=2, temperature=0), arrival_time=started, load_ms=load_ms
            )
        wait_for(lambda: request.is_finished)
        timings = request.timings()
        assert timings.load_ms is not None and timings.queued_ms is not None
        assert timings.queued_ms >= timings.load_ms > 0, "the queue time includes the load"
    finally:
        pool.shutdown()


def test_a_models_own_chat_template_replaces_the_files(models_dir):
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    settings = Settings(models_dir=models_dir, engine=SMALL, models={SECOND: ModelSettings(chat_template=template)})
    pool = ModelPool(settings)
    try:
        messages = [{"role": "user", "content": "Hello there"}]
        with pool.use(SECOND) as (own, _):
            assert own.prompt_tokens_for(messages=messages) == own.tokenize("<<Hello there>>")
        with pool.use(None) as (default, _):
            assert default.prompt_tokens_for(messages=messages) != default.tokenize("<<Hello there>>")
    finally:
        pool.shutdown()


def test_ctx_size_auto_loads_with_the_cells_its_plan_counted(models_dir):
    """The pool sizes an auto cache once, from its own reading of free memory: an engine sized again
    after evictions freed memory would take more than the room that was made for it."""
    readings = iter(range(1536, 1 << 20, 256))  # MiB free, more at every reading
    auto = EngineSettings(parallel=2, ctx_size="auto", memory_budget=0.5, prefix_cache_ram_mib=0)
    pool = ModelPool(Settings(models_dir=models_dir, engine=auto), available_memory=lambda: next(readings) << 20)
    try:
        with pool.use(None) as (engine, _):
            sizing = engine.context_sizing
            assert sizing is not None and engine.engine_settings.ctx_size == sizing.cells
            assert pool.held(engine.model_id).plan.kv_cache == sizing.cells * sizing.kv_bytes_per_token
            assert sizing.budget_bytes == (1536 - 512) << 19, "half of the first reading less the reserve"
    finally:
        pool.shutdown()
