"""Admission by KV-cache budget and the plan for one engine step.

`schedule()` decides what runs this step; the engine core executes the plan on the runner and
reports back through `advance()` and `finish()`. Every method runs on the engine thread,
except `add_request`, which the core calls under its lock so that submitters get
`PromptTooLongError` / `OverloadedError` synchronously.

A request reserves `prompt_tokens + max_tokens` cells when admitted, so a running request can
always finish: there is no preemption, and no request is ever cut short for lack of cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .budget import KVBudget
from .prefix import ClearSequence, KVOp, PrefixCopy, PrefixSlot, common_prefix_len
from .request import FinishReason, Priority, Request, RequestStatus

SLOT_KEY = "<prefix slot>"  # the retained prefix's entry in the KV budget

# llama.cpp's CPU flash attention runs prompt chunks of 64 tokens or more in KV tiles, grouping a
# sequence's cells by where they sit in the shared cache; below that it visits them one by one, in
# order, and the result depends on nothing else in the cache. Reproducible prompts go in such chunks.
REPRODUCIBLE_CHUNK = 63


class PromptTooLongError(ValueError):
    """The request could never fit: the message states the numbers."""


class OverloadedError(RuntimeError):
    """The waiting queue is full; try again later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class DecodeItem:
    """What the runner sees of a chunk: a sequence id, tokens and where they go."""

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    want_logits: bool


@dataclass
class ScheduledChunk:
    """Tokens of one request to feed this step, starting at KV position `start_pos`."""

    request: Request
    tokens: list[int]
    start_pos: int
    sample: bool  # the last token's logits are wanted: the prompt is complete, or this is a decode step

    @property
    def seq_id(self) -> int:
        assert self.request.seq_id is not None, "a scheduled request holds a sequence"
        return self.request.seq_id


