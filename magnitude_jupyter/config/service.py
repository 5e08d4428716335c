"""What `magnitude serve` promises its clients: their API keys (tenants) and the objectives it judges
itself by (`slo:`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..options import option
from .engine import ConfigError, parse_keep_alive


@dataclass(frozen=True)
class ApiKey:
    """One client of `magnitude serve` (a tenant): its name, its secret, and what it may do beyond
    asking for answers. Its stored responses, prefix-cache entries, streams and metrics are its own."""

    name: str
    key: str
    batch: bool = False  # may send `priority: "batch"` (queued behind interactive work, never shed)
    models: bool = False  # may load and unload models, and send `keep_alive`
    never_shed: bool = False  # its interactive requests are never shed by the objectives

    def __repr__(self) -> str:  # the secret never reaches a log
        return f"ApiKey(name={self.name!r}, batch={self.batch}, models={self.models}, never_shed={self.never_shed})"


API_KEY_FIELDS = ("name", "key", "key_env", "batch", "models", "never_shed")


def parse_api_keys(raw: Any, where: str, environ: dict[str, str]) -> tuple[ApiKey, ...]:
    """`api_keys:` from the config: a list of {name, key | key_env, batch, models, never_shed}."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: key 'api_keys' must be a list of {{name, key}} entries")
    keys: list[ApiKey] = []
    for i, entry in enumerate(raw):
        at = f"{where}: api_keys[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at} must be a mapping with 'name' and 'key' (or 'key_env')")
        unknown = set(entry) - set(API_KEY_FIELDS)
        if unknown:
            raise ConfigError(f"{at}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(API_KEY_FIELDS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ConfigError(f"{at}: 'name' must be a name of 1-64 characters")
        key = entry.get("key")
        if "key_env" in entry:
            key = environ.get(str(entry["key_env"]))
            if not key:
                raise ConfigError(f"{at} ({name}): the variable {entry['key_env']!r} is not set")
        if not isinstance(key, str) or len(key) < 16:
            raise ConfigError(f"{at} ({name}): 'key' must be a secret of 16 characters or more")
        flags = {flag: entry.get(flag, False) for flag in ("batch", "models", "never_shed")}
        for flag, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigError(f"{at} ({name}): {flag!r} must be true or false")
        if any(k.name == name for k in keys) or any(k.key == key for k in keys):
            raise ConfigError(f"{at}: two api_keys share the name {name!r} or a key")
        keys.append(ApiKey(name, key, **flags))
    return tuple(keys)


@dataclass(frozen=True)
class SloSettings:
    """Service-level objectives, watched over a rolling window (slo.py): `slo:` in the config (and per
    model under `models.<alias>.slo`), `magnitude serve --slo-...`, the extension's `slo_...` traitlets.
    An objective left unset is not watched."""

    ttft_p95_ms: float | None = option(None, "p95 time to first token, in ms, over the window.", kind="float|null")
    e2e_p95_ms: float | None = option(None, "p95 time from arrival to the last token, in ms.", kind="float|null")
    round_p95_ms: float | None = option(
        None,
        "p95 end-to-end time of a conversation's later rounds (requests with an earlier answer).",
        kind="float|null",
    )
    min_tokens_per_s: float | None = option(
        None, "Output tokens/s a request decodes at, for 95% of requests.", kind="float|null"
    )
    window: float = option(300.0, "The rolling window objectives are judged over: seconds or '5m'.", kind="duration")
    shed: bool = option(
        False,
        "Keep the TTFT objective: an interactive request predicted to wait longer than it for its first "
        "token gets 503 and Retry-After at once (batch requests queue on). Off by default.",
        kind="bool",
    )
    fallback_model: str | None = option(
        None,
        "With shed: a smaller model (an alias) that takes the requests the objective would shed, "
        "while its own queue keeps the objective; the answer's model says which served it.",
        kind="str|null",
    )

    def __post_init__(self) -> None:
        for name in SLO_OBJECTIVES:
            value = getattr(self, name)
            if value is not None and not _positive_number(value):
                raise ConfigError(f"slo setting {name!r} must be a positive number or null, got {value!r}")
        if not _positive_number(self.window):
            raise ConfigError(f"slo setting 'window' must be a positive duration, got {self.window!r}")
        if not isinstance(self.shed, bool):
            raise ConfigError(f"slo setting 'shed' must be true or false, got {self.shed!r}")
        if self.fallback_model is not None and (not isinstance(self.fallback_model, str) or not self.fallback_model):
            raise ConfigError(f"slo setting 'fallback_model' must be a model alias, got {self.fallback_model!r}")

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in SLO_OBJECTIVES)


SLO_OBJECTIVES = ("ttft_p95_ms", "e2e_p95_ms", "round_p95_ms", "min_tokens_per_s")


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def parse_slo(raw: Any, where: str, base: SloSettings | None = None) -> SloSettings:
    """An `slo:` mapping (over `base`, for a model's own objectives), checked; durations as in keep_alive."""
    if raw is None:
        return base or SloSettings()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of objectives")
    known = {f.name for f in dataclasses.fields(SloSettings)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(known))})")
    values = dict(raw)
    if "window" in values:
        try:
            values["window"] = parse_keep_alive(values["window"])
        except ValueError as exc:
            raise ConfigError(f"{where}.window: {exc}") from None
    try:
        return dataclasses.replace(base or SloSettings(), **values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
