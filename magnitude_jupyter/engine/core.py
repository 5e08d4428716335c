"""The engine: a step loop on its own thread (loop.py), and the thread-safe API around it.

    submit() ──▶ Scheduler.add_request ─┐
                                        ▼
    step loop:  schedule() ─▶ runner.decode + sample ─▶ answers.py: text, stops, streams, finishes
                                        │
    stream(id, after=N) ◀── TokenStream ┘

Submitters, cancellers and readers never touch the llama.cpp context: the loop thread makes every
decode, sampler and KV-cache call. `submit` does read the model's vocabulary (tokenizing, checking
a grammar), which is immutable once loaded and safe from any thread, as llama.cpp's own server
tokenizes on its HTTP threads; it is CPU work all the same, so async hosts call it from a worker
thread, never from their event loop. Submitters take the engine lock only for a moment (the
scheduler's queues). Cancels are queued and applied between steps, never mid-step.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..config import EngineSettings, Settings, load_settings
from ..models.chat_formats import ChatFormat
from ..models.registry import ModelEntry, ModelInfo, read_model_info, resolve_model
from ..token_counts import TokenCounts
from .admission_errors import PromptTooLongError
from .answers import AnswerWriter
from .gbnf_limits import start_with_grammar_stack
from .loop import EngineLoop
from .memory import (
    ContextSizing,
    context_sequences,
    is_windowed,
    plan_kv,
    resolve_settings,
)
from .metrics import EngineMetrics, StepCounts
from .plan import SchedulerStats
from .prepare import prepare_params
from .reasoning import ReasoningSplitter, Thinking, prompt_opens_thinking, reasoning_tags
from .request import FinishReason, Priority, Request, SamplingParams, prompt_head
from .runner_api import (
    EMBED_CTX,
    MAX_CHARS_PER_TOKEN,
    EmbeddingCancelled,
    EmbeddingError,
    Runner,
    chat_prompt,
    chat_prompt_tokens,
)
from .scheduler import Scheduler
from .stats import EngineStats, FinishedRequest, LiveRequest, rss_bytes
from .streams import StreamEvent, StreamRegistry
from .text import TextAssembler
from .threads import ThreadGovernor
from .tools import ToolRequest

UNREAD_RELEASE_S = 1.0  # an answer unread this long is released when a reader would be shed
log = logging.getLogger(__name__)


def cold_wait_s(tokens_left: list[int], whole_answer: int, ahead: int, steps: StepCounts) -> float | None:
    """The slot wait of `predicted_wait_s` before any request has finished: the running answers free
    their slots after the tokens they likely have left (ascending), each a step of the mean step time
    so far; a request further back waits for answers of `whole_answer` tokens shared over the slots."""
    if not tokens_left or steps.decode_calls == 0:
        return None
    step_s = steps.step_seconds / steps.decode_calls
    slots = len(tokens_left)
    if ahead < slots:
        return tokens_left[ahead] * step_s
    return (tokens_left[-1] + (ahead - slots + 1) * whole_answer / slots) * step_s


class EngineError(RuntimeError):
    """The engine cannot take this call now (not loaded, failed to load, or shut down)."""


@dataclass
class GenerationResult:
    request_id: str
    text: str
    finish_reason: str
    counts: TokenCounts
    timings: dict[str, Any]
    token_ids: list[int]
    error: str | None = None
    reasoning: str = ""  # a thinking model's reasoning, apart from `text`


RATE_WINDOW_S = 30.0  # the recent past the departure rate of predicted_wait_s is measured over


class Engine(EngineLoop):
    """Serve one GGUF model to many concurrent requests.

    >>> with Engine() as engine:                       # the bundled model, settings from config
    ...     engine.generate(prompt="Hi", params=SamplingParams(max_tokens=8, temperature=0)).text
    """

    def __init__(
        self,
        model: str | ModelEntry | None = None,
        *,
        settings: Settings | None = None,
        runner_factory: Callable[[EngineSettings], Runner] | None = None,
        chat_template: str | None = None,
        verbose: bool = False,
        context_sizing: ContextSizing | None = None,
        **engine_overrides: Any,
    ) -> None:
        """`model`: an alias, a path, or a registry entry (the pool's, under its alias); `context_sizing`:
        how a caller that sized `ctx_size` from memory did it (shown in /status)."""
        self.settings = settings or load_settings()
        self.engine_settings = replace(self.settings.engine, **engine_overrides)
        self.model_entry: ModelEntry | None = None
        self.model_info: ModelInfo | None = None
        self.context_sizing: ContextSizing | None = context_sizing
        if runner_factory is None:
            self.model_entry = model if isinstance(model, ModelEntry) else resolve_model(model, self.settings)
            self.model_info = read_model_info(self.model_entry.path)
            runner_factory = self._llama_runner_factory
            self.engine_settings, sizing = resolve_settings(
                self.model_info, self.engine_settings, self.settings.memory_reserve_mib << 20
            )
            self.context_sizing = sizing or context_sizing
            if self.context_sizing is not None:
                log.info("%s: %s", self.model_entry.alias, self.context_sizing.reason)
        self._runner_factory = runner_factory
        # The format chats are served in: a config's template, the file's, or its family's (chat_formats.py).
        self.chat_format: ChatFormat | None = self.model_info.chat_format(chat_template) if self.model_info else None
        if self.chat_format is not None and self.chat_format.warning and self.model_entry is not None:
            log.warning("%s: %s", self.model_entry.alias, self.chat_format.warning)
        self._chat_template = self.chat_format.template if self.chat_format is not None else chat_template
        self._reasoning = reasoning_tags(self._chat_template)  # how its answers mark reasoning (reasoning.py)
        self.model_id = self.model_entry.alias if self.model_entry else (str(model) if model else "fake")
        self._verbose = verbose

        self.state = "created"  # created → loading → ready → stopping → stopped, or failed
        self.load_error: str | None = None
        self._ready = threading.Event()
        self._lock = threading.Condition()
        self._cancels: deque[tuple[str, FinishReason, str | None]] = deque()
        self._requests: dict[str, Request] = {}
        self.streams = StreamRegistry(max_retained_events=self.engine_settings.max_retained_events)
        self.metrics = EngineMetrics()
        self.runner: Runner | None = None
        self.scheduler: Scheduler | None = None
        self.governor: ThreadGovernor | None = None
        self._threads = self.engine_settings.n_threads
        self._thread: threading.Thread | None = None
        self._stop = False
        self._step_listeners: list[Callable[[], None]] = []
        self._writer: AnswerWriter | None = None  # made with the scheduler, at load
        self._sha256: str | None = None
        self.flash_attention_reason: str | None = None  # how the attention kernel was chosen
        self.flash_attention_source: str | None = None  # set | measured | remembered | default
        self.load_phase: str | None = None  # what the load is doing now, for whoever waits on it
        self.load_phase_changes = 0  # how many times it changed: progress, for a waiter that polls
        self._recent: deque[FinishedRequest] = deque(maxlen=20)
        self._started_at = time.monotonic()
        self.started_at_wall = time.time()

    def _llama_runner_factory(self, es: EngineSettings) -> Runner:
        from .runner import LlamaRunner

        assert self.model_entry is not None
        return LlamaRunner(
            self.model_entry.path,
            n_ctx=es.cells,
            n_seq_max=context_sequences(es, self._windowed),
            n_batch=es.n_batch,
            n_ubatch=es.n_ubatch,
            n_threads=es.n_threads,
            gpu_layers=es.gpu_layers,
            cache_types=es.kv_types,
            mlock=es.mlock,
            mmap=es.mmap,
            repack=es.repack,
            flash_attention=es.flash_attention_choice,
            verbose=self._verbose,
            stop_tokens=self._stop_token_ids(),
            full_windows=es.swa_full,
            on_phase=self._set_load_phase,
        )

    @property
    def _windowed(self) -> bool:
        """A model with sliding-window layers, as its file says (the context and the scheduler agree on
        how many sequence ids there are from this one reading); a runner made otherwise says itself."""
        if self.model_info is not None:
            return is_windowed(self.model_info)
        return self.runner is not None and bool(self.runner.sliding_window)

    def _set_load_phase(self, phase: str) -> None:
        if phase != self.load_phase:
            self.load_phase = phase
            self.load_phase_changes += 1

    def _stop_token_ids(self) -> frozenset[int]:
        """The ids of the chat format's turn ends (the GGUF reader noted where they are)."""
        if self.chat_format is None or self.model_info is None:
            return frozenset()
        return frozenset(self.model_info.vocab_markers[t] for t in self.chat_format.stop_tokens)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, wait: bool = True, timeout: float | None = 300) -> Engine:
        """Load the model on the engine thread (in the background unless `wait`) and start stepping."""
        if self._thread is not None:
            return self
        self.state = "loading"
        self._thread = threading.Thread(target=self._run, name="magnitude-engine", daemon=True)
        start_with_grammar_stack(self._thread)  # it samples through grammars
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise EngineError(f"the model did not load within {timeout} s")
        if self.state == "failed":
            raise EngineError(f"the model failed to load: {self.load_error}")

    def wait_ready_quietly(self, timeout: float | None = None) -> bool:
        """Wait until the load has ended, well or not (the caller reads `state`); False on timeout."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel what is queued or running, free the context."""
        with self._lock:
            if self.state in ("stopped", "created"):
                self.state = "stopped"
                return
            self._stop = True
            self.state = "stopping"
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the API ---------------------------------------------------------------------------

    def _require_ready(self) -> tuple[Runner, Scheduler]:
        if self.state != "ready" or self.runner is None or self.scheduler is None:
            if self.state == "failed":
                raise EngineError(f"the model failed to load: {self.load_error}")
            raise EngineError(f"the engine is {self.state}, not ready")
        return self.runner, self.scheduler

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        runner, _ = self._require_ready()
        return runner.tokenize(text, add_special=add_special)

    def prompt_tokens_for(
        self, prompt: str | None = None, messages: Any = None, tools: ToolRequest | None = None
    ) -> list[int]:
        """Tokens of a plain prompt, or of chat messages rendered through the model's template."""
        runner, _ = self._require_ready()
        if messages is not None:
            return chat_prompt_tokens(
                runner, messages, self._chat_template, tools, self.engine_settings.control_tokens_in_messages
            )
        if prompt is None:
            raise ValueError("give a prompt or messages")
        return runner.tokenize(prompt, add_special=True)

    def _cache_scope(self, cache_salt: str | None, user: str | None, tenant: str | None = None) -> str | None:
        """A request's prefix-cache scope: its tenant's (one per API key, where there are several),
        narrowed by its salt, or by its user with `prefix_cache_scope: user`."""
        own = f"tenant:{tenant}|" if tenant is not None else ""
        if cache_salt is not None:
            return own + "salt:" + cache_salt
        if user is not None and self.engine_settings.prefix_cache_scope == "user":
            return own + "user:" + user
        return own or None

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: Any = None,
        prompt_tokens: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: Priority | str = Priority.INTERACTIVE,
        request_id: str | None = None,
        arrival_time: float | None = None,
        load_ms: float | None = None,
        tools: ToolRequest | None = None,
        cache_salt: str | None = None,
        user: str | None = None,
        thinking: Thinking | None = None,
        origin: str | None = None,
        tenant: str | None = None,
    ) -> Request:
        """Queue one generation; returns at once. Raises ValueError (bad input), PromptTooLongError,
        OverloadedError or EngineError; never blocks on the model. `arrival_time` (monotonic) and
        `load_ms` let a request that waited for its model to load count that wait in its timings.
        `cache_salt` keeps its prefix-cache entries apart from every other salt's; with the setting
        `prefix_cache_scope: user`, `user` does the same when no salt is given. `max_tokens` is a
        cap, not a demand: past the context, the answer ends with "length" where the context does;
        a prompt that alone does not fit is a PromptTooLongError. `thinking`: for a model whose
        template thinks, whether its reasoning comes apart from the answer, and thinking on or off."""
        runner, scheduler = self._require_ready()
        params, tool_form, check = prepare_params(runner, params, messages, tools, self._chat_template)
        thinking = thinking or Thinking()
        splitter = None
        if prompt_tokens is not None:
            tokens = list(prompt_tokens)
        elif messages is not None:
            tokens, text = chat_prompt(
                runner,
                messages,
                self._chat_template,
                tools,
                thinking.enabled,
                control_in_messages=self.engine_settings.control_tokens_in_messages,
            )
            if self._reasoning is not None:
                inside = prompt_opens_thinking(text, self._reasoning)
                splitter = ReasoningSplitter(inside=inside, tags=self._reasoning, inline=not thinking.split)
        else:
            tokens = self.prompt_tokens_for(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        room = scheduler.max_request_tokens - len(tokens)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt is {len(tokens)} tokens, but this model's context holds "
                f"{scheduler.max_request_tokens}: shorten the prompt or conversation, or serve a model "
                "with a longer context"
            )
        wanted = params.max_tokens if params.max_tokens is not None else self.engine_settings.default_max_tokens
        max_tokens = min(wanted, room)  # see docs/decisions.md, "max_tokens is a cap"
        request = Request(
            request_id=request_id or f"cmpl-{uuid.uuid4().hex[:24]}",
            prompt_tokens=tokens,
            params=params,
            max_tokens=max_tokens,
            priority=Priority.parse(priority),
            text=TextAssembler(params.stop),
            load_ms=load_ms,
            tool_form=tool_form,
            answer_check=check,
            cache_scope=self._cache_scope(cache_salt, user, tenant),
            tenant=tenant,
            client=user,
            origin=origin,
            prompt_head=prompt_head(prompt, messages),
            reasoning=splitter,
            thinking_budget=thinking.budget_tokens if splitter is not None else None,
            continues_conversation=isinstance(messages, list)
            and any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages),
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        with self._lock:
            if self._stop:
                raise EngineError("the engine is shutting down")
            scheduler.add_request(request)
            request.stream = self.streams.create(request.request_id)
            self._requests[request.request_id] = request
            self._lock.notify_all()
        return request

    def predicted_wait_s(self, priority: Priority | str = Priority.INTERACTIVE) -> float | None:
        """How long a new request of `priority` would wait for its first token: for a slot, from the
        queue ahead of it and the rate requests have finished at lately, then for its prompt, as
        long as the slowest tenth of recent prompts took. Before anything has finished (a burst on a
        cold server) the slot wait comes from the running answers instead: the tokens each likely has
        left (the admission estimate) at the mean step time so far. None when it would start now (a
        free slot and nobody waiting) or nothing has run to measure by. Batch requests wait behind
        every interactive one, so only interactive requests are predicted (slo.py sheds by it)."""
        if Priority.parse(priority) is not Priority.INTERACTIVE:
            return None
        now = time.monotonic()
        span = min(RATE_WINDOW_S, max(1e-3, now - self._started_at))
        done = [f for f in self.metrics.finished_since(now - span) if f.outcome in ("stop", "length")]
        with self._lock:
            sched = self.scheduler
            if sched is None:
                return None
            ending = {request_id for request_id, _, _ in self._cancels}  # cancelled, not yet taken out
            ahead = sum(1 for r in sched.waiting[Priority.INTERACTIVE] if r.request_id not in ending)
            running = [r for r in sched.running if r.request_id not in ending]
            if ahead == 0 and len(running) < sched.max_running:
                return None
            if not done:  # the running answers' likely tokens left: only a cold server needs them
                left = sorted(
                    max(1, sched.lengths.estimate(r.priority, r.client, r.max_tokens) - len(r.output_tokens))
                    for r in running
                )
                whole = sched.lengths.estimate(Priority.INTERACTIVE, None, sched.ctx_size)
        if not done:
            return cold_wait_s(left, whole, ahead, self.metrics.step_counts())
        prompts = sorted(f.prompt_s for f in done if f.prompt_s is not None)
        prompt = prompts[int(0.9 * (len(prompts) - 1))] if prompts else 0.0
        return (ahead + 1) / (len(done) / span) + prompt

    @property
    def context_length(self) -> int | None:
        """The most tokens one request may hold (prompt and answer): the cells, and no more than the
        model was trained on; None before the model is loaded."""
        return self.scheduler.max_request_tokens if self.scheduler is not None else None

    def release_unread(self, unread_for_s: float = UNREAD_RELEASE_S) -> int:
        """Cancel every answer nobody has read for `unread_for_s` (its client left; the grace period
        would keep it running), so that it holds no slot against answers somebody reads; how many.
        The shedding check calls it before it would shed a reader (slo.check_shed)."""
        now = time.monotonic()
        with self._lock:
            unread = self.streams.abandoned(now, unread_for_s)
            pending = {request_id for request_id, _, _ in self._cancels}
            released = [request_id for request_id in unread if request_id not in pending]
            for request_id in released:
                why = "nobody read the answer, and a client that reads needed the slot"
                self._cancels.append((request_id, FinishReason.CANCELLED, why))
            if released:
                self._lock.notify_all()
        if released:
            log.info("released %d answers nobody reads, for requests that would have been shed", len(released))
        return len(released)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant a request came with (None: the server's one client); a KeyError if unknown."""
        with self._lock:
            request = self._requests.get(request_id)
        if request is None:
            raise KeyError(request_id)
        return request.tenant

    def cancel(self, request_id: str, why: str | None = None) -> bool:
        """Cancel a queued or running request; its KV cells are freed before the next step."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.is_finished:
                return False
            self._cancels.append((request_id, FinishReason.CANCELLED, why))
            self._lock.notify_all()
            return True

    def model_sha256(self) -> str | None:
        """The model file's SHA-256 (computed once, on first use: it reads the whole file)."""
        if self.model_entry is None:
            return None
        if self._sha256 is None:
            from ..models.registry import file_sha256

            self._sha256 = file_sha256(self.model_entry.path)
        return self._sha256

    def add_step_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs on the engine thread after every step that produced events.

        Async hosts use it to wake all their readers once per step, rather than once per token per
        stream: on a small machine every wakeup during a decode takes a core from llama.cpp.
        """
        with self._lock:
            self._step_listeners.append(callback)

    def _notify_step(self) -> None:
        with self._lock:
            listeners = list(self._step_listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # a broken host must never stop the engine thread
                log.exception("step listener failed")

    def active_requests(self) -> int:
        """Requests queued or running now."""
        with self._lock:
            return sum(1 for request in self._requests.values() if not request.is_finished)

    def get_request(self, request_id: str) -> Request | None:
        with self._lock:
            return self._requests.get(request_id)

    def stream(self, request_id: str, after: int = 0, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Every event of a request after event id `after`, then the live rest (blocking iterator)."""
        return self.streams.get(request_id).read(after, timeout)

    def embed(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], stop: threading.Event | None = None
    ) -> tuple[list[np.ndarray], int]:
        """Unit vectors for texts or token lists, in order, and the tokens they took; on the caller's
        thread, beside generation (embeddings.py). Raises EmbeddingError naming a bad input (a text too
        long is refused before it is tokenized), EmbeddingCancelled once `stop` is set."""
        runner, _ = self._require_ready()
        longest = EMBED_CTX * MAX_CHARS_PER_TOKEN
        for i, x in enumerate(inputs):
            if isinstance(x, str) and len(x) > longest:
                raise EmbeddingError(
                    f"input {i} is {len(x):,} characters; one input holds at most {EMBED_CTX} tokens, "
                    f"and a text over {longest:,} characters is refused before tokenizing"
                )
        token_lists = []
        for x in inputs:
            if stop is not None and stop.is_set():
                raise EmbeddingCancelled("the client went away")
            token_lists.append(runner.tokenize(x, add_special=True) if isinstance(x, str) else list(x))
        return runner.embed(token_lists, stop), sum(map(len, token_lists))

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        """Submit and wait for the whole answer (woken once at the end, not on every token)."""
        request = self.submit(prompt, **kwargs)
        assert request.stream is not None
        final = request.stream.wait_final(timeout)
        return GenerationResult(
            request_id=request.request_id,
            text=request.output_text,
            finish_reason=final.finish_reason or "error",
            counts=final.counts or TokenCounts(0, 0, 0),
            timings=final.timings or {},
            token_ids=list(request.output_tokens),
            error=final.error,
            reasoning=request.output_reasoning,
        )

    def stats(self) -> EngineStats:
        """A consistent snapshot of the engine, for /status, /metrics and calibration."""
        es = self.engine_settings
        with self._lock:
            sched = self.scheduler
            now = time.monotonic()
            if sched is not None:
                scheduler = sched.make_stats()
                live_requests = [*sched.running, *(r for q in sched.waiting.values() for r in q)]
                drafts = sched.drafts.snapshot() if sched.drafts is not None else None
            else:
                scheduler = SchedulerStats(0, 0, es.cells, 0, 0, 0, 0, 0, 0, 0, 0, 0, admission=es.admission)
                live_requests = []
                drafts = None
            live = tuple(LiveRequest.of(r, now) for r in live_requests)
            recent = tuple(self._recent)
        info = self.model_info
        layout = plan_kv(info, es) if info and isinstance(es.ctx_size, int) else None
        return EngineStats(
            model=self.model_id,
            state=self.state,
            error=self.load_error,
            parallel=es.parallel,
            threads=self._threads,
            trained_context=info.trained_context if info else None,
            default_max_tokens=es.default_max_tokens,
            scheduler=scheduler,
            kv_bytes_per_token=layout.bytes_per_cell if layout else None,
            kv_bytes_planned=layout.bytes if layout else None,
            kv_window=layout.window_json() if layout else None,
            kv_cache_type=es.kv_type_label,
            flash_attention=es.uses_flash_attention,
            flash_attention_reason=self.flash_attention_reason,
            flash_attention_source=self.flash_attention_source,
            load_phase=self.load_phase,
            context_sizing=self.context_sizing.reason if self.context_sizing else None,
            kv_buffer_bytes_reported=self.runner.kv_buffer_bytes if self.runner is not None else None,
            rss_bytes=rss_bytes(),
            recent_tokens_per_s=round(self.metrics.recent_tokens_per_s(), 2),
            generated_tokens_total=self.metrics.generation_tokens_total,
            draft_tokens_total=self.metrics.draft_tokens_total,
            draft_accepted_total=self.metrics.draft_accepted_total,
            drafts=drafts,
            steps=self.metrics.step_counts(),
            uptime_s=round(now - self._started_at, 1),
            live=live,
            recent=recent,
        )
