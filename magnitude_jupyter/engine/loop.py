"""The engine thread's half of `Engine`: loading the model, then the step loop (schedule, start the
admitted requests, decode, write the answers), cancels and housekeeping between steps, and what a
failed step ends. `Engine` (core.py) holds the state and the thread-safe API around it; only the
engine thread runs these methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..config import EngineSettings
from ..models.registry import ModelInfo
from .answers import AnswerWriter, step_chunks
from .compaction import CompactionFailed, compact_if_due
from .draft_policy import measure_step_costs
from .kv_ops import KVOp
from .memory import cache_sequences, plan_kv, shares_sequences
from .metrics import EngineMetrics
from .plan import DecodeItem, SchedulerOutput
from .request import FinishReason, Request
from .runner_api import Runner, Sampled, apply_kv_ops
from .scheduler import Scheduler
from .stats import FinishedRequest
from .step import execute_plan
from .streams import StreamRegistry
from .threads import ThreadGovernor

log = logging.getLogger(__name__)


class EngineLoop:
    """Mixed into `Engine`, whose constructor sets every attribute named here."""

    if TYPE_CHECKING:
        engine_settings: EngineSettings
        model_id: str
        state: str
        load_error: str | None
        runner: Runner | None
        scheduler: Scheduler | None
        governor: ThreadGovernor | None
        metrics: EngineMetrics
        streams: StreamRegistry
        flash_attention_reason: str | None
        flash_attention_source: str | None
        _runner_factory: Callable[[EngineSettings], Runner]
        _threads: int
        _ready: threading.Event
        _lock: threading.Condition
        _stop: bool
        _cancels: deque[tuple[str, FinishReason, str | None]]
        _requests: dict[str, Request]
        _recent: deque[FinishedRequest]
        _writer: AnswerWriter | None
        model_info: ModelInfo | None

        @property
        def _windowed(self) -> bool: ...

        def _set_load_phase(self, phase: str) -> None: ...

        def _notify_step(self) -> None: ...

    def _run(self) -> None:
        try:
            self.runner = self._runner_factory(self.engine_settings)
            trained = (self.runner.n_ctx_train if self.runner is not None else 0) or None
            if self.engine_settings.repack is None and self.runner.repack is not None:
                # What it runs with, as ctx_size auto is shown resolved (/v1/models).
                self.engine_settings = replace(self.engine_settings, repack=self.runner.repack)
            if self.engine_settings.flash_attention is None and self.runner.flash_attention is not None:
                self.engine_settings = replace(self.engine_settings, flash_attention=self.runner.flash_attention)
            self.flash_attention_reason = self.runner.flash_attention_reason
            self.flash_attention_source = getattr(self.runner, "flash_attention_source", None)
            if self.runner.recurrent and (self.engine_settings.prefix_reuse or self.engine_settings.draft_tokens):
                # A recurrent state holds a whole sequence: it cannot be copied or cut at a position.
                log.warning(
                    "%s: a recurrent or hybrid model (not covered, docs/models.md): prefix reuse and drafts are off",
                    self.model_id,
                )
                self.engine_settings = replace(self.engine_settings, prefix_reuse=False, draft_tokens=0)
            es = self.engine_settings
            # threads: 0 (the default) follows what other processes leave free; a number is fixed.
            self.governor = ThreadGovernor(es.n_threads) if es.threads == 0 else None
            self._threads = es.n_threads  # what llama.cpp uses now
            self.scheduler = Scheduler(
                ctx_size=min(self.runner.n_ctx, es.cells),
                max_running=es.parallel,
                n_batch=es.n_batch,
                max_waiting=es.max_waiting,
                trained_context=trained,
                prefix_reuse=es.prefix_reuse,
                min_prefix_tokens=es.min_prefix_tokens,
                cache_sequences=cache_sequences(es),
                cache_ram_bytes=es.prefix_cache_ram_mib << 20,
                cache_spill_rows=es.prefix_cache_spill_rows,
                cache_bytes_per_token=self._saved_bytes_per_token(es),
                spell=self.runner.token_to_piece,
                draft_tokens=es.draft_tokens,
                draft_max_sequences=es.draft_max_sequences,
                admission=es.admission,
                sliding_window=self.runner.sliding_window,
                sequence_start=self.runner.sequence_start,
                shared_sequences=shares_sequences(self._windowed, es),
            )
            if self.scheduler.drafts is not None:
                self._set_load_phase("timing draft steps")
                try:
                    self.scheduler.drafts.cost = measure_step_costs(
                        scratch_steps(self.runner), self.scheduler.drafts.max_draft + 1
                    )
                finally:
                    self.runner.drop_cells(0, 0, -1)
            if trained and es.cells > trained:
                # Said at start-up, never discovered by a request (docs/configuration.md, ctx_size).
                log.warning(
                    "%s: ctx_size %d is above the %d tokens this model was trained on: one request holds at "
                    "most %d tokens (the cells hold several requests at once)",
                    self.model_id,
                    es.cells,
                    trained,
                    trained,
                )
        except Exception as exc:  # reported through state/load_error, and to wait_ready()
            log.exception("model load failed")
            self.load_error = str(exc)
            self.state = "failed"
            self._ready.set()
            return
        self._writer = AnswerWriter(
            self.runner, self.scheduler, self.metrics, self._recent, self._lock, self._notify_step
        )
        self._set_load_phase("ready")
        self.state = "ready"
        self._ready.set()
        try:
            self._loop()
        finally:
            self._abort_all("the engine shut down")
            self._notify_step()
            self.runner.close()
            self.state = "stopped"

    def _loop(self) -> None:
        assert self.runner is not None and self.scheduler is not None
        runner, scheduler, governor = self.runner, self.scheduler, self.governor
        next_housekeeping = 0.0
        while True:
            if governor is not None:
                threads = governor.update(time.monotonic())
                if threads is not None:
                    runner.set_threads(threads)
                    self._threads = threads
            with self._lock:
                now = time.monotonic()
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    next_housekeeping = now + 0.25
                to_end, cancelled = self._apply_cancels()
                if self._stop:
                    break
                # Cleared under the lock, so that status() never counts cells a cancel has given back.
                self._end_sequences(runner, to_end)
                out = scheduler.schedule(now)
                if out.empty and not cancelled and not out.kv_ops:
                    self._lock.wait(timeout=0.25)
            if out.empty:
                # The cache may have moved entries with nothing to decode (saved ones back from the RAM
                # tier, or evictions for a request that still did not fit): the tree has already handed
                # their sequence ids out again, so their cells must go now, not with a later step.
                try:
                    self._apply_kv_ops(runner, out.kv_ops)
                except Exception:  # as a failed step: logged, and the engine goes on serving
                    log.exception("prefix cache operations failed")
                    with self._lock:
                        if not scheduler.running:  # no request shares its cells
                            self._apply_kv_ops(runner, scheduler.reset_cache())
                if cancelled:
                    self._notify_step()
                continue
            step_started = time.perf_counter()
            try:
                self._apply_kv_ops(runner, out.kv_ops)
                self._start_admitted(runner, out)
                order = [chunk.request.seq_id for chunk in out.batched if chunk.request.seq_id is not None]
                compact_if_due(runner, self.metrics, out.places_prompt, order)
                sampled = self._execute(runner, out)
            except Exception as exc:
                log.exception("decode failed")
                self._fail_step(out, f"decode failed: {exc}")
                if isinstance(exc, CompactionFailed):  # the cache's entries lost their cells too
                    with self._lock:
                        if not scheduler.running:
                            self._apply_kv_ops(runner, scheduler.reset_cache())
                self._notify_step()
                continue
            with self._lock:
                self._end_sequences(runner, self._answers().update(out, sampled))
                # Under the lock: a caller woken by this step's last event reads stats() after it.
                self.metrics.record_step_time(time.perf_counter() - step_started)
            self._notify_step()

    def _start_admitted(self, runner: Runner, out: SchedulerOutput) -> None:
        """Start the sequences of the requests the step admits. One that llama.cpp refuses (a lane it
        cannot allocate, a grammar it cannot parse) ends with its own error, and the step goes on
        without it: the requests beside it lose nothing."""
        refused: list[tuple[Request, str]] = []
        for request in out.admitted:
            assert request.seq_id is not None
            try:
                if request.preemptions:  # resumed: its sampler (and a lane's cells) as they were
                    state, request.suspended_state = request.suspended_state, None
                    runner.resume_sequence(request.seq_id, request.request_id, state, request.kv_cells)
                else:
                    runner.start_sequence(request.seq_id, request.params, request.prompt_tokens, request.kv_cells)
            except Exception as exc:
                log.exception("could not start request %s", request.request_id)
                refused.append((request, f"could not start the request: {exc}"))
        if not refused:
            return
        with self._lock:
            ended = [self._answers().finish(request, FinishReason.ERROR, error=error) for request, error in refused]
            self._end_sequences(runner, [seq_id for seq_id in ended if seq_id is not None])
        gone = {id(request) for request, _ in refused}
        out.batched = [chunk for chunk in out.batched if id(chunk.request) not in gone]
        out.solo = [chunk for chunk in out.solo if id(chunk.request) not in gone]

    def _saved_bytes_per_token(self, es: EngineSettings) -> float:
        """What a sequence saved to the RAM tier takes per token at most (every layer's cell), so an
        entry it could not hold is never moved out; 0 when the model's file says nothing (a runner
        made otherwise): the first state saved tells."""
        if self.model_info is None or not isinstance(es.ctx_size, int):
            return 0.0
        layout = plan_kv(self.model_info, es)
        return layout.global_bytes_per_token + layout.window_bytes_per_token

    def _apply_kv_ops(self, runner: Runner, ops: list[KVOp]) -> None:
        cache = self.scheduler.cache if self.scheduler is not None else None
        apply_kv_ops(runner, ops, cache.ram if cache is not None else None)

    def _end_sequences(self, runner: Runner, seq_ids: list[int]) -> None:
        """Clear finished sequences, after the scheduler has kept what it wants of them (the prefix slot)."""
        assert self.scheduler is not None
        self._apply_kv_ops(runner, self.scheduler.take_pending_kv_ops())
        for seq_id in seq_ids:
            runner.end_sequence(seq_id)

    def _execute(self, runner: Runner, out: SchedulerOutput) -> list[list[Sampled]]:
        solo_one_thread = self._threads > 1 and self.engine_settings.uses_flash_attention
        threads = self._threads if solo_one_thread else None
        return execute_plan(runner, out, self.metrics, threads, lambda: self._make_room(runner))

    def _make_room(self, runner: Runner) -> bool:
        """llama.cpp found no cells for a step: the cache gives back every entry no request runs on
        (saved to the RAM tier), and the step runs again. Whether anything was given back."""
        assert self.scheduler is not None
        with self._lock:
            ops = self.scheduler.release_idle_cache()
        log.warning("llama.cpp found no KV cells for a step: %d cache operations free idle entries", len(ops))
        self._apply_kv_ops(runner, ops)
        return bool(ops)

    def _answers(self) -> AnswerWriter:
        assert self._writer is not None
        return self._writer

    def _apply_cancels(self) -> tuple[list[int], bool]:
        """Finish the queued cancels: the sequence ids to clear, and whether any request ended."""
        ended, any_finished = [], False
        while self._cancels:
            request_id, reason, error = self._cancels.popleft()
            request = self._requests.get(request_id)
            if request is not None and not request.is_finished:
                seq_id = self._answers().finish(request, reason, error=error)
                any_finished = True
                if seq_id is not None:
                    ended.append(seq_id)
        return ended, any_finished

    def _housekeeping(self, now: float) -> None:
        """Cancel requests nobody reads any more, and forget old finished streams. Lock held."""
        es = self.engine_settings
        for request_id in self.streams.abandoned(now, es.grace_seconds):
            self._cancels.append((request_id, FinishReason.CANCELLED, "no reader re-attached within the grace period"))
        for request_id in self.streams.drop_expired(now, es.retention_seconds):
            self._requests.pop(request_id, None)

    def _fail_step(self, out: SchedulerOutput, error: str) -> None:
        assert self.runner is not None
        with self._lock:
            ended = [self._answers().finish(c.request, FinishReason.ERROR, error=error) for c in step_chunks(out)]
            self._end_sequences(self.runner, [seq_id for seq_id in ended if seq_id is not None])

    def _abort_all(self, error: str) -> None:
        with self._lock:
            for request in list(self._requests.values()):
                if not request.is_finished and self._writer is not None:
                    self._answers().finish(request, FinishReason.CANCELLED, error=error)


SCRATCH_PROMPT = 16  # tokens the scratch sequence holds before its timed steps


def scratch_steps(runner: Runner) -> Callable[[int], None]:
    """Decode steps of n rows after a short prompt, each row a logits row as a draft's are, on
    sequence 0 before any request holds it: the draft policy's step costs, timed at load. Each
    step's cells are dropped after it; the caller drops the prompt's."""
    token = [0]  # any token: only the time counts
    runner.decode([DecodeItem(0, token * SCRATCH_PROMPT, 0, False)])

    def decode(n: int) -> None:
        runner.decode([DecodeItem(0, token * n, SCRATCH_PROMPT, True, draft=n - 1)])
        runner.drop_cells(0, SCRATCH_PROMPT, -1)

    return decode
