"""Settings shared by the CLI, `magnitude serve` and the Jupyter extension.

One YAML file (``~/.magnitude/config.yaml``, or the path in ``MAGNITUDE_CONFIG``) holds the
defaults; ``MAGNITUDE_*`` environment variables override it; command-line flags and Jupyter
traitlets override both. A broken file is an error that names the file and the key, never a
silent fallback to defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_ENV = "MAGNITUDE_CONFIG"
DEFAULT_CONFIG_PATH = Path("~/.magnitude/config.yaml")
DEFAULT_MODELS_DIR = "~/.magnitude/models"  # a .gguf placed here is served by name, no restart needed


class ConfigError(ValueError):
    """The config file (or an override) cannot be used as it is; the message says where and why."""


# KV cache types llama.cpp's CPU backend takes (a quantized V needs flash attention: `uses_flash_attention`).
UNQUANTIZED_CACHE_TYPES = ("f16", "f32")
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32", "q5_1", "q5_0", "q4_1")


def about(
    help: str, kind: str, *, per_model: bool = True, env: bool = False, choices: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The one description of an engine setting: its help, its kind (for flags, traitlets and the docs),
    whether a model's own settings may change it, whether a MAGNITUDE_* variable sets it, its choices."""
    return {"help": help, "kind": kind, "per_model": per_model, "env": env, "choices": choices}


