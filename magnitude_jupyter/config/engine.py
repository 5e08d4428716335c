"""The engine's settings, each declared once (`EngineSettings`), and the parsers of their values."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..options import option, option_of

CONFIG_ENV = "MAGNITUDE_CONFIG"
DEFAULT_CONFIG_PATH = Path("~/.magnitude/config.yaml")
DEFAULT_MODELS_DIR = "~/.magnitude/models"  # a .gguf placed here is served by name, no restart needed


class ConfigError(ValueError):
    """The config file (or an override) cannot be used as it is; the message says where and why."""


# KV cache types llama.cpp's CPU backend takes (a quantized V needs flash attention: `uses_flash_attention`).
UNQUANTIZED_CACHE_TYPES = ("f16", "f32")
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32", "q5_1", "q5_0", "q4_1")
# A cache entry moves to the RAM tier once a step decodes without it: it comes back into cells in one
# piece, where decoding beside others had spread it (docs/decisions.md, "Idle entries move").
SPILL_AFTER_ROWS = 1


@dataclass(frozen=True)
class EngineSettings:
    """How the engine is sized and behaves. Each field is one setting: the config file's `engine:` key,
    `magnitude serve`'s flag, the Jupyter extension's traitlet and the docs' row (docs/configuration.md)
    all come from its `Option` (magnitude_jupyter/options.py)."""

    parallel: int = option(8, "Sequences decoded together (request slots).", kind="int", env=True)
    ctx_size: int | str = option(
        8192,
        "KV cache cells shared by all sequences, or 'auto': as many as memory_budget holds (engine/memory.py).",
        kind="int|auto",
        env=True,
    )
    n_batch: int = option(
        2048,
        "Tokens per decode step: decode rows first, then prompt chunks; llama.cpp computes them n_ubatch "
        "at a time (docs/decisions.md, 'A step of 2,048 tokens in pieces of 512').",
        kind="int",
    )
    n_ubatch: int = option(
        512,
        "Tokens llama.cpp computes at once (its compute buffer is sized for this many); a larger step "
        "runs in pieces. At most n_batch.",
        kind="int",
    )
    threads: int = option(
        0,
        "CPU threads for llama.cpp; 0: the cores other processes leave free, read once a second.",
        kind="int",
        env=True,
    )
    max_waiting: int = option(256, "Waiting requests before new ones get 429.", kind="int")
    admission: str = option(
        "estimate",
        "How a request is charged KV cells: 'estimate' holds its prompt + the answer's likely length "
        "and grows, preempting a running request to the RAM tier when the cells run out; 'reserve' "
        "holds its prompt + max_tokens from the start and never preempts (docs/decisions.md).",
        kind="str",
        choices=("reserve", "estimate"),
    )
    default_max_tokens: int = option(512, "max_tokens of a request that gives none.", kind="int")
    grace_seconds: float = option(
        60.0, "A stream nobody reads is cancelled after this long (a reader may re-attach).", kind="float", env=True
    )
    retention_seconds: float = option(
        300.0, "A finished stream's events are kept this long for re-attaching.", kind="float"
    )
    max_retained_events: int = option(100_000, "Events kept over all finished streams.", kind="int", per_model=False)
    prefix_reuse: bool = option(
        True,
        "Start a prompt from cells already computed: the prefix cache's, or a running request's (rows "
        "that start together); off, every prompt is computed whole.",
        kind="bool",
    )
    min_prefix_tokens: int = option(4, "The shortest cached prefix worth copying.", kind="int")
    swa_full: bool = option(
        False,
        "Sliding-window layers keep every token's cells, as global layers do: more memory, and a cached "
        "prefix reusable at any point, not only where an entry ends (docs/decisions.md).",
        kind="bool",
    )
    prefix_cache_ram_mib: int = option(
        256,
        "Host memory for evicted cache entries, restored when their conversation returns, and a "
        "sliding-window model's window checkpoints.",
        kind="int",
    )
    prefix_cache_entries: int = option(
        64,
        "Cache entries held in KV cells at once; each is a llama.cpp sequence with a resident logits row. "
        "A model with sliding-window layers holds at most `parallel` (its entries share the request "
        "slots' sequences; docs/decisions.md).",
        kind="int",
    )
    prefix_cache_spill_rows: int = option(
        SPILL_AFTER_ROWS,
        "An entry unused while this many rows decode moves to the RAM tier (if it has room), and comes "
        "back into cells in one piece; 0: only under pressure.",
        kind="int",
    )
    prefix_cache_scope: str = option(
        "shared",
        "'shared': any request may reuse any cached prefix; 'user': only those of requests with the same "
        "`user` (or `cache_salt`), so no client can time another's prompts.",
        kind="str",
        choices=("shared", "user"),
    )
    draft_tokens: int = option(
        6, "Prompt-lookup guesses per step for greedy requests (how many is measured); 0: off.", kind="int"
    )
    draft_max_sequences: int = option(8, "No drafts while more sequences than this decode.", kind="int")
    gpu_layers: int = option(
        0, "Layers offloaded to a GPU (GPU builds of llama-cpp-python; a CPU build ignores it).", kind="int"
    )
    cache_type: str = option(
        "f16",
        "The KV cache's type: f16, q8_0 (about half the bytes), q4_0 (about a quarter).",
        kind="str",
        env=True,
        choices=KV_CACHE_TYPES,
    )
    cache_type_v: str | None = option(
        None, "V's own type, when it differs from K's.", kind="str|null", choices=KV_CACHE_TYPES
    )
    memory_budget: int | float | str | None = option(
        None,
        "With ctx_size auto: bytes ('4GiB') or a fraction of the memory free at load; none: half of it.",
        kind="bytes|fraction",
        env=True,
    )
    mlock: bool = option(False, "Keep the weights locked in RAM.", kind="bool")
    mmap: bool | None = option(
        None, "Map the weights from the file; null: llama.cpp's choice (mmap on a CPU).", kind="bool|null"
    )
    repack: bool | None = option(
        None,
        "llama.cpp's repacked weight layouts; null: on, unless this build's AMX kernels would crash.",
        kind="bool|null",
    )
    control_tokens_in_messages: bool = option(
        False,
        "Read a control token's text written in a chat message (<|im_start|>system in a user's or a tool's "
        "text) as that control token, as llama-server does; false: message text is text, and only the chat "
        "template writes control tokens (docs/decisions.md, 'Message text is text').",
        kind="bool",
    )
    flash_attention: bool | None = option(
        None,
        "llama.cpp's flash attention; null: on with GPU layers or a quantized V, else measured at load on "
        "this machine, the faster kind kept (docs/decisions.md, 'Attention kernel').",
        kind="bool|null",
    )

    def __post_init__(self) -> None:
        if self.ctx_size != "auto" and (
            not isinstance(self.ctx_size, int) or isinstance(self.ctx_size, bool) or self.ctx_size < 1
        ):
            raise ConfigError(f"engine setting 'ctx_size' must be a positive integer or 'auto', got {self.ctx_size!r}")
        for item in dataclasses.fields(self):
            spelled, value = option_of(item), getattr(self, item.name)
            choices, kind = spelled.choices, spelled.kind or ""
            if choices and not (value is None and kind.endswith("|null")) and value not in choices:
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
        for name in ("prefix_reuse", "swa_full", "control_tokens_in_messages"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"engine setting {name!r} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.prefix_cache_ram_mib, int) or self.prefix_cache_ram_mib < 0:
            raise ConfigError(
                f"engine setting 'prefix_cache_ram_mib' must be an integer >= 0, got {self.prefix_cache_ram_mib!r}"
            )
        for name in (
            "parallel",
            "n_batch",
            "n_ubatch",
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
    def ubatch(self) -> int:
        """The tokens llama.cpp computes at once: n_ubatch, or n_batch where that is smaller (llama.cpp
        clamps it so)."""
        return min(self.n_ubatch, self.n_batch)

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
        f"MAGNITUDE_{item.name.upper()}": ("engine", item.name, KIND_PARSERS[option_of(item).kind or "str"])
        for item in dataclasses.fields(EngineSettings)
        if option_of(item).env
    },
    "MAGNITUDE_MAX_LOADED_MODELS": (None, "max_loaded_models", int),
    "MAGNITUDE_KEEP_ALIVE": (None, "keep_alive", str),
}
