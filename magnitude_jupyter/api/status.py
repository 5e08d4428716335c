"""`/status` and `/v1/models`: the pool's and engines' snapshots as the JSON that the Lab panel,
the magics, calibration and OpenAI clients read."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..engine import Engine
from ..engine.pool import ModelPool, Resident
from ..engine.runner import gpu_offload_supported
from ..engine.slo import evaluate
from ..engine.stats import EngineStats
from ..models.registry import ModelEntry, file_sha256, read_model_info

SETTINGS_SHOWN = (
    *("parallel", "ctx_size", "threads", "gpu_layers", "n_batch", "n_ubatch", "prefix_cache_ram_mib"),
    *("cache_type", "cache_type_v", "memory_budget", "mlock", "mmap", "repack", "flash_attention"),
)


def status_json(stats: EngineStats, pool: ModelPool | None = None, engine: Engine | None = None) -> dict[str, Any]:
    """One engine's figures (the shape one-model clients read), and every resident model's summary;
    `engine`, the one the figures are of (None: not loaded), judges its objectives."""
    sched = stats.scheduler
    body = {
        "model": stats.model,
        "state": stats.state,
        "error": stats.error,
        "parallel": stats.parallel,
        "threads": stats.threads,
        "ctx_size": sched.kv_cells_total,
        "trained_context": stats.trained_context,
        "default_max_tokens": stats.default_max_tokens,
        "running": sched.running,
        "waiting": sched.waiting,
        "kv_cells_reserved": sched.kv_cells_reserved,
        "kv_cells_used": sched.kv_cells_used,
        "kv_cells_total": sched.kv_cells_total,
        "prefix_cache_cells": sched.prefix_cache_cells,
        "prefix_cache_entries": sched.prefix_cache_entries,
        "prefix_cache_ram_entries": sched.prefix_cache_ram_entries,
        "prefix_cache_ram_bytes": sched.prefix_cache_ram_bytes,
        "prompt_tokens_looked_up": sched.prompt_tokens_looked_up,
        "prompt_tokens_cached": sched.prompt_tokens_cached,
        "prompt_tokens_restored": sched.prompt_tokens_restored,
        "prompt_tokens_respelled": sched.prompt_tokens_respelled,
        "prompt_tokens_window_missed": sched.prompt_tokens_window_missed,
        "prompt_tokens_window_checkpoint": sched.prompt_tokens_window_checkpoint,
        "prefix_cache_window_checkpoints": sched.prefix_cache_window_checkpoints,
        "prefix_cache_spilled": sched.prefix_cache_spilled,
        "admission": sched.admission,
        "preemptions": sched.preemptions,
        "preempted_waiting": sched.preempted_waiting,
        "preempted_cells": sched.preempted_cells,
        "preempted_seconds": sched.preempted_seconds,
        "preempted_state_bytes": sched.preempted_state_bytes,
        "answer_charge_tokens": sched.answer_charge_tokens,
        "prefix_cache_hit_rate": (
            round(sched.prompt_tokens_cached / sched.prompt_tokens_looked_up, 4)
            if sched.prompt_tokens_looked_up
            else None
        ),
        "kv_cache_type": stats.kv_cache_type,
        "flash_attention": stats.flash_attention,
        "flash_attention_reason": stats.flash_attention_reason,
        "flash_attention_source": stats.flash_attention_source,
        "load_phase": stats.load_phase,
        "kv_bytes_per_token": stats.kv_bytes_per_token,
        "kv_bytes_planned": stats.kv_bytes_planned,
        "kv_window": stats.kv_window,
        "kv_buffer_bytes_reported": stats.kv_buffer_bytes_reported,
        "context_sizing": stats.context_sizing,
        "rss_bytes": stats.rss_bytes,
        "recent_tokens_per_s": stats.recent_tokens_per_s,
        "generated_tokens_total": stats.generated_tokens_total,
        "draft_tokens_total": stats.draft_tokens_total,
        "draft_accepted_total": stats.draft_accepted_total,
        "drafts": stats.drafts,
        "steps": asdict(stats.steps) if stats.steps is not None else None,
        "uptime_s": stats.uptime_s,
        # Requests waiting for this model's load come first: its engine has not got them yet.
        "requests": [asdict(r) for r in (pool.load_waiters(stats.model) if pool is not None else [])]
        + [asdict(r) for r in stats.live],
        "recent": [asdict(r) for r in stats.recent],
    }
    if pool is not None:
        body["slo"] = slo_json(pool, engine, stats.model)
        body["default_model"] = pool.default_model
        body["models"] = [resident_json(pool, r) for r in pool.residents()]
        body["max_loaded_models"] = pool.settings.max_loaded_models
        models_dir = pool.settings.models_dir
        body["models_dir"] = str(models_dir) if models_dir is not None else None
    return body


def resident_json(pool: ModelPool, resident: Resident) -> dict[str, Any]:
    """A resident model in brief, for the panel's list and `magnitude list`."""
    sched = resident.engine.stats().scheduler
    return {
        "id": resident.entry.alias,
        **resident.to_json(),
        "memory": resident.plan.to_json(),
        "prefix_cache_ram_bytes": sched.prefix_cache_ram_bytes,
        "running": sched.running,
        "waiting": sched.waiting,
        "kv_cells_used": sched.kv_cells_used,
        "kv_cells_total": sched.kv_cells_total,
        "recent_tokens_per_s": round(resident.engine.metrics.recent_tokens_per_s(), 2),
        "default": resident.entry.alias == pool.default_model,
    }


