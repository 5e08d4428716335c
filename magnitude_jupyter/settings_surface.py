"""Every engine setting's flag, traitlet and documentation row, made from its one definition.

`config.EngineSettings` declares each setting once (name, type, default, and `about` metadata: help,
kind, per model, environment variable, choices). `magnitude serve`'s options, the Jupyter
extension's traitlets and docs/configuration.md are generated here from it; a test checks that the
three agree with the table and that the committed page is what `render_configuration()` writes.

    python -m magnitude_jupyter.settings_surface > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_MODELS_DIR,
    ENV_OVERRIDES,
    KIND_PARSERS,
    ConfigError,
    EngineSettings,
    Settings,
    SloSettings,
    parse_keep_alive,
)


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # int, float, bool, str, and "|null" / "|auto" / "bytes|fraction" variants
    default: Any
    help: str
    per_model: bool
    env: str | None
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.kind.startswith("bool")


def engine_settings() -> list[Setting]:
    """The engine's settings, in the order they are declared."""
    env_of = {key: var for var, (section, key, _) in ENV_OVERRIDES.items() if section == "engine"}
    return [
        Setting(
            name=item.name,
            kind=item.metadata["kind"],
            default=item.default,
            help=item.metadata["help"],
            per_model=item.metadata["per_model"],
            env=env_of.get(item.name),
            choices=item.metadata["choices"],
        )
        for item in dataclasses.fields(EngineSettings)
    ]


SLO_PREFIX = "slo_"


def slo_settings() -> list[Setting]:
    """The objectives' settings (`slo:` keys), named as their flags and traitlets are: `slo_<key>`."""
    return [
        Setting(
            name=SLO_PREFIX + item.name,
            kind=item.metadata["kind"],
            default=item.default,
            help=item.metadata["help"],
            per_model=True,
            env=None,
            choices=None,
        )
        for item in dataclasses.fields(SloSettings)
    ]


def slo_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The objectives given as flags or traitlets (`slo_<key>`), as `slo:` keys; a ValueError names the flag."""
    out: dict[str, Any] = {}
    for setting in slo_settings():
        value = values.get(setting.name)
        if value is None:
            continue
        key = setting.name.removeprefix(SLO_PREFIX)
        if setting.is_bool or setting.kind == "str|null":
            out[key] = value
            continue
        try:
            out[key] = parse_keep_alive(value) if key == "window" else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{setting.flag}: {setting.help} Got {value!r}") from None
    return out


def with_slo(settings: Settings, values: dict[str, Any]) -> Settings:
    """`settings` with the objectives given as flags or traitlets over the config's."""
    overrides = slo_overrides(values)
    if not overrides:
        return settings
    try:
        return dataclasses.replace(settings, slo=dataclasses.replace(settings.slo, **overrides))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


