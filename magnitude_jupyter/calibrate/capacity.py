"""KV-cache capacity: what fits in memory, where the engine's setting sits, and a probe that checks it."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from ..client.http import Client, ClientError
from ..models.kvmath import CACHE_TYPE_BYTES, Window, kv_layout, session_bytes, tokens_that_fit

CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable), the default budget for the KV cache."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with ipykernel
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 0


def sessions_table(
    bytes_per_token: float,
    memory_bytes: int,
    contexts: tuple[int, ...] = CONTEXTS,
    trained_context: int | None = None,
    turn_charge_tokens: int | None = None,
    window: Window | None = None,
) -> list[dict[str, Any]]:
    """How many sessions of each context length fit the memory budget (KV cache only), and, given
    what admission charges a session's next turn on top of its context, how many run at once."""
    rows = []
    for ctx in contexts:
        if trained_context and ctx > trained_context:
            continue
        per_session = session_bytes(ctx, bytes_per_token, window)
        row: dict[str, Any] = {
            "context": ctx,
            "bytes_per_session": per_session,
            "sessions": int(memory_bytes // per_session) if per_session else 0,
        }
        if turn_charge_tokens is not None and bytes_per_token:
            row["sessions_admitted"] = sessions_admitted(memory_bytes, ctx, turn_charge_tokens, bytes_per_token, window)
        rows.append(row)
    return rows


def sessions_admitted(
    memory_bytes: float, context: int, turn_charge_tokens: int, bytes_per_token: float, window: Window | None = None
) -> int:
    """Sessions of `context` tokens that run at once when each turn is also charged its answer's cells."""
    return int(memory_bytes // session_bytes(context + turn_charge_tokens, bytes_per_token, window))


def turn_charge(status: dict[str, Any] | None) -> tuple[str | None, int | None]:
    """The server's admission mode and the cells it charges a turn's answer up front: the whole
    `max_tokens` under `reserve` (a request that gives none: the default), the likely answer's length
    under `estimate` (docs/decisions.md, "KV cells on demand"); None where the server does not say."""
    admission = (status or {}).get("admission")
    if admission == "estimate":
        return admission, (status or {}).get("answer_charge_tokens")
    if admission == "reserve":
        return admission, (status or {}).get("default_max_tokens")
    return None, None


@dataclass
class CapacityReport:
    cache_type: str
    bytes_per_token: float
    memory_budget_bytes: int
    tokens_that_fit: int
    table: list[dict[str, Any]]
    admission: str | None = None  # the server's: how a turn's answer is charged (turn_charge)
    turn_charge_tokens: int | None = None  # ... in cells, on top of the session's context
    current: dict[str, Any] = field(default_factory=dict)  # the engine's setting: parallel, ctx_size, bytes
    reported_kv_buffer_bytes: int | None = None  # what llama.cpp said it allocated
    window: int | None = None  # tokens a sliding-window layer keeps per session (None: all, or no such layers)
    window_bytes_per_token: float = 0.0  # ... and what a token costs there; bytes_per_token is then the other layers'
    predicted_kv_buffer_bytes: int | None = None
    probe: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def model_shape(meta: dict[str, Any]) -> Any:
    """An object with the KV shape fields kvmath needs, from /v1/models metadata."""

    class Shape:
        kv_heads_per_layer = tuple(meta["kv_heads_per_layer"])
        head_dim_k = meta["head_dim_k"]
        head_dim_v = meta["head_dim_v"]
        windowed_layers = tuple(meta.get("windowed_layers") or ())
        sliding_window = meta.get("sliding_window")

    return Shape


def capacity_report(
    meta: dict[str, Any] | None,
    status: dict[str, Any] | None,
    memory_bytes: int | None = None,
    cache_type: str | None = None,
) -> CapacityReport | None:
    """Capacity from GGUF metadata and the engine's status; None when the server says neither. The
    cache type is the engine's (from its status, f16 if it does not say) unless one is asked for."""
    if not meta or "kv_heads_per_layer" not in meta:
        return None
    cache_type = cache_type or (status or {}).get("kv_cache_type") or "f16"
    types = cache_type.split("/")
    if len(types) > 2 or any(t not in CACHE_TYPE_BYTES for t in types):
        raise ValueError(f"unknown cache type {cache_type!r}")
    # The server says whether its windowed layers keep windows (kv_window); by default llama.cpp's do.
    windows_kept = bool((status or {}).get("kv_window")) or status is None
    # Only its per-token figures are read: no context size here.
    layout = kv_layout(model_shape(meta), 0, types[0], types[-1], full_windows=not windows_kept)
    bpt, window = layout.bytes_per_cell, layout.windowed
    budget = memory_bytes if memory_bytes is not None else available_memory()
    admission, charge = turn_charge(status)
    report = CapacityReport(
        cache_type=cache_type,
        bytes_per_token=bpt,
        memory_budget_bytes=budget,
        tokens_that_fit=tokens_that_fit(budget, bpt),
        table=sessions_table(
            bpt, budget, trained_context=meta.get("trained_context"), turn_charge_tokens=charge, window=window
        ),
        admission=admission,
        turn_charge_tokens=charge,
        window=window[0] if window else None,
        window_bytes_per_token=window[1] if window else 0.0,
    )
    if status and status.get("kv_cells_total"):
        ctx, parallel = int(status["kv_cells_total"]), int(status["parallel"])
        report.current = {
            "parallel": parallel,
            "ctx_size": ctx,
            "context_per_session": ctx // parallel,
            "kv_bytes": status.get("kv_bytes_planned") or ctx * bpt,
        }
        report.predicted_kv_buffer_bytes = round(status.get("kv_bytes_planned") or ctx * bpt)
        report.reported_kv_buffer_bytes = status.get("kv_buffer_bytes_reported")
    return report


def _open(client: Client, prompt: str, max_tokens: int) -> httpx.Response:
    messages = [{"role": "user", "content": prompt}]
    return client.open_chat_stream(messages, max_tokens=max_tokens, temperature=0, ignore_eos=True, priority="batch")


def probe(
    client: Client, sessions: int | None = None, prompt: str = "Count upwards from one.", timeout: float = 30.0
) -> dict[str, Any]:
    """Check the engine against the arithmetic, with real requests (all cancelled at once).

    1. One request: `prompt + max_tokens` equal to the largest a request may hold is admitted; a
       `max_tokens` one token past it is admitted too (a cap, not a demand), and a prompt longer
       than the limit is refused (400, context_length_exceeded).
    2. `sessions` requests that split the cache evenly all run at once; one more has to wait
       (`admission: reserve`) or may run too, charged its likely answer (`estimate`).
    """
    status = client.status()
    ctx, parallel = int(status["kv_cells_total"]), int(status["parallel"])
    limit = min(ctx, int(status.get("trained_context") or ctx))
    first = client.chat([{"role": "user", "content": prompt}], max_tokens=1, temperature=0)
    prompt_tokens = int((first.usage or {})["prompt_tokens"])
    result: dict[str, Any] = {"request_limit": limit, "prompt_tokens": prompt_tokens}

    opened: list[httpx.Response] = []
    try:
        response = _open(client, prompt, limit - prompt_tokens)
        opened.append(response)
        result["largest_request_admitted"] = response.status_code == 200
        _cancel_all(client, opened)
        opened.clear()
        _wait_idle(client, timeout)
        response = _open(client, prompt, limit - prompt_tokens + 1)
        opened.append(response)
        result["one_more_token_capped"] = response.status_code == 200
        _cancel_all(client, opened)
        opened.clear()
        _wait_idle(client, timeout)
        response = _open(client, "word " * limit, 1)
        response.read()
        result["longer_prompt_refused"] = response.status_code == 400 and (
            response.json()["error"]["code"] == "context_length_exceeded"
        )

        n = sessions or parallel
        per_session = ctx // n
        result.update({"sessions_predicted": n, "context_per_session": per_session})
        for _ in range(n + 1):
            opened.append(_open(client, prompt, per_session - prompt_tokens))
        deadline = time.monotonic() + timeout
        seen = {"running": 0, "waiting": 0}
        while time.monotonic() < deadline:
            now = client.status()
            seen = {"running": now["running"], "waiting": now["waiting"]}
            if now["running"] > n or (now["running"] == n and now["waiting"] >= 1):
                break
            time.sleep(0.05)
        result["sessions_running_at_once"] = seen["running"]
        result["one_more_session_waited"] = seen["waiting"] >= 1
    finally:
        _cancel_all(client, opened)
    # Under `estimate` the extra session is charged its likely answer, not its cap: it may run too.
    estimate = status.get("admission") == "estimate"
    result["admission"] = status.get("admission")
    result["confirmed"] = bool(
        result.get("largest_request_admitted")
        and result.get("one_more_token_capped")
        and result.get("longer_prompt_refused")
        and (
            result.get("sessions_running_at_once", 0) >= n
            if estimate
            else result.get("sessions_running_at_once") == n and result.get("one_more_session_waited")
        )
    )
    return result


def _cancel_all(client: Client, responses: list[httpx.Response]) -> None:
    for response in responses:
        completion_id = response.headers.get("X-Completion-Id")
        response.close()
        if completion_id:
            client.cancel(completion_id)


def _wait_idle(client: Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = client.status()
        except ClientError:
            return
        if status["running"] == 0 and status["waiting"] == 0:
            return
        time.sleep(0.05)
