"""A profile as text: the table the CLI prints (missing figures shown as '—', never invented)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ..models.registry import unbatched_weights
from .capacity import sessions_admitted
from .pressure import PressureCell, PressureMap
from .profile import Profile, engine_text
from .records import Level, Summary


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "—"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _percent(share: float | None) -> float | None:
    return None if share is None else share * 100


def agreement_text(earlier: list[Level], now: list[Level], earlier_name: str = "the earlier run") -> str | None:
    """Whether two sweeps of the same levels agree, level by level, within their 95% intervals: two
    runs on a machine doing other work differ, and so may their knees, and the page says why."""
    then = {lv.concurrency: lv for lv in earlier if lv.output_tokens_per_s_ci95 is not None}
    pairs = [
        (then[lv.concurrency], lv) for lv in now if lv.concurrency in then and lv.output_tokens_per_s_ci95 is not None
    ]
    if not pairs:
        common = sorted(c for c in {lv.concurrency for lv in earlier} & {lv.concurrency for lv in now} if c is not None)
        if not common:
            return None
        return (
            f"This run and {earlier_name} both measured concurrency {', '.join(_fmt(c, 'g') for c in common)}, with "
            "too few requests for a 95% interval: two figures alone cannot tell whether the runs differ "
            "(more requests per level can)."
        )
    agree = [n for b, n in pairs if abs(b.output_tokens_per_s - n.output_tokens_per_s) <= _ci(b) + _ci(n)]
    differ = [(b, n) for b, n in pairs if n not in agree]
    parts = []
    if agree:
        levels = ", ".join(_fmt(n.concurrency, "g") for n in agree)
        parts.append(f"at concurrency {levels} this run and {earlier_name} agree within their 95% intervals")
    if differ:
        figures = "; ".join(
            f"at {_fmt(n.concurrency, 'g')}: {n.output_tokens_per_s:.1f} ± {_ci(n):.1f} tok/s now, "
            f"{b.output_tokens_per_s:.1f} ± {_ci(b):.1f} in {earlier_name}"
            for b, n in differ
        )
        parts.append(
            f"{figures}: more apart than their intervals, so the machine did other work during one of them "
            "(run both again with nothing else running)"
        )
    text = "; ".join(parts)
    if agree and not differ:
        text += ": where their knees differ, the figures cannot tell the two apart"
    return text[0].upper() + text[1:] + "."


def _ci(level: Level) -> float:
    return level.output_tokens_per_s_ci95 or 0.0


def knee_text(summary: Summary) -> str:
    if summary.knee_not_reached:
        return f"knee not reached (still rising at concurrency {_fmt(summary.peak_concurrency, 'g')}: try higher)"
    return f"knee at {_fmt(summary.knee_concurrency, 'g')}"


def _recommendation_text(profile: Profile) -> str:
    """The recommended parallel, with what it follows: the end-to-end p95 target."""
    s, target = profile.summary, profile.config.get("latency_target_ms") if profile.config else None
    if s.recommended_parallel is None:
        if not target:
            return "no recommended parallel (no latency target)"
        return f"no level kept the end-to-end p95 within the {target:,.0f} ms target: no recommended parallel"
    return (
        f"recommended parallel {s.recommended_parallel:g}: the highest-throughput level whose end-to-end p95 "
        f"stays within the {target:,.0f} ms target"
    )


def format_profile(profile: Profile) -> str:
    headers = [
        "concurrency",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p95",
        "TPOT p50",
        "E2E p95",
        "E2E std",
        "queue p50",
        "KV max",
        "errors",
    ]
    rows = []
    for lv in profile.levels:
        rows.append(
            [
                _fmt(lv.step, "g"),
                _fmt(lv.requests_per_s, ".2f"),
                _fmt(lv.output_tokens_per_s),
                _fmt(lv.ttft_ms.p50, ".0f"),
                _fmt(lv.ttft_ms.p95, ".0f"),
                _fmt(lv.tpot_ms.p50, ".1f"),
                _fmt(lv.e2e_ms.p95, ".0f"),
                _fmt(lv.e2e_ms.std, ".0f"),
                _fmt(lv.queue_ms.p50, ".0f"),
                _fmt(_percent(lv.kv_usage_max), ".0f") + "%",
                str(lv.errors),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)] if rows else map(len, headers)
    widths = list(widths)
    lines = [
        f"{profile.model.get('id')} on {profile.machine.get('cpu')} ({profile.machine.get('cores')} cores); "
        f"engine: {engine_text(profile.engine)}"
    ]
    lines.append("  ".join(h.rjust(wd) for h, wd in zip(headers, widths, strict=True)))
    lines += ["  ".join(c.rjust(wd) for c, wd in zip(row, widths, strict=True)) for row in rows]
    s = profile.summary
    lines.append("")
    lines.append(
        f"single stream {_fmt(s.single_stream_tokens_per_s)} tok/s; peak {_fmt(s.peak_tokens_per_s)} "
        f"tok/s at concurrency {_fmt(s.peak_concurrency, 'g')}; {knee_text(s)}; "
        f"usable/trained context {_fmt(s.usable_context_ratio, '.2f')}; {_recommendation_text(profile)}"
    )
    eff = ", ".join(f"{c}: {_fmt(e, '.2f')}" for c, e in s.scaling_efficiency.items())
    lines.append(f"scaling efficiency thr(c)/(c·thr(1)): {eff}")
    share, types = unbatched_weights(profile.model.get("weight_types") or {})
    if share >= 0.5:
        lines.append(
            f"{share:.0%} of the weights are {', '.join(types)}, which llama.cpp multiplies one row at a time on "
            "x86 CPUs: concurrency shares their memory traffic, not their arithmetic; a Q4_0, Q4_K or Q8_0 file "
            "of the same model scales further"
        )
    cap = profile.capacity
    if cap:
        lines.append(
            f"KV cache: {cap['bytes_per_token']:,.0f} bytes/token ({cap['cache_type']}); predicted buffer "
            f"{_fmt(cap['predicted_kv_buffer_bytes'], ',')} B, llama.cpp reports "
            f"{_fmt(cap['reported_kv_buffer_bytes'], ',')} B; the {cap['memory_budget_bytes'] / 2**30:.1f} GiB "
            f"of memory free now would hold {cap['tokens_that_fit']:,} tokens of KV cache"
        )
        charge_line = turn_charge_text(cap)
        if charge_line:
            lines.append(charge_line)
        probe = cap.get("probe")
        if probe:
            lines.append(
                f"probe: largest request admitted {probe.get('largest_request_admitted')}, one more token "
                f"capped {probe.get('one_more_token_capped')}, a longer prompt refused "
                f"{probe.get('longer_prompt_refused')}; {probe.get('sessions_running_at_once')} of "
                f"{probe.get('sessions_predicted')} predicted sessions ran at once, one more "
                f"{'waited' if probe.get('one_more_session_waited') else 'ran too'}"
                f"{' (charged its likely answer)' if probe.get('admission') == 'estimate' else ''}: "
                f"{'confirmed' if probe.get('confirmed') else 'NOT confirmed'}"
            )
    else:
        lines.append("KV cache: — (this server does not report its model's shape)")
    preemption = preemption_text(profile.levels)
    if preemption:
        lines.append(preemption)
    if profile.stopped_because:
        lines.append(f"stopped early: {profile.stopped_because}")
    return "\n".join(lines)


def turn_charge_text(cap: dict[str, Any]) -> str | None:
    """What admission charges a session's next turn, and the sessions of the engine's context that
    run at once with it (the sessions table's `sessions_admitted`)."""
    charge, admission = cap.get("turn_charge_tokens"), cap.get("admission")
    if charge is None or admission is None:
        return None
    how = (
        f"its likely answer ({charge:,} tokens, a high percentile of recent answers)"
        if admission == "estimate"
        else f"its whole max_tokens ({charge:,} when a request gives none)"
    )
    text = f"admission: {admission}: a turn is charged its context plus {how}"
    current = cap.get("current") or {}
    per_session = current.get("context_per_session")
    if per_session:
        bpt = cap["bytes_per_token"]
        window = (cap["window"], cap["window_bytes_per_token"]) if cap.get("window") else None
        admitted = sessions_admitted(current["kv_bytes"], per_session, charge, bpt, window) if bpt else 0
        text += f"; {admitted:,} sessions of {per_session:,} tokens fit the engine's cells at once"
    return text


def preemption_text(levels: list[Level]) -> str | None:
    """Where the server preempted requests for KV cells (admission: estimate), and from which level
    that cost more throughput than the added concurrency gained."""
    counted = [lv for lv in levels if lv.preemptions]
    if not counted:
        return None
    text = "preemptions (KV cells charged by estimate): " + ", ".join(
        f"{lv.preemptions} in {lv.requests} requests at {_fmt(lv.step, 'g')}" for lv in counted
    )
    for before, level in itertools.pairwise(levels):
        if level.preemptions and level.output_tokens_per_s < before.output_tokens_per_s:
            return text + (
                f"; from {_fmt(level.step, 'g')} they cost more than the concurrency gains "
                "(lower parallel, or admission: reserve)"
            )
    return text + "; throughput still grew with them"


def format_pressure_map(pmap: PressureMap) -> str:
    """The map as two grids (output tok/s, p95 end-to-end), a row a context, then what it says."""
    target = pmap.latency_target_ms
    head = ["context \\ sessions", *(str(c) for c in pmap.concurrency)]

    def grid(title: str, value: Callable[[PressureCell], str]) -> list[str]:
        rows = [head]
        for context in pmap.contexts:
            row = [f"{context:,}"]
            for concurrency in pmap.concurrency:
                cell = pmap.cell(concurrency, context)
                row.append("—" if cell is None else value(cell) if cell.measured else cell.state)
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return [title, *("  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows)]

    def latency(cell: PressureCell) -> str:
        return f"{(cell.e2e_p95_ms or 0) / 1000:.2f} s" + (" ✗" if cell.meets(target) is False else "")

    lines = grid("output tokens/s:", lambda c: f"{c.output_tokens_per_s:.1f}")
    title = "end-to-end p95" + (f" (✗: over the {target / 1000:g} s target):" if target else ":")
    lines += ["", *grid(title, latency), ""]
    lines += pmap.recommendation()
    unfit = [c for c in pmap.cells if c.why]
    if unfit:
        lines.append(f"not run: {unfit[0].why}" + (f" (and {len(unfit) - 1} more such)" if len(unfit) > 1 else ""))
    if pmap.stopped_because:
        lines.append(f"stopped early: {pmap.stopped_because}")
    return "\n".join(lines)
