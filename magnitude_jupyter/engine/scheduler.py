"""Admission by KV-cache budget and the plan for one engine step.

`schedule()` decides what runs this step; the engine core executes the plan on the runner and
reports back through `advance()` and `finish()`. Every method runs on the engine thread,
except `add_request`, which the core calls under its lock so that submitters get
`PromptTooLongError` / `OverloadedError` synchronously.

Each running request is charged cells in the budget, less what it copies from the prefix cache
(those cells are counted once, by the cache, and pinned there while it runs). With `admission:
reserve` the charge is `prompt_tokens + max_tokens` for its whole life, so a running request always
finishes without preemption. With `admission: estimate` the charge is the prompt and the answer's
likely length (`output_lengths.py`); a request that runs past it grows its charge as it goes, and
when the cells run out, a running request is preempted (see "Preemption" below) and resumes later,
producing the same tokens it would have. Either way no request is cut short for lack of cache.
Cache entries nobody runs on are given back, least recently used first, whenever a request needs
their cells. Where an admitted prompt starts is `prompt_start.py`'s part; what a plan is made of,
`plan.py`'s.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

from .admission_errors import OverloadedError, PromptTooLongError
from .anchors import GreedyAnchors
from .budget import KVBudget
from .draft_policy import DraftPolicy
from .kv_ops import CopyCells, ForgetSuspended, KVOp, LoadWindow, SuspendSequence
from .output_lengths import OutputLengths
from .plan import ScheduledChunk, SchedulerOutput, SchedulerStats
from .prefix_cache import SPILL_AFTER_ROWS, Pins, PrefixCache, SavedState
from .prompt_start import PromptStarts
from .request import FinishReason, Priority, Request, RequestStatus
from .speculate import AnswerMemory, Guess, NgramIndex

CACHE_KEY = "<prefix cache>"  # the cache's cells in the KV budget
# Saved entries come back into the KV cache once nothing has run for this long: not in the gap between
# a client's requests, where they would only go out again, with their save, 64 rows later.
BRING_BACK_AFTER_IDLE_SECONDS = 1.0

# A reproducible request runs in a llama.cpp context of its own (runner.Lane), its prompt in chunks of
# one size whatever else runs: the chunking is part of the result. Below 64 tokens llama.cpp's CPU
# flash attention visits cells one by one, in order.
REPRODUCIBLE_CHUNK = 63

ADMISSION_MODES = ("reserve", "estimate")
# Past its estimate, a request's charge grows by this many cells at a time: one budget check per
# this many tokens, not one per token.
GROW_CELLS = 16
PRIORITY_RANK = {priority: rank for rank, priority in enumerate(Priority)}  # interactive 0, then lower


class Scheduler(PromptStarts):
    def __init__(
        self,
        ctx_size: int,
        max_running: int,
        n_batch: int,
        max_waiting: int,
        trained_context: int | None = None,
        prefix_reuse: bool = True,
        min_prefix_tokens: int = 4,
        cache_sequences: int = 0,
        cache_ram_bytes: int = 0,
        cache_spill_rows: int = SPILL_AFTER_ROWS,
        cache_bytes_per_token: float = 0.0,
        spell: Callable[[int], bytes] | None = None,
        draft_tokens: int = 0,
        draft_max_sequences: int = 0,
        admission: str = "estimate",
        sliding_window: int | None = None,
        sequence_start: Callable[[int], int] | None = None,
        shared_sequences: bool = False,
    ) -> None:
        """`sliding_window`: the tokens the runner's windowed layers see, and `sequence_start` where a
        sequence's cells start now (Runner.sliding_window, .sequence_start). `shared_sequences`: the
        cache's entries take their sequence ids from the request slots' own `max_running` (a windowed
        model: llama.cpp gives its windowed layers a window per sequence id, docs/decisions.md)."""
        if admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {admission!r}")
        self.ctx_size = ctx_size
        self.admission = admission
        self.lengths = OutputLengths()  # finished answers' lengths: what `estimate` charges for
        self._admissions = 0  # admissions so far: orders running requests for preemption
        self.preemptions = 0
        self.preempted_cells = 0
        self.preempted_seconds = 0.0
        # Prompt-lookup drafts (speculate.py), up to `draft_tokens` per decode step; 0: none.
        self.drafts = DraftPolicy(draft_tokens) if draft_tokens > 0 else None
        self.draft_max_sequences = draft_max_sequences  # ... made while at most this many sequences decode
        self.answers = AnswerMemory()  # greedy answers given lately: guesses for a request that repeats one
        self.anchors = GreedyAnchors()  # ... and what a request with the same prompt follows (anchors.py)
        self.spell = spell  # a token's text, for matching a prompt that spells a cached answer otherwise
        self.max_running = max_running
        self.n_batch = n_batch
        self.max_waiting = max_waiting
        self.trained_context = trained_context or None
        self.budget = KVBudget(ctx_size)
        self.waiting: dict[Priority, deque[Request]] = {p: deque() for p in Priority}
        self.running: list[Request] = []
        self.free_seq_ids: list[int] = list(range(max_running))
        # Sequence ids after the request slots belong to cache entries (see prefix_cache.py); or, shared,
        # an entry holds a slot's id while no request runs in it, and a request that needs one takes it.
        self.shared_sequences = shared_sequences and prefix_reuse
        cache_ids = () if self.shared_sequences else range(max_running, max_running + cache_sequences)
        self.cache = (
            PrefixCache(
                cache_ids, cache_ram_bytes, cache_spill_rows, sliding_window or 0, sequence_start, cache_bytes_per_token
            )
            if prefix_reuse and (cache_sequences or self.shared_sequences)
            else None
        )
        if self.cache is not None and self.shared_sequences:
            self.cache.free_seq_ids = self.free_seq_ids  # one list: what one takes, the other sees gone
        self.sliding_window = sliding_window
        self.prefix_reuse = prefix_reuse  # off: every prompt is computed, none copied (not even from a running one)
        self._window_missed = 0
        self.min_prefix_tokens = min_prefix_tokens
        self.pending_kv_ops: list[KVOp] = []  # from finish(): to apply before the finished sequences are cleared
        self._rows_scheduled = 0  # rows of the last step planned: the cache's idle clock (spill_idle)
        self._idle_since: float | None = None  # when the last request ended, while none runs or waits

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
        if self.num_waiting - (self.max_running - len(self.running)) >= self.max_waiting:
            raise OverloadedError(
                f"the waiting queue is full ({self.max_waiting} requests); retry shortly",
                retry_after=1.0,
            )
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].append(request)

    def _admit(self, now: float, out: SchedulerOutput) -> None:
        for priority in Priority:  # interactive first
            queue = self.waiting[priority]
            riding: list[Request] = []  # waiting for a running request to compute the prompt they share
            replanned: Request | None = None  # the head planned again once an entry gave its id up
            while queue and len(self.running) < self.max_running:
                head = queue[0]
                if self._rides_on(head) is not None:
                    riding.append(queue.popleft())
                    continue
                source, shared, from_cache, window = self._prefix_source(head, out)
                need = self.charge(head, shared if from_cache else 0)
                room = need + self._headroom()
                if not self._make_room(room, out, (head.cache_context_tokens, shared if from_cache else 0)):
                    # Strict FIFO: a large request at the head is not overtaken forever by small ones,
                    # and batch rows do not jump ahead of a waiting interactive request.
                    queue.extendleft(reversed(riding))
                    return
                span = self._entry_span(source) if from_cache else None
                handed = None  # the tokens the cache still holds of a sequence handed over by the cache
                # A next turn that goes on from its entry's very end takes that entry's sequence: a copy
                # would keep a second id for cells the request holds too.
                whole = span is not None and shared >= span[1]
                if whole:
                    handed = self._hand_over(source, shared, out)
                elif not self.free_seq_ids:
                    # Planned again once an id is free; once: the plan may bring the head's own entry
                    # back from the RAM tier into it. The least recently used entry nobody shares goes
                    # first, then one running requests share, if the RAM tier holds more of the head.
                    if replanned is not head and (
                        self._free_a_sequence(head, out)
                        or ((span is None or self._ram_gives_more(head, shared)) and self._free_a_shared_sequence(out))
                    ):
                        replanned = head
                        continue
                    if span is None:
                        queue.extendleft(reversed(riding))
                        return  # every sequence id is running
                    handed = self._hand_over(source, shared, out)  # the entry it copies from gives it its own
                if handed is not None:
                    need = self.charge(head, handed)
                counted = shared if from_cache else 0  # of the shared cells, those the cache counts
                if handed is None and span is not None and span[0] < shared:
                    # A copy into the entry's own tokens is charged beyond what the tree holds without
                    # it, budget allowing, so it does not pin the entry (docs/decisions.md, "A windowed
                    # model's cache entries share the request slots' sequence ids").
                    charged = self.charge(head, span[0])
                    if self.budget.fits(charged):
                        counted, need = span[0], charged
                queue.popleft()
                self.budget.reserve(head.request_id, need)
                seq_id = source if handed is not None and source is not None else self.free_seq_ids.pop(0)
                head.seq_id = seq_id
                head.status = RequestStatus.RUNNING
                self._admissions += 1
                head.admission_number = self._admissions
                resumed = head.preempted_time is not None
                if resumed:
                    assert head.preempted_time is not None
                    head.preempted_seconds += now - head.preempted_time
                    self.preempted_seconds += now - head.preempted_time
                    head.preempted_time = None
                else:
                    head.admitted_time = now
                head.copied_tokens = head.cache_shared = 0
                if source is not None and shared:
                    if handed is None:
                        out.kv_ops.append(CopyCells(source, seq_id, 0, shared))
                    head.num_computed_tokens = shared
                    # Cells of a handed-over sequence beyond what the tree still holds are the request's own.
                    head.copied_tokens = shared if handed is None else handed
                    head.cache_shared = counted if handed is None else handed
                    if not resumed:
                        head.cached_tokens = shared
                    if window is not None:
                        out.kv_ops.append(LoadWindow(seq_id, window, self._window_refused(head, resumed, out)))
                if self.cache is not None and not head.params.reproducible and not resumed:
                    self.cache.lookup_tokens += len(head.prompt_tokens)
                    self.cache.hit_tokens += shared
                    self.cache.window_missed_tokens += self._window_missed
                    if window is not None:
                        self.cache.window_checkpoint_tokens += shared
                self.running.append(head)
                out.admitted.append(head)
            queue.extendleft(reversed(riding))
            if queue:
                return

    def _entry_span(self, source: int | None) -> tuple[int, int] | None:
        """With shared sequence ids, the own span of the cache entry on `source` (PrefixCache.leaf_span);
        None otherwise, or when `source` is no entry."""
        if self.cache is None or not self.shared_sequences or source is None:
            return None
        return self.cache.leaf_span(source)

    def _free_a_sequence(self, head: Request, out: SchedulerOutput) -> bool:
        """With shared sequence ids all taken: evict the least recently used entry that neither running
        requests nor `head`'s prompt share (saved to the RAM tier), freeing its id; False if none can go."""
        if self.cache is None or not self.shared_sequences:
            return False
        tokens = head.cache_context_tokens
        mine = self.cache.match(tokens, len(tokens)).length
        if self.cache.evict_one([*self._pins(), (tokens, mine)], out.kv_ops):
            self._sync_cache_budget()
            return True
        return False

    def _hand_over(self, source: int | None, shared: int, out: SchedulerOutput) -> int:
        """The entry on `source` hands the request its sequence, cut back to the `shared` tokens the
        request goes on from; how many of them the tree still holds (PrefixCache.hand_over)."""
        assert self.cache is not None and source is not None
        self._hold_shared(source, shared)
        handed = self.cache.hand_over(source, shared, out.kv_ops)
        self._sync_cache_budget()
        return handed

    def _free_a_shared_sequence(self, out: SchedulerOutput) -> bool:
        """With every sequence id held by entries running requests share: the least recently used goes
        to the RAM tier, freeing its id; False if there is no entry."""
        if self.cache is None or not self.shared_sequences:
            return False
        seq_id = self.cache.least_recent_leaf()
        if seq_id is None:
            return False
        self._hold_shared(seq_id, 0)
        self.cache.drop_entry(seq_id, out.kv_ops)
        self._sync_cache_budget()
        return True

    def _hold_shared(self, seq_id: int, keep: int) -> None:
        """Before the entry on `seq_id` leaves the tree (all of it past `keep`): the cells running
        requests share of that part stay counted until the last of them ends (KVBudget.hold), once,
        not once per request (docs/decisions.md, "A windowed model's cache entries share the request
        slots' sequence ids")."""
        assert self.cache is not None
        sharing = [r for r in self.running if r.cache_shared]
        beyond = self.cache.shared_beyond(seq_id, keep, [(_shared_tokens(r), r.cache_shared) for r in sharing])
        if any(beyond):
            self.budget.hold(max(beyond), [r.request_id for r, n in zip(sharing, beyond, strict=True) if n])

    def _headroom(self) -> int:
        """Free cells a new admission leaves under `estimate`: a growth step for each running request
        that may grow, so that admitting one does not preempt another at the next step."""
        if self.admission != "estimate":
            return 0
        return GROW_CELLS * sum(1 for r in self.running if not r.params.reproducible)

    def charge(self, request: Request, shared: int = 0) -> int:
        """Cells the budget holds for `request` from its admission, less the `shared` ones the cache
        holds: its prompt and its whole `max_tokens` under `reserve` (and always for a reproducible
        request, whose lane is made at that size), else its prompt and its answer's likely length,
        and at least room for the tokens it has already and the next ones (a resumed request)."""
        if self.admission == "reserve" or request.params.reproducible:
            return request.kv_cells - shared
        expected = self.lengths.estimate(request.priority, request.client, request.max_tokens)
        if request.output_tokens:  # resumed: what it has, and room to go on
            expected = max(expected, min(request.max_tokens, len(request.output_tokens) + GROW_CELLS))
        return len(request.prompt_tokens) + expected - shared

    def _pins(self, extra: tuple[list[int], int] | None = None) -> Pins:
        """What running requests (and the one being admitted) share of the cache: not to be evicted."""
        pins = [(_shared_tokens(r), r.cache_shared) for r in self.running if r.cache_shared]
        return [*pins, extra] if extra and extra[1] else pins

    def _waiting_pins(self) -> Pins:
        """What the requests admission may take next could copy from the cache (PrefixCache.reachable):
        not to move out just before admission."""
        if self.cache is None:
            return []
        heads = itertools.islice((r for p in Priority for r in self.waiting[p]), self.max_running)
        return self.cache.reachable([r.cache_context_tokens for r in heads if not r.params.reproducible])

    def _make_room(self, cells: int, out: SchedulerOutput, admitting: tuple[list[int], int]) -> bool:
        """Whether `cells` fit, after evicting cache entries nobody runs on if need be."""
        if self.budget.fits(cells):
            return True
        if self.cache is None:
            return False
        self.cache.evict(cells - self.budget.free, out.kv_ops, self._pins(admitting))
        self._sync_cache_budget()
        return self.budget.fits(cells)

    def _sync_cache_budget(self) -> None:
        self.budget.release(CACHE_KEY)
        if self.cache is not None and self.cache.cells:
            self.budget.reserved[CACHE_KEY] = self.cache.cells

    def _bring_back_idle(self, out: SchedulerOutput) -> None:
        """With nothing to run (BRING_BACK_AFTER_IDLE_SECONDS), move saved entries back into the KV
        cache, one a step (a request that arrives meanwhile waits for one restore, a few ms), into at
        most half of it: the rest stays free for the requests to come, and what comes back moves out
        again if it idles while they decode."""
        if self.cache is not None and self.cache.bring_back_one(self.ctx_size // 2, out.kv_ops):
            self._sync_cache_budget()

    def release_idle_cache(self) -> list[KVOp]:
        """Evict every cache entry no running request shares (each saved to the RAM tier first), when
        llama.cpp found no cells for a step; the operations that do it."""
        ops: list[KVOp] = []
        if self.cache is not None:
            self.cache.evict(self.cache.cells + 1, ops, self._pins())
            self._sync_cache_budget()
        return ops

    def reset_cache(self) -> list[KVOp]:
        """Forget every cache entry without saving it, when llama.cpp's cells may no longer be what the
        tree says (a cache operation failed); the operations that clear their sequences."""
        ops: list[KVOp] = []
        if self.cache is not None:
            self.cache.clear(ops, save=False)
            self._sync_cache_budget()
        return ops

    def kv_cells_held(self) -> int:
        """KV cells holding tokens, a prefix shared through `llama_memory_seq_cp` counted once: each
        running request's own cells, the cache's, and those requests share of entries gone from it."""
        own = sum(r.num_computed_tokens - r.copied_tokens for r in self.running)
        return own + self.budget.held + (self.cache.cells if self.cache is not None else 0)

    def make_stats(self) -> SchedulerStats:
        cache = self.cache
        return SchedulerStats(
            running=len(self.running),
            waiting=self.num_waiting,
            kv_cells_total=self.ctx_size,
            kv_cells_reserved=self.budget.used,
            kv_cells_used=self.kv_cells_held(),
            prefix_cache_cells=cache.cells if cache else 0,
            prefix_cache_entries=cache.entries if cache else 0,
            prefix_cache_ram_entries=len(cache.ram.entries) if cache and cache.ram else 0,
            prefix_cache_ram_bytes=cache.ram.bytes if cache and cache.ram else 0,
            prompt_tokens_looked_up=cache.lookup_tokens if cache else 0,
            prompt_tokens_cached=cache.hit_tokens if cache else 0,
            prompt_tokens_restored=cache.restored_tokens if cache else 0,
            prompt_tokens_respelled=cache.respelled_tokens if cache else 0,
            prompt_tokens_window_missed=cache.window_missed_tokens if cache else 0,
            prompt_tokens_window_checkpoint=cache.window_checkpoint_tokens if cache else 0,
            prefix_cache_window_checkpoints=len(cache.ram.windows) if cache and cache.ram else 0,
            prefix_cache_spilled=cache.spilled_entries if cache else 0,
            admission=self.admission,
            preemptions=self.preemptions,
            preempted_waiting=sum(1 for q in self.waiting.values() for r in q if r.preempted_time is not None),
            preempted_cells=self.preempted_cells,
            preempted_seconds=round(self.preempted_seconds, 3),
            preempted_state_bytes=sum(
                len(r.suspended_state) for q in self.waiting.values() for r in q if r.suspended_state is not None
            ),
            answer_charge_tokens=self.lengths.estimate(Priority.INTERACTIVE, None, self.ctx_size),
        )

    def take_pending_kv_ops(self) -> list[KVOp]:
        ops, self.pending_kv_ops = self.pending_kv_ops, []
        return ops

    # -- one step -------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        if self.cache is not None:
            self.cache.plan += 1  # what earlier plans made is in llama.cpp now
        if self.admission == "estimate":  # running requests get the cells they grow into first
            self._grow_or_preempt(now, out)
        idle = not self.running and not self.num_waiting
        # Idle entries move to host RAM (prefix_cache.SPILL_AFTER_ROWS) while others decode. With
        # nothing to decode, holding cells costs nothing: they come back instead. Those no waiting
        # request may take move before admission, so that an entry restored for a request lands in
        # the cells they free, not above every cell in use; the others after it, unless admission
        # took them (docs/decisions.md, "Idle entries move out before admission").
        if self.cache is not None:
            rows, self._rows_scheduled = self._rows_scheduled, 0
            if idle:
                self.cache.rows += rows
            elif self.cache.spill_idle(rows, out.kv_ops, lambda: [*self._pins(), *self._waiting_pins()]):
                self._sync_cache_budget()
        self._admit(now, out)
        if self.cache is not None and not idle and self.cache.spill_idle(0, out.kv_ops, self._pins):
            self._sync_cache_budget()
        if idle:
            self._idle_since = now if self._idle_since is None else self._idle_since
            if now - self._idle_since >= BRING_BACK_AFTER_IDLE_SECONDS:
                self._bring_back_idle(out)
            return out
        self._idle_since = None
        token_budget = self.n_batch

        # Decode first: one token of every sequence whose prompt is in the cache.
        for req in self.running:
            if not req.prompt_done:
                continue
            if self._takes_window(req):
                assert self.cache is not None and req.seq_id is not None
                if (op := self.cache.take_window(req.seq_id, req.cache_tokens)) is not None:
                    out.kv_ops.append(op)  # before its first decode: its cells are its prompt's
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
            context = req.context_tokens
            remaining = len(context) - req.num_computed_tokens
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
            tokens = context[start : start + size]
            # A resumed request computing its context again samples nothing: its next token is known.
            target.append(ScheduledChunk(req, tokens, start, sample=(size == remaining and not req.output_tokens)))

        # Last, with what the step has left: drafts, where they are expected to pay (draft_policy.py).
        # Not in a step that carries a prompt: a request waiting for its first token would wait for
        # the drafts' rows too.
        if (
            self.drafts is not None
            and token_budget > 0
            and out.decodes_only
            and len(out.batched) <= self.draft_max_sequences
        ):
            max_draft = self.drafts.max_draft
            guessed = [(c, g) for c in out.batched if (g := self._guess(c.request, max_draft)) is not None]
            if guessed:
                yielded = len(out.batched)  # every decode chunk samples
                guesses = [g for _, g in guessed]
                lengths = self.drafts.plan(guesses, self.n_batch - token_budget, yielded, token_budget)
                for (chunk, (guess, _)), n in zip(guessed, lengths, strict=True):
                    if n:
                        chunk.draft, chunk.draft_match = guess.tokens[:n], guess.matched
                        chunk.tokens = chunk.tokens + chunk.draft
        for chunk in out.batched:  # where a request repeats an earlier greedy one, what it answered
            if chunk.sample and chunk.request.params.draftable:
                chunk.expected = self.anchors.expected(chunk.request, len(chunk.draft) + 1)
        self._rows_scheduled = sum(len(c.tokens) for c in (*out.batched, *out.solo))
        return out

    # -- preemption -----------------------------------------------------------------------
    #
    # Under `estimate`, before each step every running request must hold the cells the step writes.
    # One that has run past its charge grows it by GROW_CELLS, taking free cells or evicting idle
    # cache entries; when that fails, a running request is preempted, lowest priority first (batch
    # before interactive), then the most recently admitted, until the growth fits (the growing
    # request may be the one preempted). A preempted request's computed tokens become a prefix-cache
    # entry, whose cells go only when they are needed, to the RAM tier when there is one (eviction
    # saves them); it goes back to the head of its queue and, admitted again, copies or restores them
    # and computes only what the cache lost (all of it without a prefix cache). A reproducible
    # request's lane is saved whole and restored into a new lane. Its sampler is kept meanwhile, so
    # it goes on producing the tokens it would have. The oldest running request is preempted last:
    # it always progresses, so every request ends.

    def _grow_or_preempt(self, now: float, out: SchedulerOutput) -> None:
        for request in list(self.running):  # oldest admission first: they keep their cells
            while request in self.running:
                reserved = self.budget.reserved[request.request_id]
                short = self._own_cells_after_step(request) - reserved
                if short <= 0:
                    break
                grow = max(short, min(GROW_CELLS, self.charge_limit(request) - reserved))
                if self._make_room(grow, out, ([], 0)):
                    self.budget.reserved[request.request_id] = reserved + grow
                    break
                self._preempt(self._victim(), now, out)

    def charge_limit(self, request: Request) -> int:
        """The most a running request is ever charged: its prompt and max_tokens, less what it shares."""
        return request.kv_cells - request.cache_shared

    def _own_cells_after_step(self, request: Request) -> int:
        own = request.num_computed_tokens - request.cache_shared
        if request.prompt_done:
            return own + 1
        return own + min(len(request.context_tokens) - request.num_computed_tokens, self.n_batch)

    def _victim(self) -> Request:
        """Lowest priority first, then the most recently admitted."""
        return max(self.running, key=lambda r: (PRIORITY_RANK[r.priority], r.admission_number))

    def _preempt(self, request: Request, now: float, out: SchedulerOutput) -> None:
        seq_id = request.seq_id
        assert seq_id is not None
        self.running.remove(request)
        self.preempted_cells += self.budget.release(request.request_id)
        if request.params.reproducible:

            def keep(state: SavedState | None, request: Request = request) -> None:
                request.suspended_state = state

            out.kv_ops.append(SuspendSequence(seq_id, request.request_id, keep))
        else:
            computed = _computed_tokens(request)
            if self.cache is not None and computed:
                self.cache.insert(computed, seq_id, out.kv_ops, self._pins())
                self._sync_cache_budget()
            out.kv_ops.append(SuspendSequence(seq_id, request.request_id, lambda state: None))
            request.num_computed_tokens = 0
        request.copied_tokens = request.cache_shared = 0
        self.free_seq_ids.append(seq_id)
        self.free_seq_ids.sort()
        request.seq_id = None
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        request.preempted_time = now
        self.preemptions += 1
        self.waiting[request.priority].appendleft(request)

    def _guess(self, req: Request, max_draft: int) -> tuple[Guess, NgramIndex] | None:
        if not req.params.draftable:
            return None
        # Never past max_tokens: the step's last token is sampled after the drafts, and every cell a
        # draft takes lies inside the request's reservation.
        k = min(max_draft, req.max_tokens - len(req.output_tokens) - 1)
        if self.admission == "estimate":  # ... and inside its charge: drafts never grow it
            own_after_decode = req.num_computed_tokens - req.cache_shared + 1
            k = min(k, self.budget.reserved.get(req.request_id, 0) - own_after_decode)
        if k <= 0:
            return None
        if req.ngrams is None:
            req.ngrams = NgramIndex()
            req.ngrams.extend(req.prompt_tokens)
        req.ngrams.extend(req.output_tokens[len(req.ngrams.tokens) - len(req.prompt_tokens) :])
        guess = req.ngrams.guess(k)
        # An earlier answer that went the same way is the better guess when it matches longer.
        remembered = self.answers.guess(req.ngrams.tokens, k) if req.cache_scope is None else None
        if remembered is not None and (guess is None or remembered.matched > guess.matched):
            guess = remembered
        return (guess, req.ngrams) if guess is not None else None

    def record_draft(self, chunk: ScheduledChunk, kept: int) -> None:
        """What the picks made of a chunk's draft, for the policy's chances."""
        if self.drafts is not None and chunk.draft and chunk.request.ngrams is not None:
            self.drafts.acceptance.record(chunk.draft_match, len(chunk.draft), kept, chunk.request.ngrams)

    def advance(self, chunk: ScheduledChunk, sampled: Sequence[int]) -> None:
        """Record that a chunk's tokens are in the cache (its drafts as far as the picks confirmed them:
        the rest are dropped from the sequence) and the tokens sampled after it, in order."""
        req = chunk.request
        confirmed = max(0, len(sampled) - 1) if chunk.draft else 0
        req.num_computed_tokens += len(chunk.tokens) - len(chunk.draft) + confirmed
        req.output_tokens.extend(sampled)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> int | None:
        """End a request in any state; returns the sequence id whose KV cells must be cleared."""
        if request.is_finished:
            return None
        seq_id = request.seq_id
        if request.status == RequestStatus.WAITING:
            queue = self.waiting[request.priority]
            if request in queue:
                queue.remove(request)
            if request.preempted_time is not None:  # it ends before it resumed
                self.preempted_seconds += time.monotonic() - request.preempted_time
                request.preempted_time = None
                request.suspended_state = None
                self.pending_kv_ops.append(ForgetSuspended(request.request_id))
        elif request in self.running:
            self.running.remove(request)
            self.budget.release(request.request_id)
            if seq_id is not None:
                kept = False  # the entry keeps the sequence itself (shared sequence ids)
                if self.cache is not None and reason != FinishReason.ERROR and not request.params.reproducible:
                    # Its tokens stay as a cache entry: the next turn of a conversation starts with them
                    # (not a reproducible request's: they are in its lane, runner.Lane).
                    computed = _computed_tokens(request)
                    if computed:
                        pins = self._pins()
                        kept = self.cache.insert(computed, seq_id, self.pending_kv_ops, pins, self.shared_sequences)
                    self._sync_cache_budget()
                if kept:
                    seq_id = None
                else:
                    self.free_seq_ids.append(seq_id)
                    self.free_seq_ids.sort()
        request.status = reason.status
        request.finish_reason = reason
        request.error = error
        request.finished_time = time.monotonic()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.lengths.record(request.priority, request.client, len(request.output_tokens))
        # Another scope's answers are no guesses: a faster answer would tell what it was asked.
        shared = request.cache_scope is None
        if self.drafts is not None and request.params.draftable and reason != FinishReason.ERROR and shared:
            self.answers.remember(request.prompt_tokens, request.output_tokens)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.anchors.remember(request)
        self.anchors.forget(request)
        request.ngrams = None  # a finished request's record stays a while (for its stream): not its index
        request.seq_id = None
        return seq_id


def _shared_tokens(request: Request) -> list[int]:
    """The tokens whose first `cache_shared` cells a running request shares with the cache."""
    if request.cache_shared <= len(request.prompt_tokens):
        return request.cache_tokens
    return request.cache_context_tokens


def _computed_tokens(request: Request) -> list[int]:
    """The tokens a running request's sequence holds, as the prefix cache keys them."""
    return (request.cache_tokens + request.output_tokens)[: request.num_computed_tokens]
