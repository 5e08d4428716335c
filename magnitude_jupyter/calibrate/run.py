"""One calibration: capacity, a sweep, the probe, and the profile that records them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..client.http import Client, ClientError, discover, is_magnitude_status
from .capacity import capacity_report, probe
from .pressure import PressureCell, run_pressure_map
from .profile import Profile, machine_info, summarize_levels
from .records import Level, Summary
from .sweep import SweepConfig, run_sweep
from .workflow import DEFAULT_SLO_ROUND_P95_MS, WorkflowLevel, run_workflow


def server_facts(client: Client) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(model, engine, status, GGUF metadata) as far as the server tells; ours tells all of them."""
    models = client.models()
    first = next((m for m in models if m.get("id") == client.model), models[0] if models else {})
    meta = first.get("meta") or {}
    model = {
        "id": first.get("id"),
        "sha256": meta.get("sha256"),
        "quantization": meta.get("quantization"),
        "parameters": meta.get("parameters"),
        "architecture": meta.get("architecture"),
        "trained_context": meta.get("trained_context"),
        "file_size": meta.get("file_size"),
        "weight_types": meta.get("weight_types"),
    }
    try:
        status = client.status()
    except ClientError:
        status = None
    engine = {}
    if is_magnitude_status(status):
        engine = {
            "parallel": status["parallel"],
            "ctx_size": status["kv_cells_total"],
            "kv_bytes_per_token": status.get("kv_bytes_per_token"),
            "kv_cache_type": status.get("kv_cache_type", "f16"),
            "flash_attention": status.get("flash_attention", True),
        }
    return model, engine, (status if engine else None), meta


def _server(client: Client, engine: dict[str, Any]) -> dict[str, Any]:
    return {"url": client.api_base, "engine": "magnitude" if engine else "openai-compatible"}


def _config_json(config: SweepConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}


def calibrate(
    client: Client | None = None,
    config: SweepConfig | None = None,
    run_probe: bool = True,
    memory_bytes: int | None = None,
    on_level: Callable[[Level], None] | None = None,
    on_capacity: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
    name: str = "",
) -> Profile:
    client = client or discover()
    config = config or SweepConfig()
    model, engine, status, meta = server_facts(client)
    report = capacity_report(meta, status, memory_bytes)
    capacity = report.to_json() if report else None
    if capacity is not None and run_probe and status is not None:
        capacity["probe"] = probe(client)
    if on_capacity is not None and capacity is not None:
        on_capacity(capacity)
    levels, reason = run_sweep(client, config, on_level=on_level, stop=stop)
    return Profile(
        machine=machine_info(),
        server=_server(client, engine),
        model=model,
        engine=engine,
        config=_config_json(config),
        levels=levels,
        summary=summarize_levels(levels, engine, model, config.latency_target_ms),
        capacity=capacity,
        stopped_because=reason,
        name=name,
    )


def calibrate_workflow(
    client: Client | None = None,
    sessions: tuple[int, ...] = (1, 4, 8),
    rounds: int = 6,
    max_tokens: int = 48,
    slo_round_p95_ms: float = DEFAULT_SLO_ROUND_P95_MS,
    on_level: Callable[[WorkflowLevel], None] | None = None,
    stop: threading.Event | None = None,
    name: str = "",
    agent: bool = False,
) -> Profile:
    """The agent-workflow sweep (see workflow.py), recorded as a profile with the machine and model."""
    client = client or discover()
    model, engine, _, _ = server_facts(client)
    result = run_workflow(
        client, sessions, rounds, max_tokens, slo_round_p95_ms, on_level=on_level, stop=stop, agent=agent
    )
    return Profile(
        machine=machine_info(),
        server=_server(client, engine),
        model=model,
        engine=engine,
        config={"workflow": {"sessions": list(sessions), "rounds": rounds, "max_tokens": max_tokens, "agent": agent}},
        levels=[],
        summary=Summary(),
        workflow=result,
        name=name,
    )


def calibrate_pressure_map(
    client: Client | None = None,
    config: SweepConfig | None = None,
    contexts: tuple[int, ...] = (256, 1024, 4096),
    memory_bytes: int | None = None,
    on_cell: Callable[[PressureCell], None] | None = None,
    stop: threading.Event | None = None,
    name: str = "",
) -> Profile:
    """The pressure map (see pressure.py), recorded as a profile with the machine, model and capacity."""
    client = client or discover()
    config = config or SweepConfig()
    model, engine, status, meta = server_facts(client)
    report = capacity_report(meta, status, memory_bytes)
    pmap = run_pressure_map(client, config, contexts, on_cell=on_cell, stop=stop)
    return Profile(
        machine=machine_info(),
        server=_server(client, engine),
        model=model,
        engine=engine,
        config={**_config_json(config), "pressure_map": {"contexts": list(contexts)}},
        levels=[],
        summary=Summary(latency_target_ms=config.latency_target_ms),
        capacity=report.to_json() if report else None,
        stopped_because=pmap.stopped_because,
        pressure_map=pmap,
        name=name,
    )
