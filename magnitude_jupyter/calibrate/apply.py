"""`magnitude calibrate --apply`: what a calibration recommends, written into the config file.

A calibration finds the concurrency with the most throughput whose p95 end-to-end latency meets
the target; applying it sets `engine.parallel` to it, `engine.max_waiting` to twice it (past that a
request would wait more than two rounds of the slots: it is told at once, 429, instead of missing
its objective), and turns the target into objectives the server then watches live (slo.py):
`slo.e2e_p95_ms` the target itself, `slo.ttft_p95_ms` the measured TTFT p95 at that level with 50%
headroom. The change is shown as a diff of the file before it is written.
"""

from __future__ import annotations

import difflib
import io
import math
import os
from pathlib import Path
from typing import Any

from .profile import Profile

QUEUE_ROUNDS = 2  # max_waiting = this x parallel
TTFT_HEADROOM = 1.5  # the TTFT objective over the p95 measured at the recommended level


def recommendations(profile: Profile) -> dict[str, dict[str, Any]]:
    """{"engine": {...}, "slo": {...}} from a concurrency sweep; empty where it recommends nothing."""
    summary = profile.summary
    out: dict[str, dict[str, Any]] = {"engine": {}, "slo": {}}
    parallel = summary.recommended_parallel
    if not parallel:
        return out
    out["engine"] = {"parallel": int(parallel), "max_waiting": QUEUE_ROUNDS * int(parallel)}
    if summary.latency_target_ms:
        out["slo"]["e2e_p95_ms"] = float(summary.latency_target_ms)
    level = next((lv for lv in profile.levels if lv.concurrency == parallel), None)
    if level is not None and level.ttft_ms.p95:
        out["slo"]["ttft_p95_ms"] = float(math.ceil(level.ttft_ms.p95 * TTFT_HEADROOM / 50) * 50)
    return out


def applied(text: str, changes: dict[str, dict[str, Any]]) -> str:
    """The config file's text with the changes merged into its `engine:` and `slo:` sections; its
    comments, order and every other key kept (ruamel.yaml's round trip)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    round_trip = YAML()
    data = round_trip.load(text) if text.strip() else None
    if data is None:
        data = CommentedMap()
    if not isinstance(data, dict):
        raise ValueError("the config file does not hold a mapping")
    for section, values in changes.items():
        if values:
            if not isinstance(data.get(section), dict):
                data[section] = CommentedMap()
            for key, value in values.items():
                data[section][key] = value
    out = io.StringIO()
    round_trip.dump(data, out)
    return out.getvalue()


def config_diff(path: Path, changes: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(the new text, a unified diff against the file as it is: empty when nothing changes)."""
    old = path.read_text() if path.exists() else ""
    new = applied(old, changes)
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(path), str(path)))
    return new, diff


def proposal(profile: Profile, path: Path) -> tuple[str, str, str]:
    """(what to say, the diff, the new text) for applying `profile` to the config at `path`: the diff
    and text empty where there is nothing to write, and the sentence says why."""
    changes = recommendations(profile)
    if not changes["engine"]:
        return "nothing to write: no concurrency met the latency target", "", ""
    new, diff = config_diff(path, changes)
    if not diff:
        return f"{path} already holds the recommended settings", "", ""
    return f"the calibration recommends these changes to {path}:", diff, new


def write_config(path: Path, text: str) -> None:
    """Write the config file whole (a new file moved over the old one), never through a link: a link
    would have the write land in whatever file it points to."""
    if path.is_symlink():
        raise ValueError(
            f"{path} is a link to {os.readlink(path)}: --apply writes only a plain file; "
            f"set MAGNITUDE_CONFIG to the file itself to apply there"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)
