"""Many models behind one server: load on first use, keep what fits, unload what has been idle longest.

Each resident model is an `Engine` of its own (its context, scheduler, prefix cache and streams).
A model that is not resident starts loading when a request names it; the request waits for the
load (the HTTP handlers on their event loop, without blocking it; `use` on the caller's thread)
and counts the wait in its timings. Before a load, the pool plans the
model's memory from its GGUF metadata (`memory.py`) and makes room: the least recently used idle
model is unloaded while more than `max_loaded_models` would be resident or the plan does not fit in
the memory that is free (less a reserve). A model with requests queued, running or about to be
submitted is never unloaded under them; a model idle for longer than its `keep_alive` is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from ..config import EngineSettings, Settings
from ..models.registry import ModelEntry, ModelNotFoundError, list_models, read_model_info, resolve_model
from .core import Engine, EngineError
from .memory import ContextSizing, MemoryPlan, plan_memory, resolve_settings
from .stats import EngineStats, LiveRequest, LoadWaiter
from .streams import TokenStream, UnknownStreamError

log = logging.getLogger("magnitude.pool")
MiB = 1 << 20
HOUSEKEEPING_SECONDS = 1.0
ROOM_POLL_SECONDS = 0.25  # how often a request for a model that does not fit yet looks again
ROOM_WAIT_SECONDS = 120.0  # ... before it gives up with NoRoomError


class ModelLoadError(EngineError):
    """A model could not be loaded; the message names the file and the reason."""


class NotResidentError(EngineError):
    """A model that is not loaded, asked for by one who may not load models."""


class NoRoomError(EngineError):
    """A model does not fit now: the models that would have to make room are busy."""

    retry_after = 5.0


@dataclass
class Resident:
    """A model in the pool: loading, ready, or failed (then removed at its first use)."""

    entry: ModelEntry
    engine: Engine
    plan: MemoryPlan
    keep_alive: float  # seconds idle before it unloads; negative: no time limit
    last_used: float
    load_started: float
    load_seconds: float | None = None
    users: int = 0  # requests between choosing this model and being queued by its engine
    # Requests waiting for this model's load, by id: /status lists them before its engine has them.
    load_waiters: dict[str, LoadWaiter] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        return self.users > 0 or self.engine.state == "loading" or self.engine.active_requests() > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.engine.state,
            "load_seconds": round(self.load_seconds, 3) if self.load_seconds is not None else None,
            "keep_alive": self.keep_alive,
            "idle_s": round(time.monotonic() - self.last_used, 1) if not self.busy else 0.0,
            "load_phase": self.engine.load_phase,
            # Which attention kernel runs, and whether it was set, measured, remembered or defaulted.
            "attention": {
                "flash_attention": self.engine.engine_settings.flash_attention,
                "source": self.engine.flash_attention_source,
                "reason": self.engine.flash_attention_reason,
            },
        }


def _names(entry: ModelEntry, name: str) -> bool:
    """Whether a client's `model` names this entry: its alias, its file name, or its full path."""
    return name.lower() in (entry.alias, entry.path.name.lower()) or name == str(entry.path)