# -- magnitude serve ---------------------------------------------------------------------------------


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Click options for every engine setting and objective (unset: the config file decides)."""
    import click

    for setting in reversed([*engine_settings(), *slo_settings()]):
        section = (
            f"slo.{setting.name.removeprefix(SLO_PREFIX)}"
            if setting.name.startswith(SLO_PREFIX)
            else f"engine.{setting.name}"
        )
        help_text = f"{setting.help} [{section}]"
        if setting.is_bool:
            negative = "--no-" + setting.flag[2:]
            option = click.option(f"{setting.flag}/{negative}", setting.name, default=None, help=help_text)
        elif setting.choices:
            option = click.option(setting.flag, setting.name, type=click.Choice(setting.choices), help=help_text)
        else:
            kind = {"int": int, "float": float, "float|null": float}.get(setting.kind, str)
            option = click.option(setting.flag, setting.name, type=kind, default=None, help=help_text)
        command = option(command)
    return command


def engine_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """The engine settings given on the command line, parsed (a ValueError names the flag)."""
    settings = {s.name: s for s in engine_settings()}
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or name not in settings:
            continue
        setting = settings[name]
        if isinstance(value, str) and setting.kind in KIND_PARSERS:
            try:
                value = KIND_PARSERS[setting.kind](value)
            except ValueError:
                raise ValueError(f"{setting.flag}: {setting.help.split(';')[0]} Got {value!r}") from None
        out[name] = value
    return out


# -- the Jupyter extension ---------------------------------------------------------------------------


def engine_traits() -> dict[str, Any]:
    """A traitlet for every engine setting (None: the config file decides)."""
    from traitlets import Bool, Float, Integer, Unicode, Union

    traits: dict[str, Any] = {}
    for s in [*engine_settings(), *slo_settings()]:
        if s.is_bool:
            traits[s.name] = Bool(None, allow_none=True, config=True, help=s.help)
        elif s.kind == "int":
            traits[s.name] = Integer(None, allow_none=True, config=True, help=s.help)
        elif s.kind in ("float", "float|null"):
            traits[s.name] = Float(None, allow_none=True, config=True, help=s.help)
        elif s.kind == "duration":
            traits[s.name] = Union([Float(), Unicode()], default_value=None, allow_none=True, config=True, help=s.help)
        elif s.kind == "int|auto":
            traits[s.name] = Union(
                [Integer(), Unicode()], default_value=None, allow_none=True, config=True, help=s.help
            )
        elif s.kind == "bytes|fraction":
            kinds = [Integer(), Float(), Unicode()]
            traits[s.name] = Union(kinds, default_value=None, allow_none=True, config=True, help=s.help)
        else:
            traits[s.name] = Unicode(None, allow_none=True, config=True, help=s.help)
    return traits


# -- docs/configuration.md ---------------------------------------------------------------------------

TOP_LEVEL = (
    ("default_model", "The model served when a request names none: an alias or a .gguf path."),
    ("models_dir", "Every *.gguf here is a model, by its file name lower-cased; no restart needed."),
    ("models_dir_follow_links", "Serve a *.gguf in models_dir that links to a file outside it."),
    ("max_loaded_models", "Models resident at once; the least recently used idle one makes room."),
    ("keep_alive", "Seconds (or '5m') an idle model stays loaded; -1: until its room is needed."),
    ("memory_reserve_mib", "Memory a model load must leave free for everything else."),
    (
        "response_store_mib",
        "Memory for Responses-API responses, stored and being made (least recently used out first); "
        "0: 1/128 of RAM, 16-256 MiB.",
    ),
    (
        "api_keys",
        "Clients of `magnitude serve`, each a tenant: `[{name, key or key_env, batch, models, never_shed}]` "
        "(docs/operations.md).",
    ),
    ("models", "Per model, by alias: engine settings that differ for it, `chat_template` and `slo`."),
    ("slo", "Service-level objectives, watched live (below)."),
    ("engine", "The engine settings below."),
)
SERVE_ONLY = (
    ("-m, --model", "Model alias or .gguf path (default: the config file's)."),
    ("--host", "Address to bind (127.0.0.1)."),
    ("--port", "Port (8000)."),
    ("--token", "Bearer token clients must send (default: $MAGNITUDE_TOKEN, else a new one)."),
    ("--no-auth", "Accept requests without a token (loopback hosts only)."),
    ("--force", "Allow --no-auth on a non-loopback host."),
    ("-v, --verbose", "Show llama.cpp's log."),
)
EXTENSION_ONLY = (
    ("model", "Model alias or .gguf path (default: the config file's)."),
    ("max_body_bytes", "Largest request body accepted; 413 above (1 MiB)."),
    ("load_model_at_start", "Load the default model when Jupyter starts (false: on the first request that needs it)."),
)


def _default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 10_000:
        return f"{value:_}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_configuration() -> str:
    """docs/configuration.md, from the one definition of each setting."""
    top_defaults = {f.name: f.default for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING}
    top_defaults["models_dir"] = DEFAULT_MODELS_DIR
    top_defaults["api_keys"] = "[]"
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m magnitude_jupyter.settings_surface`; a test checks it. -->",
        "",
        f"One YAML file, `{DEFAULT_CONFIG_PATH}` (or the path in `MAGNITUDE_CONFIG`), holds the defaults for the",
        "CLI, `magnitude serve` and the Jupyter extension. `MAGNITUDE_*` environment variables override the file;",
        "`magnitude serve`'s flags and the extension's traitlets (`c.MagnitudeApp.NAME`) override both; a model's",
        "own entry under `models:` wins over all of them for that model. A broken file, an unknown key or a",
        "bad value is an error naming the file and the key, never a silent default.",
        "",
        "```yaml",
        "default_model: smollm2-135m",
        "models_dir: ~/models",
        "engine:",
        "  parallel: 8",
        "  ctx_size: auto",
        "  memory_budget: 4GiB",
        "  cache_type: q8_0",
        "models:",
        "  qwen2.5-1.5b-instruct-q4_k_m:",
        "    parallel: 4",
        "    ctx_size: 16384",
        "```",
        "",
        "## Top-level keys",
        "",
        "| key | default | what |",
        "|---|---|---|",
    ]
    for name, text in TOP_LEVEL:
        default = "" if name in ("models", "engine") else f"`{_default(top_defaults.get(name))}`"
        lines.append(f"| `{name}` | {default} | {_cell(text)} |")
    lines += [
        "",
        "## Engine settings",
        "",
        "Each row is one setting: the key under `engine:` (and under a model's entry where *per model* says so),",
        "the `magnitude serve` flag, the traitlet `c.MagnitudeApp.<key>`, and the environment variable where",
        "there is one.",
        "",
        "| key | default | flag | env | per model | what |",
        "|---|---|---|---|---|---|",
    ]
    for s in engine_settings():
        flag = f"`{s.flag}/--no-{s.flag[2:]}`" if s.is_bool else f"`{s.flag}`"
        env = f"`{s.env}`" if s.env else ""
        choices = f" One of {', '.join(s.choices)}." if s.choices else ""
        per_model = "yes" if s.per_model else ""
        lines.append(
            f"| `{s.name}` | `{_default(s.default)}` | {flag} | {env} | {per_model} | {_cell(s.help + choices)} |"
        )
    other_env = [var for var, (section, _, _) in ENV_OVERRIDES.items() if section != "engine"]
    lines += [
        "",
        "Other environment variables: " + ", ".join(f"`{v}`" for v in other_env) + " (the top-level keys of the",
        "same names), `MAGNITUDE_CONFIG` (the file), `MAGNITUDE_URL` / `MAGNITUDE_TOKEN` (the server clients use),",
        "`MAGNITUDE_RUNTIME_DIR`, `MAGNITUDE_PROFILES_DIR` and `MAGNITUDE_CACHE_DIR` (where runtime files, calibration",
        "profiles and the GGUF metadata cache live), `MAGNITUDE_ATTENTION_FILE` (the attention probe's results,",
        "`flash_attention: null`).",
    ]
    lines += [
        "",
        "## Service-level objectives",
        "",
        "Under `slo:` (and under a model's entry, `models.<alias>.slo:`, whose keys replace the server's for that",
        "model); the flag and the traitlet `c.MagnitudeApp.slo_<key>` likewise. Each objective set is judged",
        "live over the window: `/status` (`slo`), `/metrics` (`magnitude_slo_*`), `magnitude slo`.",
        "",
        "```yaml",
        "slo:",
        "  ttft_p95_ms: 2000",
        "  e2e_p95_ms: 8000",
        "  window: 5m",
        "```",
        "",
        "| key | default | flag | what |",
        "|---|---|---|---|",
    ]
    for s in slo_settings():
        lines.append(
            f"| `{s.name.removeprefix(SLO_PREFIX)}` | `{_default(s.default)}` | `{s.flag}` | {_cell(s.help)} |"
        )
    lines += [
        "",
        "## `magnitude serve` only",
        "",
        "| flag | what |",
        "|---|---|",
        *(f"| `{flag}` | {_cell(text)} |" for flag, text in SERVE_ONLY),
        "",
        "## The Jupyter extension only",
        "",
        "| traitlet | what |",
        "|---|---|",
        *(f"| `c.MagnitudeApp.{name}` | {_cell(text)} |" for name, text in EXTENSION_ONLY),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_configuration(), end="")
