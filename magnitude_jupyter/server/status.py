"""`/status`: the engine's snapshot as the JSON the Lab panel, the magics and calibration read."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..engine.stats import EngineStats


def status_json(stats: EngineStats) -> dict[str, Any]:
    sched = stats.scheduler
    return {
        "model": stats.model,
        "state": stats.state,
        "error": stats.error,
        "parallel": stats.parallel,
        "threads": stats.threads,
        "ctx_size": sched.kv_cells_total,
        "trained_context": stats.trained_context,
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
        "prefix_cache_hit_rate": (
            round(sched.prompt_tokens_cached / sched.prompt_tokens_looked_up, 4)
            if sched.prompt_tokens_looked_up
            else None
        ),
        "kv_bytes_per_token": stats.kv_bytes_per_token,
        "kv_buffer_bytes_reported": stats.kv_buffer_bytes_reported,
        "rss_bytes": stats.rss_bytes,
        "recent_tokens_per_s": stats.recent_tokens_per_s,
        "generated_tokens_total": stats.generated_tokens_total,
        "uptime_s": stats.uptime_s,
        "requests": [asdict(r) for r in stats.live],
        "recent": [asdict(r) for r in stats.recent],
    }