class ModelPool:
    """The models a server serves, resident or not. Thread-safe; nothing here touches the event loop."""

    def __init__(
        self,
        settings: Settings,
        default_model: str | None = None,
        *,
        overrides: dict[str, Any] | None = None,
        verbose: bool = False,
        available_memory: Callable[[], int] | None = None,
    ) -> None:
        self.settings = settings
        self.overrides = overrides or {}
        self._verbose = verbose
        self._available_memory = available_memory or (lambda: int(psutil.virtual_memory().available))
        self.default_entry = resolve_model(default_model, settings)  # a bad default fails here, at start
        self.default_model = self.default_entry.alias
        self._resident: dict[str, Resident] = {}
        self._failures: dict[str, str] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        self.started_at_wall = time.time()

    @classmethod
    def serving(cls, engine: Engine) -> ModelPool:
        """A pool whose default model is an engine made elsewhere (started or not), kept loaded."""
        if engine.model_entry is None:
            raise ValueError("a pool serves models from files: this engine has none")
        pool = cls(engine.settings, str(engine.model_entry.path))
        pool.default_entry, pool.default_model = engine.model_entry, engine.model_id
        now = time.monotonic()
        plan = plan_memory(read_model_info(engine.model_entry.path), engine.engine_settings)
        pool._resident[engine.model_id] = Resident(engine.model_entry, engine, plan, -1.0, now, now)
        return pool

    # -- what may be served -----------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelEntry:
        """A registry model by alias, file name or path inside `models_dir`; None is the default.

        Clients cannot make the server open files elsewhere: a path outside `models_dir` is unknown.
        """
        if name is None:
            return self.default_entry
        with self._lock:  # most requests name a resident model: no need to list the folder
            resident = [r.entry for r in self._resident.values()]
        for entry in resident:
            if _names(entry, name):
                return entry
        entries = self.entries()
        for entry in entries:
            if _names(entry, name):
                return entry
        models_dir = self.settings.models_dir
        path = Path(name).expanduser()
        if models_dir is not None and path.suffix.lower() == ".gguf":
            candidate = (path if path.is_absolute() else models_dir / path).resolve()
            if candidate.is_file() and candidate.is_relative_to(models_dir.resolve()):
                return ModelEntry(candidate.stem.lower(), candidate, "models_dir")
        known = ", ".join(e.alias for e in entries)
        raise ModelNotFoundError(f"unknown model {name!r}; this server serves: {known}")

    def entries(self) -> list[ModelEntry]:
        """Every model this server can serve: the registry, plus the default when it is a path."""
        entries = list_models(self.settings)
        if all(e.path != self.default_entry.path for e in entries):
            entries.insert(0, self.default_entry)
        return entries

    def engine_settings_overrides(self, entry: ModelEntry) -> dict[str, Any]:
        """The server's flags (or traitlets), then the model's own entry in the config file."""
        return {**self.overrides, **self.settings.model_settings(entry.alias).engine}

    def engine_settings(self, entry: ModelEntry) -> EngineSettings:
        return replace(self.settings.engine, **self.engine_settings_overrides(entry))

    def plan(self, entry: ModelEntry) -> MemoryPlan:
        return self._sized(entry)[0]

    def _sized(self, entry: ModelEntry) -> tuple[MemoryPlan, ContextSizing | None]:
        """The model's memory plan, with `ctx_size: auto` resolved against the memory free now (and how)."""
        info = read_model_info(entry.path)
        reserve = self.settings.memory_reserve_mib * MiB
        settings, sizing = resolve_settings(info, self.engine_settings(entry), reserve, self._available_memory)
        return plan_memory(info, settings), sizing

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, load_default: bool = True) -> ModelPool:
        """Start the keep-alive housekeeping, and begin loading the default model (in the background)
        unless `load_default` is false: then it loads on the first request that needs it."""
        if load_default:
            self.checkin(self._acquire(self.default_entry, keep_alive=-1.0))  # it stays until room is needed
        if self._housekeeper is None:
            self._housekeeper = threading.Thread(target=self._housekeeping, name="magnitude-pool", daemon=True)
            self._housekeeper.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            residents = list(self._resident.values())
            self._resident.clear()
        for resident in residents:
            resident.engine.shutdown()

    def checkout(self, name: str | None, keep_alive: float | None = None, may_load: bool = True) -> Resident:
        """The model's Resident for one request, its load started if it was not resident (may unload
        idle models first: call off the event loop). It counts as busy until `checkin`. Raises
        ModelNotFoundError, ModelLoadError, or NoRoomError when busy models leave no room now; with
        `may_load` False, NotResidentError for a model that is not resident (nothing is loaded or
        unloaded)."""
        return self._acquire(self.resolve(name), keep_alive, may_load)

    def checkin(self, resident: Resident) -> None:
        with self._lock:
            resident.users -= 1
            resident.last_used = time.monotonic()

    def check_loaded(self, resident: Resident) -> None:
        """Once its engine has left "loading": raise ModelLoadError (naming the file) if the load failed,
        and forget the failed engine so that the next request tries again."""
        engine = resident.engine
        if engine.state == "failed":
            message = f"model {resident.entry.alias!r} ({resident.entry.path}) failed to load: {engine.load_error}"
            with self._lock:
                self._failures[resident.entry.alias] = message
                if self._resident.get(resident.entry.alias) is resident:
                    del self._resident[resident.entry.alias]
            raise ModelLoadError(message)
        if engine.state != "ready":
            raise EngineError(f"model {resident.entry.alias!r} is {engine.state}")
        if resident.load_seconds is None:
            resident.load_seconds = time.monotonic() - resident.load_started
            self._failures.pop(resident.entry.alias, None)

    @contextlib.contextmanager
    def use(
        self, name: str | None, keep_alive: float | None = None, timeout: float = 300.0
    ) -> Iterator[tuple[Engine, float | None]]:
        """(engine, milliseconds waited for its load or None), blocking: for callers on a thread of their
        own (the HTTP handlers do the same steps without blocking their loop). Waits up to `timeout`
        for room and for the load."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            try:
                resident = self.checkout(name, keep_alive)
                break
            except NoRoomError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(ROOM_POLL_SECONDS)
        try:
            waited = resident.engine.state == "loading"
            resident.engine.wait_ready_quietly(max(0.0, deadline - time.monotonic()))
            self.check_loaded(resident)
            yield resident.engine, ((time.monotonic() - started) * 1000 if waited else None)
        finally:
            self.checkin(resident)

    def unload(self, name: str) -> bool:
        """Unload a model now if it is idle (True); if busy, as soon as it is idle (False)."""
        entry = self.resolve(name)
        with self._lock:
            resident = self._resident.get(entry.alias)
            if resident is None:
                return True
            if resident.busy:
                resident.keep_alive = 0.0
                return False
            del self._resident[entry.alias]
        self._unload(resident, "asked to")
        return True

    def _acquire(self, entry: ModelEntry, keep_alive: float | None, may_load: bool = True) -> Resident:
        evicted: list[Resident] = []
        try:
            with self._lock:
                resident = self._resident.get(entry.alias)
                if resident is None and not may_load:
                    raise NotResidentError(f"model {entry.alias!r} is not loaded")
                if resident is None:
                    resident, evicted = self._admit(entry)
                    self._resident[entry.alias] = resident
                resident.users += 1
                resident.last_used = time.monotonic()
                if keep_alive is not None:
                    resident.keep_alive = keep_alive
        finally:
            for old in evicted:  # before the new model loads: its memory is what makes room
                self._unload(old, f"to make room for {entry.alias}")
        with self._lock:
            if resident.engine.state == "created":
                resident.engine.start(wait=False)
        return resident

    def _admit(self, entry: ModelEntry) -> tuple[Resident, list[Resident]]:
        """A new Resident for `entry` and the residents that must unload first. Lock held."""
        try:
            plan, sizing = self._sized(entry)
        except Exception as exc:  # an unreadable or broken file: say which and why
            raise self._cannot_load(entry, exc) from exc
        evicted = self._make_room(entry, plan)
        # The engine gets the cells the plan counted: sizing again after the evictions free memory
        # would give it more than the room made for it.
        sized = {"ctx_size": sizing.cells, "memory_budget": None} if sizing is not None else {}
        try:
            engine = Engine(
                entry,
                settings=self.settings,
                chat_template=self.settings.model_settings(entry.alias).chat_template,
                verbose=self._verbose,
                context_sizing=sizing,
                **{**self.engine_settings_overrides(entry), **sized},
            )
        except Exception as exc:
            for victim in evicted:
                self._resident[victim.entry.alias] = victim
            raise self._cannot_load(entry, exc) from exc
        now = time.monotonic()
        # The default model, reloaded after it made room, stays again until room is needed.
        keep_alive = -1.0 if entry.alias == self.default_model else self.settings.keep_alive
        return Resident(entry, engine, plan, keep_alive, now, now), evicted

    def _cannot_load(self, entry: ModelEntry, exc: Exception) -> ModelLoadError:
        """The error a model's requests get (and the listing shows) when its file cannot be used."""
        message = f"model {entry.alias!r} ({entry.path}) cannot be loaded: {exc}"
        self._failures[entry.alias] = message
        return ModelLoadError(message)

    def _make_room(self, entry: ModelEntry, plan: MemoryPlan) -> list[Resident]:
        """Take idle residents out, least recently used first, until `entry` fits. Lock held."""
        reserve = self.settings.memory_reserve_mib * MiB
        # Loaded models already show in what the OS calls available; loading ones do not yet.
        loading = sum(r.plan.resident for r in self._resident.values() if r.engine.state in ("created", "loading"))
        free = self._available_memory() - reserve - loading
        idle = sorted((r for r in self._resident.values() if not r.busy), key=lambda r: r.last_used)
        evicted: list[Resident] = []
        count = len(self._resident)
        while count + 1 > self.settings.max_loaded_models or plan.ceiling > free:
            if not idle:
                break
            victim = idle.pop(0)
            evicted.append(victim)
            del self._resident[victim.entry.alias]
            count -= 1
            free += victim.plan.resident
        if count + 1 <= self.settings.max_loaded_models and plan.ceiling <= free:
            return evicted
        for victim in evicted:  # nothing is unloaded for a load that cannot happen anyway
            self._resident[victim.entry.alias] = victim
        busy = ", ".join(sorted(self._resident)) or "none"
        if not self._resident or plan.ceiling > free + sum(r.plan.resident for r in self._resident.values()):
            raise ModelLoadError(
                f"model {entry.alias!r} ({entry.path}) needs {plan.ceiling / MiB:,.0f} MiB "
                f"(weights {plan.weights / MiB:,.0f}, KV cache {plan.kv_cache / MiB:,.0f}, buffers "
                f"{plan.buffers / MiB:,.0f}, prefix-cache RAM up to {plan.prefix_cache_ram / MiB:,.0f}); "
                f"{max(free, 0) / MiB:,.0f} MiB are free beyond the {reserve / MiB:,.0f} MiB reserve: "
                "lower its ctx_size or prefix_cache_ram_mib, or memory_reserve_mib"
            )
        raise NoRoomError(
            f"model {entry.alias!r} does not fit beside the busy models ({busy}; max_loaded_models "
            f"{self.settings.max_loaded_models}); it loads once one of them is idle"
        )

    def _unload(self, resident: Resident, why: str) -> None:
        log.info("unloading %s (%s)", resident.entry.alias, why)
        resident.engine.shutdown()

    def _housekeeping(self) -> None:
        while not self._stop.wait(HOUSEKEEPING_SECONDS):
            now = time.monotonic()
            expired: list[Resident] = []
            with self._lock:
                for alias, resident in list(self._resident.items()):
                    if resident.busy:
                        resident.last_used = now
                    elif resident.keep_alive >= 0 and now - resident.last_used >= resident.keep_alive:
                        expired.append(self._resident.pop(alias))
            for resident in expired:
                self._unload(resident, f"idle for {resident.keep_alive:g} s")

    # -- what the server shows ------------------------------------------------------------------

    def residents(self) -> list[Resident]:
        with self._lock:
            return list(self._resident.values())

    def resident(self, name: str | None) -> Resident | None:
        return self.held(self.resolve(name).alias)

    def held(self, alias: str) -> Resident | None:
        """The resident model of this alias, if it is resident."""
        with self._lock:
            return self._resident.get(alias)

    def status_engine(self, name: str | None = None) -> Engine | None:
        """The engine `/status` shows: the named model's, else the default's, else the most recently
        used resident; None when no model is resident."""
        if name is not None:
            found = self.resident(name)
            return found.engine if found else None
        residents = self.residents()
        for resident in residents:
            if resident.entry.alias == self.default_model:
                return resident.engine
        return max(residents, key=lambda r: r.last_used).engine if residents else None

    def unloaded_stats(self, name: str | None = None) -> EngineStats:
        """A model's figures when it is not resident: its settings, nothing running."""
        entry = self.resolve(name)
        engine = Engine(entry, settings=self.settings, **self.engine_settings_overrides(entry))
        return replace(engine.stats(), state="unloaded")

    @contextlib.contextmanager
    def waiting_for_load(self, resident: Resident, waiter: LoadWaiter | None) -> Iterator[None]:
        """While the body waits for `resident`'s load, `waiter` is listed as waiting for it."""
        if waiter is None:
            yield
            return
        with self._lock:
            resident.load_waiters[waiter.id] = waiter
        try:
            yield
        finally:
            with self._lock:
                resident.load_waiters.pop(waiter.id, None)

    def load_waiters(self, model_id: str) -> list[LiveRequest]:
        """The requests waiting for this model's load (none when it is not loading), oldest first."""
        now = time.monotonic()
        with self._lock:
            resident = next((r for r in self._resident.values() if r.engine.model_id == model_id), None)
            waiters = list(resident.load_waiters.values()) if resident is not None else []
        return [w.live(now) for w in sorted(waiters, key=lambda w: w.since)]

    def failure(self, alias: str) -> str | None:
        return self._failures.get(alias)

    def find_stream(self, stream_id: str) -> tuple[Engine, TokenStream]:
        """The engine that made a stream, and the stream (UnknownStreamError if none did)."""
        for resident in self.residents():
            with contextlib.suppress(UnknownStreamError):
                return resident.engine, resident.engine.streams.get(stream_id)
        raise UnknownStreamError(f"no stream {stream_id!r} (unknown, or its model was unloaded)")
