"""The profile archive: every calibration kept per model file and settings, and the regression gate.

A model's magnitude is only known for the file that was measured, with the settings it ran under:
profiles are archived under `~/.magnitude/profiles/` (or `MAGNITUDE_PROFILES_DIR`), named by the
model's SHA-256 and a hash of the settings, so that `--baseline auto` finds the last profile of the
same model and settings, and a new model file (or a new llama.cpp) is compared before anyone relies
on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .profile import Profile

PROFILES_ENV = "MAGNITUDE_PROFILES_DIR"


def archive_dir() -> Path:
    return Path(os.environ.get(PROFILES_ENV) or Path.home() / ".magnitude" / "profiles").expanduser()


def settings_key(profile: Profile) -> str:
    """What must match for two profiles to be comparable: the engine's size and what was swept."""
    sweep = {k: profile.config.get(k) for k in ("concurrency", "max_tokens", "workflow", "prompt")}
    if profile.config.get("pressure_map"):  # sweep profiles keep the keys they had before
        sweep["pressure_map"] = profile.config["pressure_map"]
    engine = {k: profile.engine.get(k) for k in ("parallel", "ctx_size")}
    if profile.engine.get("kv_cache_type", "f16") != "f16":  # f16 profiles keep the keys they had before
        engine["kv_cache_type"] = profile.engine["kv_cache_type"]
    if profile.engine.get("flash_attention", True) is False:  # ... as flash-attention ones do
        engine["flash_attention"] = False
    text = json.dumps({"engine": engine, "sweep": sweep}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def archive(profile: Profile, folder: Path | None = None) -> Path:
    folder = folder or archive_dir()
    folder.mkdir(parents=True, exist_ok=True)
    sha = (profile.model.get("sha256") or "unknown")[:16]
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = folder / f"{sha}-{settings_key(profile)}-{stamp}.json"
    n = 1
    while path.exists():  # two in one second
        path = folder / f"{sha}-{settings_key(profile)}-{stamp}-{n}.json"
        n += 1
    return profile.save_json(path)


@dataclass(frozen=True)
class ArchivedProfile:
    path: Path
    profile: Profile

    def row(self) -> dict[str, Any]:
        p = self.profile
        return {
            "file": self.path.name,
            "created": p.created,
            "model": p.model.get("id"),
            "sha256": (p.model.get("sha256") or "")[:12],
            "settings": settings_key(p),
            "engine": json.dumps(p.engine, sort_keys=True),
            "single_stream_tok_s": p.summary.single_stream_tokens_per_s,
            "peak_tok_s": p.summary.peak_tokens_per_s,
            "kind": "workflow" if p.workflow else "pressure" if p.pressure_map else "sweep",
        }


def archived(folder: Path | None = None) -> list[ArchivedProfile]:
    """Every readable profile in the archive, oldest first (unreadable files are skipped)."""
    found = []
    for path in sorted((folder or archive_dir()).glob("*.json")):
        try:
            found.append(ArchivedProfile(path, Profile.load(path)))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    # `created` has whole seconds: two profiles of one second go by when their files were written.
    return sorted(found, key=lambda a: (a.profile.created, a.path.stat().st_mtime_ns, a.path.name))


def latest_match(profile: Profile, folder: Path | None = None, exclude: Path | None = None) -> ArchivedProfile | None:
    """The newest archived profile of the same model file and settings."""
    sha, key = profile.model.get("sha256"), settings_key(profile)
    matches = [
        a
        for a in archived(folder)
        if a.path != exclude and a.profile.model.get("sha256") == sha and settings_key(a.profile) == key
    ]
    return matches[-1] if matches else None


@dataclass(frozen=True)
class Regression:
    """One figure compared with the baseline's: `change` is relative (-0.2: 20% worse)."""

    figure: str
    step: str
    baseline: float
    current: float
    change: float
    regressed: bool


def compare_to_baseline(current: Profile, baseline: Profile, max_regression: float) -> list[Regression]:
    """Throughput (higher is better) and TTFT / end-to-end p50 (lower is better) at every level both
    measured; a figure regressed when it is worse than the baseline's by more than `max_regression`."""
    out: list[Regression] = []
    base_levels = {lv.step: lv for lv in baseline.levels if lv.step is not None}
    for level in current.levels:
        old = base_levels.get(level.step) if level.step is not None else None
        if old is None:
            continue
        figures = (
            ("tokens/s", old.output_tokens_per_s, level.output_tokens_per_s, True),
            ("TTFT p50 ms", old.ttft_ms.p50, level.ttft_ms.p50, False),
            ("e2e p50 ms", old.e2e_ms.p50, level.e2e_ms.p50, False),
        )
        for name, was, now, higher_is_better in figures:
            if not was or now is None:
                continue
            change = (now - was) / was if higher_is_better else (was - now) / was
            out.append(Regression(name, f"{level.step:g}", was, now, change, change < -max_regression))
    if current.pressure_map and baseline.pressure_map:
        for cell in current.pressure_map.cells:
            old_cell = baseline.pressure_map.cell(cell.concurrency, cell.context_tokens)
            was = old_cell.output_tokens_per_s if old_cell is not None and old_cell.measured else None
            if was and cell.measured and cell.output_tokens_per_s is not None:
                change = (cell.output_tokens_per_s - was) / was
                step = f"{cell.concurrency}×{cell.context_tokens:,}"
                out.append(
                    Regression("map tokens/s", step, was, cell.output_tokens_per_s, change, change < -max_regression)
                )
    if current.workflow and baseline.workflow:
        old_rounds = {lv.sessions: lv for lv in baseline.workflow.levels}
        for wl in current.workflow.levels:
            old_wl = old_rounds.get(wl.sessions)
            was = old_wl.output_tokens_per_s if old_wl else None
            if was:
                change = (wl.output_tokens_per_s - was) / was
                now = wl.output_tokens_per_s
                step = f"{wl.sessions} sessions"
                out.append(Regression("workflow tokens/s", step, was, now, change, change < -max_regression))
    return out


def parse_fraction(text: str) -> float:
    """'15%' or '0.15' -> 0.15."""
    value = text.strip()
    try:
        number = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise ValueError(f"--max-regression takes a percentage like 15% (or 0.15), got {text!r}") from None
    if not 0 <= number < 1:
        raise ValueError(f"--max-regression must be between 0% and 100%, got {text!r}")
    return number


def format_regressions(rows: list[Regression], baseline: str, max_regression: float) -> str:
    if not rows:
        return f"baseline {baseline}: no level in common to compare"
    lines = [f"against baseline {baseline} (a regression is worse by more than {max_regression:.0%}):"]
    for r in rows:
        mark = "REGRESSED" if r.regressed else "ok"
        lines.append(
            f"  {r.figure:<18} at {r.step:<12} {r.baseline:>10.1f} -> {r.current:>10.1f}  ({r.change:+.1%})  {mark}"
        )
    return "\n".join(lines)