ROUTER_STATUS = {"ready": "loaded", "loading": "loading", "created": "loading"}


def model_json(pool: ModelPool, entry: ModelEntry) -> dict[str, Any]:
    """One model as `/v1/models` lists it: OpenAI's fields, then whether it is loaded, what memory it
    holds (or would hold), its settings, and its file's metadata. Reads files: call off the loop."""
    resident = pool.held(entry.alias)
    # A loaded model shows what it runs with (ctx_size auto resolved); another, what it would load with.
    settings = resident.engine.engine_settings if resident is not None else pool.engine_settings(entry)
    body: dict[str, Any] = {
        "id": entry.alias,
        "object": "model",
        "created": int(entry.path.stat().st_mtime) if entry.path.exists() else int(pool.started_at_wall),
        "owned_by": "magnitude",
        "loaded": resident is not None and resident.engine.ready,
        "state": resident.engine.state if resident is not None else "unloaded",
        # llama-server's router speaks of a model's status so (Pi's llama.cpp provider reads it)
        "status": {"value": ROUTER_STATUS.get(resident.engine.state, "unloaded") if resident else "unloaded"},
        "default": entry.alias == pool.default_model,
        "source": entry.source,
        "settings": {name: getattr(settings, name) for name in SETTINGS_SHOWN},
        "error": pool.failure(entry.alias),
    }
    if settings.gpu_layers and not gpu_offload_supported():
        body["settings"]["gpu_layers_ignored"] = "this build of llama-cpp-python has no GPU support"
    if resident is not None:
        body |= resident.to_json()
        sizing = resident.engine.context_sizing
        body["settings"]["context_sizing"] = sizing.reason if sizing is not None else None
    try:
        info = read_model_info(entry.path)
        # What one request may hold, as agents read it to size their prompts (Hermes Agent, Pi Agent).
        running = resident.engine.context_length if resident is not None else None
        cells = settings.ctx_size if isinstance(settings.ctx_size, int) else info.trained_context
        body["context_length"] = running or min(cells, info.trained_context or cells)
        body["memory"] = pool.plan(entry).to_json()
        chat_format = info.chat_format(pool.settings.model_settings(entry.alias).chat_template)
        body["meta"] = {**info.to_json(), "sha256": file_sha256(entry.path), "chat_format": chat_format.to_json()}
    except Exception as exc:  # a broken file is listed, with why it cannot be served
        body["memory"] = body["meta"] = None
        body["error"] = body["error"] or f"cannot read {entry.path}: {exc}"
    return body


def props_json(pool: ModelPool, entry: ModelEntry) -> dict[str, Any]:
    """llama-server's `/props` for a model: what agent frameworks read to learn the context window
    (`default_generation_settings.n_ctx`) and the slots. Reads the file: call off the loop."""
    model = model_json(pool, entry)
    settings = model["settings"]
    return {
        "default_generation_settings": {"n_ctx": model.get("context_length"), "model": entry.alias},
        "total_slots": settings.get("parallel"),
        "model_alias": entry.alias,
        "model_path": entry.path.name,
        "chat_template": read_model_info(entry.path).chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": "magnitude-jupyter",
    }


def pool_json(pool: ModelPool) -> list[dict[str, Any]]:
    """Every model, the default first (clients that know one model read the first)."""
    entries = sorted(pool.entries(), key=lambda e: e.alias != pool.default_model)
    return [model_json(pool, entry) for entry in entries]


def slo_json(pool: ModelPool, engine: Engine | None, model: str) -> dict[str, Any]:
    """A model's objectives and whether each holds now, over its rolling window (slo.py)."""
    settings = pool.settings.model_slo(model)
    states = evaluate(settings, engine.metrics.finished_since) if engine is not None else []
    return {"window_s": settings.window, "objectives": [state.to_json() for state in states]}