@dataclass
class SchedulerOutput:
    batched: list[ScheduledChunk] = field(default_factory=list)  # decoded together in one llama_decode
    solo: list[ScheduledChunk] = field(default_factory=list)  # reproducible requests: one llama_decode each
    admitted: list[Request] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)  # prefix copies and slot clears, in order, before the decode

    @property
    def empty(self) -> bool:
        return not self.batched and not self.solo


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler holds at one moment (after vLLM's `SchedulerStats`): hosts render it."""

    running: int
    waiting: int
    kv_cells_total: int
    kv_cells_reserved: int  # by running requests and the prefix slot: what admission counts
    kv_cells_used: int  # holding tokens now, a prefix shared between sequences counted once
    prefix_slot_tokens: int


class Scheduler:
    def __init__(
        self,
        ctx_size: int,
        max_running: int,
        n_batch: int,
        max_waiting: int,
        trained_context: int | None = None,
        prefix_reuse: bool = True,
        min_prefix_tokens: int = 32,
    ) -> None:
        self.ctx_size = ctx_size
        self.max_running = max_running
        self.n_batch = n_batch
        self.max_waiting = max_waiting
        self.trained_context = trained_context or None
        self.budget = KVBudget(ctx_size)
        self.waiting: dict[Priority, deque[Request]] = {p: deque() for p in Priority}
        self.running: list[Request] = []
        self.free_seq_ids: list[int] = list(range(max_running))
        # The sequence id after the request slots holds a retained prefix (see prefix.py).
        self.prefix_slot: PrefixSlot | None = PrefixSlot(max_running) if prefix_reuse else None
        self.min_prefix_tokens = min_prefix_tokens
        self.pending_kv_ops: list[KVOp] = []  # from finish(): to apply before the finished sequences are cleared

    # -- admission ----------------------------------------------------------------------

    @property
    def max_request_tokens(self) -> int:
        """The most cells one request may ever hold: the whole cache, and no more than the model was trained on."""
        return min(self.ctx_size, self.trained_context) if self.trained_context else self.ctx_size

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        limit = self.max_request_tokens
        if prompt_tokens + max_tokens > limit:
            what = "context size" if limit == self.ctx_size else "trained context"
            raise PromptTooLongError(
                f"this request needs {prompt_tokens} prompt tokens + {max_tokens} max_tokens = "
                f"{prompt_tokens + max_tokens} tokens, but the {what} is {limit} tokens; "
                "shorten the prompt or lower max_tokens"
            )

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def add_request(self, request: Request) -> None:
        self.check_fits(len(request.prompt_tokens), request.max_tokens)
        # Requests that the next step will admit into a free slot are not "waiting" for the limit.
        if self.num_waiting - len(self.free_seq_ids) >= self.max_waiting:
            raise OverloadedError(
                f"the waiting queue is full ({self.max_waiting} requests); retry shortly",
                retry_after=1.0,
            )
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].append(request)

    def _admit(self, now: float, out: SchedulerOutput) -> None:
        for priority in Priority:  # interactive first
            queue = self.waiting[priority]
            while queue and self.free_seq_ids:
                head = queue[0]
                if not self.budget.fits(head.kv_cells) and not self._evict_slot_for(head.kv_cells, out):
                    # Strict FIFO: a large request at the head is not overtaken forever by small ones,
                    # and batch rows do not jump ahead of a waiting interactive request.
                    return
                queue.popleft()
                self.budget.reserve(head.request_id, head.kv_cells)
                head.seq_id = self.free_seq_ids.pop(0)
                head.status = RequestStatus.RUNNING
                head.admitted_time = now
                self._reuse_prefix(head, out)
                self.running.append(head)
                out.admitted.append(head)
            if queue:
                return

    def _evict_slot_for(self, cells: int, out: SchedulerOutput) -> bool:
        """Free the retained prefix's cells if that makes `cells` fit."""
        slot = self.prefix_slot
        if slot is None or not slot.tokens or not self.budget.fits(cells - slot.length):
            return False
        self.budget.release(SLOT_KEY)
        slot.tokens, slot.shares_with = [], None
        out.kv_ops.append(ClearSequence(slot.seq_id))
        return True

    def _reuse_prefix(self, request: Request, out: SchedulerOutput) -> None:
        """Start `request` from the longest prompt prefix already in the cache, if it is long enough."""
        slot = self.prefix_slot
        if slot is None or request.params.reproducible:
            return
        limit = len(request.prompt_tokens) - 1  # the last prompt token is always computed: it gives the logits
        best_len, best_src, best_request = 0, None, None
        if slot.tokens:
            best_len, best_src = common_prefix_len(slot.tokens, request.prompt_tokens, limit), slot.seq_id
        for other in self.running:
            if other.params.reproducible or other.seq_id is None:
                continue
            n = common_prefix_len(other.prompt_tokens, request.prompt_tokens, min(limit, other.num_computed_tokens))
            if n > best_len:
                best_len, best_src, best_request = n, other.seq_id, other
        if best_src is None or best_len < self.min_prefix_tokens:
            return
        out.kv_ops.append(PrefixCopy(best_src, request.seq_id, best_len))  # type: ignore[arg-type]
        request.num_computed_tokens = best_len
        request.cached_tokens = best_len
        if best_request is not None and best_len > slot.length and self.budget.fits(best_len - slot.length):
            # Keep this prefix beyond the life of the requests that share it now.
            self.budget.release(SLOT_KEY)
            self.budget.reserve(SLOT_KEY, best_len)
            slot.tokens = request.prompt_tokens[:best_len]
            slot.shares_with = best_request.request_id
            out.kv_ops += [ClearSequence(slot.seq_id), PrefixCopy(best_src, slot.seq_id, best_len)]

    def _keep_prompt_in_slot(self, request: Request, seq_id: int) -> None:
        """A finishing request leaves its prompt in the prefix slot, so the next request that starts the
        same way (the same chat template, system prompt or batch template) does not compute it again."""
        slot = self.prefix_slot
        n = min(request.num_computed_tokens, len(request.prompt_tokens))
        if slot is None or request.params.reproducible or n < self.min_prefix_tokens:
            return
        if slot.length >= n and slot.tokens[:n] == request.prompt_tokens[:n]:
            return  # already held
        held = self.budget.release(SLOT_KEY)
        if not self.budget.fits(n):
            if held:
                self.budget.reserve(SLOT_KEY, held)
            return
        self.budget.reserve(SLOT_KEY, n)
        slot.tokens = request.prompt_tokens[:n]
        slot.shares_with = None  # the request ends now: the cells stay with the slot alone
        self.pending_kv_ops += [ClearSequence(slot.seq_id), PrefixCopy(seq_id, slot.seq_id, n)]

    def kv_cells_held(self) -> int:
        """KV cells holding tokens, a prefix shared through `llama_memory_seq_cp` counted once: each
        running request's own cells, and the prefix slot's, or, while the slot shares the cells of a
        running request, the cells that request itself shares (from an earlier slot)."""
        own = sum(r.num_computed_tokens - r.cached_tokens for r in self.running)
        slot = self.prefix_slot
        if slot is None or not slot.tokens:
            return own
        source = next((r for r in self.running if r.request_id == slot.shares_with), None)
        return own + (source.cached_tokens if source is not None else slot.length)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running),
            waiting=self.num_waiting,
            kv_cells_total=self.ctx_size,
            kv_cells_reserved=self.budget.used,
            kv_cells_used=self.kv_cells_held(),
            prefix_slot_tokens=self.prefix_slot.length if self.prefix_slot else 0,
        )

    def take_pending_kv_ops(self) -> list[KVOp]:
        ops, self.pending_kv_ops = self.pending_kv_ops, []
        return ops

    # -- one step -------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        self._admit(now, out)
        token_budget = self.n_batch

        # Decode first: one token of every sequence whose prompt is in the cache.
        for req in self.running:
            if not req.prompt_done:
                continue
            chunk = ScheduledChunk(req, [req.output_tokens[-1]], req.num_computed_tokens, sample=True)
            if req.params.reproducible:
                out.solo.append(chunk)
            else:
                out.batched.append(chunk)
                token_budget -= 1

        # Then prompts, in chunks, so a long prompt never stalls the running sequences for long.
        for req in self.running:
            if req.prompt_done:
                continue
            remaining = len(req.prompt_tokens) - req.num_computed_tokens
            if req.params.reproducible:
                # A fixed chunk size, whatever else runs: the same request is computed the same way.
                size = min(remaining, self.n_batch, REPRODUCIBLE_CHUNK)
                target = out.solo
            else:
                size = min(remaining, token_budget)
                if size <= 0:
                    continue
                token_budget -= size
                target = out.batched
            start = req.num_computed_tokens
            tokens = req.prompt_tokens[start : start + size]
            target.append(ScheduledChunk(req, tokens, start, sample=(size == remaining)))
        return out

    def advance(self, chunk: ScheduledChunk, sampled_token: int | None) -> None:
        """Record that a chunk's tokens are in the cache, and the token sampled after it."""
        req = chunk.request
        req.num_computed_tokens += len(chunk.tokens)
        if sampled_token is not None:
            req.output_tokens.append(sampled_token)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> int | None:
        """End a request in any state; returns the sequence id whose KV cells must be cleared."""
        if request.is_finished:
            return None
        seq_id = request.seq_id
        if request.status == RequestStatus.WAITING:
            queue = self.waiting[request.priority]
            if request in queue:
                queue.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self.budget.release(request.request_id)
            if seq_id is not None:
                self._keep_prompt_in_slot(request, seq_id)
                self.free_seq_ids.append(seq_id)
                self.free_seq_ids.sort()
        request.status = reason.status
        request.finish_reason = reason
        request.error = error
        request.finished_time = time.monotonic()
        request.seq_id = None
        return seq_id