@dataclass(frozen=True)
class EngineSettings:
    """How the engine is sized and behaves. Each field is one setting: the config file's `engine:` key,
    `magnitude serve`'s flag, the Jupyter extension's traitlet and the docs' row (docs/configuration.md)
    all come from its metadata (`about`)."""

    parallel: int = field(default=8, metadata=about("Sequences decoded together (request slots).", "int", env=True))
    ctx_size: int | str = field(
        default=8192,
        metadata=about(
            "KV cache cells shared by all sequences, or 'auto': as many as memory_budget holds (engine/memory.py).",
            "int|auto",
            env=True,
        ),
    )
    n_batch: int = field(
        default=512, metadata=about("Tokens per decode step: decode rows first, then prompt chunks.", "int")
    )
    threads: int = field(
        default=0,
        metadata=about(
            "CPU threads for llama.cpp; 0: the cores other processes leave free, read once a second.",
            "int",
            env=True,
        ),
    )
    max_waiting: int = field(default=256, metadata=about("Waiting requests before new ones get 429.", "int"))
    admission: str = field(
        default="estimate",
        metadata=about(
            "How a request is charged KV cells: 'estimate' holds its prompt + the answer's likely length "
            "and grows, preempting a running request to the RAM tier when the cells run out; 'reserve' "
            "holds its prompt + max_tokens from the start and never preempts (docs/decisions.md).",
            "str",
            choices=("reserve", "estimate"),
        ),
    )
    default_max_tokens: int = field(default=512, metadata=about("max_tokens of a request that gives none.", "int"))
    grace_seconds: float = field(
        default=60.0,
        metadata=about(
            "A stream nobody reads is cancelled after this long (a reader may re-attach).", "float", env=True
        ),
    )
    retention_seconds: float = field(
        default=300.0, metadata=about("A finished stream's events are kept this long for re-attaching.", "float")
    )
    max_retained_events: int = field(
        default=100_000, metadata=about("Events kept over all finished streams.", "int", per_model=False)
    )
    prefix_reuse: bool = field(
        default=True,
        metadata=about(
            "Start a prompt from cells already computed: the prefix cache's, or a running request's (rows "
            "that start together); off, every prompt is computed whole.",
            "bool",
        ),
    )
    min_prefix_tokens: int = field(default=4, metadata=about("The shortest cached prefix worth copying.", "int"))
    swa_full: bool = field(
        default=False,
        metadata=about(
            "Sliding-window layers keep every token's cells, as global layers do: more memory, and a cached "
            "prefix reusable at any point, not only where an entry ends (docs/decisions.md).",
            "bool",
        ),
    )
    prefix_cache_ram_mib: int = field(
        default=256,
        metadata=about(
            "Host memory for evicted cache entries, restored when their conversation returns, and a "
            "sliding-window model's window checkpoints.",
            "int",
        ),
    )
    prefix_cache_entries: int = field(
        default=64,
        metadata=about(
            "Cache entries held in KV cells at once; each is a llama.cpp sequence with a resident logits row. "
            "A model with sliding-window layers holds at most `parallel` (its entries share the request "
            "slots' sequences; docs/decisions.md).",
            "int",
        ),
    )
    prefix_cache_spill_rows: int = field(
        default=64,
        metadata=about(
            "An entry unused while this many rows decode moves to the RAM tier; 0: only under pressure.", "int"
        ),
    )
    prefix_cache_scope: str = field(
        default="shared",
        metadata=about(
            "'shared': any request may reuse any cached prefix; 'user': only those of requests with the same "
            "`user` (or `cache_salt`), so no client can time another's prompts.",
            "str",
            choices=("shared", "user"),
        ),
    )
    draft_tokens: int = field(
        default=6,
        metadata=about("Prompt-lookup guesses per step for greedy requests (how many is measured); 0: off.", "int"),
    )
    draft_max_sequences: int = field(
        default=8, metadata=about("No drafts while more sequences than this decode.", "int")
    )
    gpu_layers: int = field(
        default=0,
        metadata=about("Layers offloaded to a GPU (GPU builds of llama-cpp-python; a CPU build ignores it).", "int"),
    )
    cache_type: str = field(
        default="f16",
        metadata=about(
            "The KV cache's type: f16, q8_0 (about half the bytes), q4_0 (about a quarter).",
            "str",
            env=True,
            choices=KV_CACHE_TYPES,
        ),
    )
    cache_type_v: str | None = field(
        default=None,
        metadata=about("V's own type, when it differs from K's.", "str|null", choices=KV_CACHE_TYPES),
    )
    memory_budget: int | float | str | None = field(
        default=None,
        metadata=about(
            "With ctx_size auto: bytes ('4GiB') or a fraction of the memory free at load; none: half of it.",
            "bytes|fraction",
            env=True,
        ),
    )
    mlock: bool = field(default=False, metadata=about("Keep the weights locked in RAM.", "bool"))
    mmap: bool | None = field(
        default=None,
        metadata=about("Map the weights from the file; null: llama.cpp's choice (mmap on a CPU).", "bool|null"),
    )
    repack: bool | None = field(
        default=None,
        metadata=about(
            "llama.cpp's repacked weight layouts; null: on, unless this build's AMX kernels would crash.",
            "bool|null",
        ),
    )
    flash_attention: bool | None = field(
        default=None,
        metadata=about(
            "llama.cpp's flash attention; null: on with GPU layers or a quantized V, else measured at load on "
            "this machine, the faster kind kept (docs/decisions.md, 'Attention kernel').",
            "bool|null",
        ),
    )

    def __post_init__(self) -> None:
        if self.ctx_size != "auto" and (
            not isinstance(self.ctx_size, int) or isinstance(self.ctx_size, bool) or self.ctx_size < 1
        ):
            raise ConfigError(f"engine setting 'ctx_size' must be a positive integer or 'auto', got {self.ctx_size!r}")
        for item in dataclasses.fields(self):
            choices, value = item.metadata["choices"], getattr(self, item.name)
            if choices and not (value is None and item.metadata["kind"].endswith("|null")) and value not in choices:
                raise ConfigError(f"engine setting {item.name!r} must be one of {', '.join(choices)}, got {value!r}")
        if not (self.flash_attention is None or isinstance(self.flash_attention, bool)):
            raise ConfigError(
                f"engine setting 'flash_attention' must be true, false or null, got {self.flash_attention!r}"
            )
        if self.flash_attention is False and self.kv_types[1] not in UNQUANTIZED_CACHE_TYPES:
            raise ConfigError(
                f"engine setting 'flash_attention': false cannot hold a {self.kv_types[1]} V cache "
                "(llama.cpp quantizes V only with flash attention): use f16 or f32 for V, or flash_attention: true"
            )
        if self.memory_budget is not None:
            if self.ctx_size != "auto":
                raise ConfigError("engine setting 'memory_budget' sizes the KV cache only with ctx_size: auto")
            parse_memory_budget(self.memory_budget)
        if not isinstance(self.mlock, bool) or not (self.mmap is None or isinstance(self.mmap, bool)):
            raise ConfigError(
                f"engine settings 'mlock' and 'mmap' must be true or false, got {self.mlock!r}, {self.mmap!r}"
            )
        if not (self.repack is None or isinstance(self.repack, bool)):
            raise ConfigError(f"engine setting 'repack' must be true, false or null, got {self.repack!r}")
        for name in ("prefix_reuse", "swa_full"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"engine setting {name!r} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.prefix_cache_ram_mib, int) or self.prefix_cache_ram_mib < 0:
            raise ConfigError(
                f"engine setting 'prefix_cache_ram_mib' must be an integer >= 0, got {self.prefix_cache_ram_mib!r}"
            )
        for name in (
            "parallel",
            "n_batch",
            "max_waiting",
            "default_max_tokens",
            "min_prefix_tokens",
            "prefix_cache_entries",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"engine setting {name!r} must be a positive integer, got {value!r}")
        if self.parallel > 255:  # llama.cpp holds 256 sequences; the prefix cache needs one at least
            raise ConfigError(f"engine setting 'parallel' must be at most 255, got {self.parallel!r}")
        for name in ("threads", "gpu_layers", "draft_tokens", "draft_max_sequences", "prefix_cache_spill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"engine setting {name!r} must be an integer >= 0, got {value!r}")
        for name in ("grace_seconds", "retention_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"engine setting {name!r} must be a number >= 0, got {value!r}")

    @property
    def n_threads(self) -> int:
        return self.threads or (os.cpu_count() or 1)

    @property
    def kv_types(self) -> tuple[str, str]:
        """(K's type, V's type) of the KV cache."""
        return self.cache_type, self.cache_type_v or self.cache_type

    @property
    def flash_attention_choice(self) -> bool | None:
        """What the runner is told: the setting, on with GPU layers or a quantized V (which needs it),
        else None: measured at load on this machine (engine/attention_probe.py)."""
        if self.flash_attention is not None:
            return self.flash_attention
        if self.gpu_layers > 0 or self.kv_types[1] not in UNQUANTIZED_CACHE_TYPES:
            return True
        return None

    @property
    def uses_flash_attention(self) -> bool:
        if self.flash_attention is not None:
            return self.flash_attention
        return self.gpu_layers > 0 or self.kv_types[1] not in UNQUANTIZED_CACHE_TYPES

    @property
    def kv_type_label(self) -> str:
        k, v = self.kv_types
        return k if k == v else f"{k}/{v}"

    @property
    def cells(self) -> int:
        """The KV cache's size in tokens, once "auto" has been resolved (engine/memory.py)."""
        if not isinstance(self.ctx_size, int):
            raise ConfigError("ctx_size 'auto' is resolved against a model file before the engine starts")
        return self.ctx_size


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

    ttft_p95_ms: float | None = field(
        default=None, metadata=about("p95 time to first token, in ms, over the window.", "float|null")
    )
    e2e_p95_ms: float | None = field(
        default=None, metadata=about("p95 time from arrival to the last token, in ms.", "float|null")
    )
    round_p95_ms: float | None = field(
        default=None,
        metadata=about(
            "p95 end-to-end time of a conversation's later rounds (requests with an earlier answer).", "float|null"
        ),
    )
    min_tokens_per_s: float | None = field(
        default=None, metadata=about("Output tokens/s a request decodes at, for 95% of requests.", "float|null")
    )
    window: float = field(
        default=300.0, metadata=about("The rolling window objectives are judged over: seconds or '5m'.", "duration")
    )
    shed: bool = field(
        default=False,
        metadata=about(
            "Keep the TTFT objective: an interactive request predicted to wait longer than it for its first "
            "token gets 503 and Retry-After at once (batch requests queue on). Off by default.",
            "bool",
        ),
    )
    fallback_model: str | None = field(
        default=None,
        metadata=about(
            "With shed: a smaller model (an alias) that takes the requests the objective would shed, "
            "while its own queue keeps the objective; the answer's model says which served it.",
            "str|null",
        ),
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


BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20}
BYTE_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_memory_budget(value: Any) -> int | float:
    """Bytes (an integer, or "4GiB", "512MB"), or a fraction of free memory (a number in (0, 1])."""
    import re

    number, unit = None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
        if match:
            number, unit = float(match.group(1)), match.group(2).lower()
    if number is not None and unit is not None and unit in BYTE_UNITS and number > 0:
        if not unit and number <= 1:
            return number  # a fraction of the memory free at load
        if unit or number == int(number):
            return int(number * BYTE_UNITS[unit])
    raise ConfigError(
        "engine setting 'memory_budget' must be bytes (an integer, or like '4GiB') or a fraction of free memory "
        f"(above 0, at most 1), got {value!r}"
    )


@dataclass(frozen=True)
class ModelSettings:
    """One model's own settings (`models: {alias: {...}}`): engine settings that differ for it, and
    a chat template that replaces the one in its file."""

    engine: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    slo: SloSettings | None = None  # its own objectives (over the server's), if the config gives any


@dataclass(frozen=True)
class Settings:
    default_model: str = "smollm2-135m"
    models_dir: Path | None = None
    # A *.gguf in models_dir that is a link to a file outside it is not served unless this is true.
    models_dir_follow_links: bool = False
    engine: EngineSettings = field(default_factory=EngineSettings)
    source: Path | None = None  # the file these came from, if any
    # Many models behind one server (engine/pool.py):
    max_loaded_models: int = 2  # resident at once; the least recently used idle one makes room
    keep_alive: float = 300.0  # seconds an idle model stays loaded; -1: until it must make room
    memory_reserve_mib: int = 512  # memory a model load must leave free for everything else
    # Responses-API responses kept (stored, and being made), in MiB; 0: 1/128 of the machine's RAM, 16-256.
    response_store_mib: int = 0
    # Clients of `magnitude serve`, each a tenant with its own key (docs/operations.md, "Several clients").
    api_keys: tuple[ApiKey, ...] = ()
    models: dict[str, ModelSettings] = field(default_factory=dict)
    slo: SloSettings = field(default_factory=SloSettings)

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
MODEL_KEYS = {f.name for f in dataclasses.fields(EngineSettings) if f.metadata["per_model"]} | {"chat_template", "slo"}
TOP_KEYS = {
    "default_model",
    "models_dir",
    "models_dir_follow_links",
    "engine",
    "max_loaded_models",
    "keep_alive",
    "memory_reserve_mib",
    "response_store_mib",
    "api_keys",
    "models",
    "slo",
}
DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float:
    """Seconds from a number or Ollama's duration strings ("30s", "5m", "1h"); -1 (or any negative)
    means "no time limit"."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be seconds or a duration like '5m', got {value!r}")
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        unit = DURATION_UNITS.get(text[-1:]) if text else None
        try:
            number = float(text[:-1]) if unit else float(text)
        except ValueError:
            number = None
        if number is not None:
            return -1.0 if number < 0 else number * (unit or 1.0)
    raise ValueError(f"keep_alive must be seconds or a duration like '5m', got {value!r}")


def parse_token_count(text: str) -> int | str:
    """A ctx_size given as text: a number of tokens, or 'auto'."""
    return text if text == "auto" else int(text)


KIND_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "int|auto": parse_token_count,
    "bytes|fraction": str,
}

# Environment overrides: variable -> (section, key, parser). The engine's come from its settings' metadata.
ENV_OVERRIDES: dict[str, tuple[str | None, str, Callable[[str], Any]]] = {
    "MAGNITUDE_MODEL": (None, "default_model", str),
    "MAGNITUDE_MODELS_DIR": (None, "models_dir", str),
    **{
        f"MAGNITUDE_{item.name.upper()}": ("engine", item.name, KIND_PARSERS[item.metadata["kind"]])
        for item in dataclasses.fields(EngineSettings)
        if item.metadata["env"]
    },
    "MAGNITUDE_MAX_LOADED_MODELS": (None, "max_loaded_models", int),
    "MAGNITUDE_KEEP_ALIVE": (None, "keep_alive", str),
}


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
