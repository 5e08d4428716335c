"""The config file: every section, checked, with `MAGNITUDE_*` variables over it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..options import option, option_of, options_of
from .engine import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    DEFAULT_MODELS_DIR,
    ENV_OVERRIDES,
    ConfigError,
    EngineSettings,
    parse_keep_alive,
)
from .service import ApiKey, SloSettings, parse_api_keys, parse_slo


@dataclass(frozen=True)
class ModelSettings:
    """One model's own settings (`models: {alias: {...}}`): engine settings that differ for it, and
    a chat template that replaces the one in its file."""

    engine: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    slo: SloSettings | None = None  # its own objectives (over the server's), if the config gives any


@dataclass(frozen=True)
class Settings:
    """The whole config file. Each top-level key is a field with its help (docs/configuration.md's
    row); `source` is where these came from, not a key."""

    default_model: str = option("smollm2-135m", "The model served when a request names none: an alias or a .gguf path.")
    models_dir: Path | None = option(
        None, "Every *.gguf here is a model, by its file name lower-cased; no restart needed."
    )
    models_dir_follow_links: bool = option(False, "Serve a *.gguf in models_dir that links to a file outside it.")
    engine: EngineSettings = option(EngineSettings, "The engine settings below.", factory=True)
    source: Path | None = None  # the file these came from, if any
    # Many models behind one server (engine/pool.py):
    max_loaded_models: int = option(2, "Models resident at once; the least recently used idle one makes room.")
    keep_alive: float = option(300.0, "Seconds (or '5m') an idle model stays loaded; -1: until its room is needed.")
    memory_reserve_mib: int = option(512, "Memory a model load must leave free for everything else.")
    response_store_mib: int = option(
        0,
        "Memory for Responses-API responses, stored and being made (least recently used out first); "
        "0: 1/128 of RAM, 16-256 MiB.",
    )
    api_keys: tuple[ApiKey, ...] = option(
        (),
        "Clients of `magnitude serve`, each a tenant: `[{name, key or key_env, batch, models, never_shed}]` "
        "(docs/operations.md).",
    )
    models: dict[str, ModelSettings] = option(
        dict, "Per model, by alias: engine settings that differ for it, `chat_template` and `slo`.", factory=True
    )
    slo: SloSettings = option(SloSettings, "Service-level objectives, watched live (below).", factory=True)

    def response_store_bytes(self) -> int:
        """What the Responses API keeps, in bytes: the setting, or a share of the machine's RAM."""
        if self.response_store_mib > 0:
            return self.response_store_mib << 20
        import psutil

        return min(256 << 20, max(16 << 20, psutil.virtual_memory().total // 128))

    def model_settings(self, alias: str) -> ModelSettings:
        return self.models.get(alias.lower()) or ModelSettings()

    def model_slo(self, alias: str) -> SloSettings:
        """A model's objectives: its own where the config gives them, else the server's."""
        return self.model_settings(alias).slo or self.slo


ENGINE_KEYS = {f.name: f.type for f in dataclasses.fields(EngineSettings)}
MODEL_KEYS = {f.name for f in dataclasses.fields(EngineSettings) if option_of(f).per_model} | {"chat_template", "slo"}
TOP_KEYS = {f.name for f, _ in options_of(Settings)}


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH).expanduser()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def _apply_env(raw: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    merged = dict(raw)
    merged["engine"] = dict(raw.get("engine") or {})
    for var, (section, key, parse) in ENV_OVERRIDES.items():
        if var not in environ:
            continue
        try:
            value = parse(environ[var])
        except ValueError as exc:
            raise ConfigError(f"environment variable {var}={environ[var]!r}: {exc}") from exc
        (merged["engine"] if section == "engine" else merged)[key] = value
    return merged


def load_settings(path: Path | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Read the config file (missing is fine: defaults), then apply environment overrides."""
    environ = dict(os.environ) if environ is None else environ
    path = path or config_path()
    raw = _read_yaml(path) if path.exists() else {}
    source = path if path.exists() else None
    where = str(path)

    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
    if "engine" in raw and raw["engine"] is not None and not isinstance(raw["engine"], dict):
        raise ConfigError(f"{where}: key 'engine' must be a mapping")
    raw = _apply_env(raw, environ)

    engine_raw = raw.get("engine") or {}
    unknown = set(engine_raw) - set(ENGINE_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key 'engine.{sorted(unknown)[0]}' (known: {', '.join(sorted(ENGINE_KEYS))})"
        )
    try:
        engine = EngineSettings(**engine_raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc

    default_model = raw.get("default_model", Settings.default_model)
    if not isinstance(default_model, str) or not default_model:
        raise ConfigError(f"{where}: key 'default_model' must be a model alias or a .gguf path")
    models_dir = raw.get("models_dir", DEFAULT_MODELS_DIR)
    if models_dir is not None:
        if not isinstance(models_dir, str):
            raise ConfigError(f"{where}: key 'models_dir' must be a folder path")
        models_dir = Path(models_dir).expanduser()
    follow_links = raw.get("models_dir_follow_links", False)
    if not isinstance(follow_links, bool):
        raise ConfigError(f"{where}: key 'models_dir_follow_links' must be true or false")
    slo = parse_slo(raw.get("slo"), f"{where}: key 'slo'")
    api_keys = parse_api_keys(raw.get("api_keys"), where, environ)
    return Settings(
        api_keys=api_keys,
        default_model=default_model,
        models_dir=models_dir,
        models_dir_follow_links=follow_links,
        engine=engine,
        source=source,
        slo=slo,
        **_pool_settings(raw, engine, where, slo),
    )


def _pool_settings(raw: dict[str, Any], engine: EngineSettings, where: str, slo: SloSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, least in (("max_loaded_models", 1), ("memory_reserve_mib", 0), ("response_store_mib", 0)):
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{where}: key {key!r} must be an integer >= {least}, got {value!r}")
            out[key] = value
    if "keep_alive" in raw:
        try:
            out["keep_alive"] = parse_keep_alive(raw["keep_alive"])
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    models_raw = raw.get("models") or {}
    if not isinstance(models_raw, dict):
        raise ConfigError(f"{where}: key 'models' must map model aliases to their settings")
    models: dict[str, ModelSettings] = {}
    for alias, entry in models_raw.items():
        entry = entry or {}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: 'models.{alias}' must be a mapping of settings")
        unknown = set(entry) - MODEL_KEYS
        if unknown:
            raise ConfigError(
                f"{where}: unknown key 'models.{alias}.{sorted(unknown)[0]}' (known: {', '.join(sorted(MODEL_KEYS))})"
            )
        overrides = {k: v for k, v in entry.items() if k not in ("chat_template", "slo")}
        model_slo = parse_slo(entry["slo"], f"{where}: 'models.{alias}.slo'", slo) if "slo" in entry else None
        template = entry.get("chat_template")
        if template is not None and (not isinstance(template, str) or not template.strip()):
            raise ConfigError(f"{where}: 'models.{alias}.chat_template' must be a Jinja template (text)")
        try:
            dataclasses.replace(engine, **overrides)  # validates each value
        except ConfigError as exc:
            raise ConfigError(f"{where}: models.{alias}: {exc}") from None
        models[str(alias).lower()] = ModelSettings(engine=overrides, chat_template=template, slo=model_slo)
    out["models"] = models
    return out
