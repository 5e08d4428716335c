"""Settings shared by the CLI, `magnitude serve` and the Jupyter extension.

One YAML file (``~/.magnitude/config.yaml``, or the path in ``MAGNITUDE_CONFIG``) holds the
defaults; ``MAGNITUDE_*`` environment variables override it; command-line flags and Jupyter
traitlets override both. A broken file is an error that names the file and the key, never a
silent fallback to defaults.

The package's one settings module, in three parts: `engine` (each engine setting and its parsers),
`service` (API keys and objectives) and `file` (the file, the environment, the models' own settings).
Everything else imports from here.
"""

from __future__ import annotations

from .engine import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    DEFAULT_MODELS_DIR,
    ENV_OVERRIDES,
    KIND_PARSERS,
    KV_CACHE_TYPES,
    UNQUANTIZED_CACHE_TYPES,
    ConfigError,
    EngineSettings,
    parse_keep_alive,
    parse_memory_budget,
    parse_token_count,
)
from .file import ENGINE_KEYS, MODEL_KEYS, TOP_KEYS, ModelSettings, Settings, config_path, load_settings
from .service import SLO_OBJECTIVES, ApiKey, SloSettings, parse_api_keys, parse_slo

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_MODELS_DIR",
    "ENGINE_KEYS",
    "ENV_OVERRIDES",
    "KIND_PARSERS",
    "KV_CACHE_TYPES",
    "MODEL_KEYS",
    "SLO_OBJECTIVES",
    "TOP_KEYS",
    "UNQUANTIZED_CACHE_TYPES",
    "ApiKey",
    "ConfigError",
    "EngineSettings",
    "ModelSettings",
    "Settings",
    "SloSettings",
    "config_path",
    "load_settings",
    "parse_api_keys",
    "parse_keep_alive",
    "parse_memory_budget",
    "parse_slo",
    "parse_token_count",
]
