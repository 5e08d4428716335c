"""Where an admitted request's prompt starts: the longest prefix already in the KV cache, from a
cache entry (brought back from the RAM tier when that covers more, and on a sliding-window model
through a window checkpoint where the entry's window has moved on), or from a running request
whose rows started with the same tokens. Part of the scheduler (`Scheduler` mixes it in); the
cache decides what is reusable (prefix_cache.py), this decides which source a request takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .plan import PrefixSource, SchedulerOutput
from .prefix_cache import Match, common_prefix_len
from .ram_tier import RamMatch
from .request import Request

if TYPE_CHECKING:
    from .budget import KVBudget
    from .prefix_cache import Pins, PrefixCache

# Restore a saved entry when it covers at least this many more prompt tokens than the tree: a restore
# costs less than computing a prompt row (docs/decisions.md).
RAM_RESTORE_GAIN = 2
# A request waits for a running one to compute the prompt they share when they share at least this
# many tokens (docs/decisions.md, "Prompts that start alike wait for the first").
RIDE_MIN_TOKENS = 128


class PromptStarts:
    """The scheduler's prefix sources (see the module's docstring)."""

    if TYPE_CHECKING:  # what it uses of the scheduler it is part of
        cache: PrefixCache | None
        running: list[Request]
        spell: Callable[[int], bytes] | None
        prefix_reuse: bool
        min_prefix_tokens: int
        sliding_window: int | None
        budget: KVBudget
        _window_missed: int

        @property
        def max_request_tokens(self) -> int: ...
        def charge(self, request: Request, shared: int = 0) -> int: ...
        def _make_room(self, cells: int, out: SchedulerOutput, admitting: tuple[list[int], int]) -> bool: ...
        def _pins(self, extra: tuple[list[int], int] | None = None) -> Pins: ...
        def _sync_cache_budget(self) -> None: ...

    def _window_refused(self, request: Request, resumed: bool, out: SchedulerOutput) -> Callable[[], None]:
        """What happens when llama.cpp finds no cells for a request's window checkpoint: its cells went
        with the refusal, so it computes its context whole, its chunk left out of the step `out`
        plans, and the cells it copied are charged to it now."""

        def refused() -> None:
            out.leave_out(request)
            shared = request.copied_tokens
            request.num_computed_tokens = request.copied_tokens = request.cache_shared = 0
            if request.request_id in self.budget.reserved:
                self.budget.reserved[request.request_id] += shared
            if self.cache is not None and not resumed:
                request.cached_tokens = 0
                self.cache.hit_tokens -= shared
                self.cache.window_checkpoint_tokens -= shared
                self.cache.window_missed_tokens += shared

        return refused

    def _takes_window(self, request: Request) -> bool:
        """Whether a window checkpoint of `request` is due now: it has computed its prompt and decoded
        nothing yet, on a model with sliding windows (prefix_cache.py, "Sliding windows")."""
        return (
            self.cache is not None
            and bool(self.cache.window)
            and len(request.output_tokens) == 1
            and request.num_computed_tokens == len(request.prompt_tokens)
            and not request.params.reproducible
            and request.preemptions == 0
        )

    def _prefix_source(self, request: Request, out: SchedulerOutput) -> PrefixSource:
        """Where the longest prompt prefix already in the KV cache is: a cache entry (restored from RAM
        if that covers more, with a window checkpoint where its window has moved on), or the computed
        prompt of a running request (rows of a batch that start together)."""
        self._window_missed = 0  # cached tokens a sliding window keeps from being reused, counted at admission
        if request.params.reproducible or not self.prefix_reuse:
            return PrefixSource()  # computed its own way, always: see Request.reproducible
        context = request.context_tokens
        # The last prompt token is always computed: it gives the logits. A resumed request's next
        # decode gives them: its whole context may come from the cache.
        limit = len(context) - (0 if request.output_tokens else 1)
        best = PrefixSource()
        if self.cache is not None:
            match = self.cache.match(request.cache_context_tokens, limit)
            if self.cache.ram is not None:
                match = self._restore_from_ram(request, match.length, limit, out) or match
            resumed = bool(request.output_tokens)
            if match.seq_id is not None and match.length >= self.min_prefix_tokens and self.spell and not resumed:
                match, limit = self._respell(request, match, limit)
            kept = self.cache.continuable(match, request.cache_context_tokens)
            self._window_missed += match.length - kept.length
            match = kept
            if match.seq_id is not None:
                best = PrefixSource(match.seq_id, match.length, True, match.window)
                self.cache.touch(match)
        for other in self.running:
            if other.params.reproducible or other.seq_id is None or other.cache_scope != request.cache_scope:
                continue
            n = common_prefix_len(other.context_tokens, context, min(limit, other.num_computed_tokens))
            if self.sliding_window and n < other.num_computed_tokens:
                continue  # its windowed layers hold only the cells near its end (prefix_cache.py)
            if n > best.length:
                best = PrefixSource(other.seq_id, n)
        return best if best.length >= self.min_prefix_tokens else PrefixSource()

    def _rides_on(self, request: Request) -> Request | None:
        """A running request still computing a prompt that starts as `request`'s does, for at least
        RIDE_MIN_TOKENS: admitted once those cells are all there, `request` copies them rather than
        computing them beside it (agents that share a system prompt and
        arrive together). Not on a sliding-window model: a running request's windowed layers hold
        only the cells near its end, so there is nothing to copy mid-prompt."""
        if request.params.reproducible or not self.prefix_reuse or self.sliding_window or request.output_tokens:
            return None
        context = request.context_tokens
        for other in self.running:
            if other.params.reproducible or other.seq_id is None or other.cache_scope != request.cache_scope:
                continue
            if other.output_tokens:  # its prompt is computed: admission copies it now
                continue
            shared = common_prefix_len(other.prompt_tokens, context, len(context) - 1)
            if shared >= max(self.min_prefix_tokens, RIDE_MIN_TOKENS) and other.num_computed_tokens < shared:
                return other
        return None

    def _respell(self, request: Request, match: Match, limit: int) -> tuple[Match, int]:
        """Take the cache's spelling of the text after the match, where it has one (see
        `PrefixCache.respelled`): the prompt then uses the tokens its model wrote rather than the
        tokenizer's, and their cells are copied instead of computed."""
        assert self.cache is not None and self.spell is not None
        found = self.cache.respelled(request.cache_tokens, match, self.spell)
        if found is None:
            return match, limit
        tokens, cached = found
        if len(tokens) + request.max_tokens > self.max_request_tokens:
            return match, limit
        request.prompt_tokens = [request.prompt_tokens[0], *tokens[1:]]  # the tree holds its scope key first
        self.cache.respelled_tokens += cached - match.length
        limit = len(tokens) - 1
        return self.cache.match(request.cache_tokens, limit), limit

    def _ram_choice(self, prompt: Sequence[int], have: int, limit: int) -> tuple[RamMatch, int]:
        """The saved entry a restore would bring back for `prompt` when the tree gives `have` of its
        tokens, and the tokens a sliding window keeps from being reused (0 unless windowed)."""
        assert self.cache is not None and self.cache.ram is not None
        cache, ram = self.cache, self.cache.ram
        if not cache.window:
            return ram.best(prompt, limit), 0
        # Where the tree's cells replace the saved ones below `have`, the window must lie above them.
        found = ram.best(prompt, limit, lambda n, floor: cache.window_start(n) >= max(floor, have))
        usable = max(have, found.length)
        checkpoint = ram.window_for(prompt, usable, found.longest) if found.longest > usable else None
        if checkpoint is None:
            return found, max(0, found.longest - usable)
        # The entry that goes furthest comes back, and the checkpoint inside it is loaded over it.
        return found._replace(tokens=found.longest_tokens, length=checkpoint.length), 0

    def _ram_gives_more(self, request: Request, have: int) -> bool:
        """Whether a restore would cover more of `request`'s prompt than the `have` tokens the tree gives."""
        if self.cache is None or self.cache.ram is None:
            return False
        prompt = request.cache_context_tokens
        return self._ram_choice(prompt, have, len(prompt) - 1)[0].length >= have + RAM_RESTORE_GAIN

    def _restore_from_ram(self, request: Request, have: int, limit: int, out: SchedulerOutput) -> Match | None:
        """Bring back a saved entry that covers more of the prompt than the tree does; the new match."""
        assert self.cache is not None and self.cache.ram is not None
        found, self._window_missed = self._ram_choice(request.cache_context_tokens, have, limit)
        tokens, n = found.tokens, found.length
        if n < have + RAM_RESTORE_GAIN:
            return None
        # llama.cpp loads the whole saved sequence before the shared part is swapped for the tree's,
        # and the request then adds its own cells beyond it.
        need = len(tokens) + max(0, self.charge(request) - n)
        if not self._make_room(need, out, (request.cache_context_tokens, have)):
            return None
        floor = self.cache.ram.floors[tokens]
        data = self.cache.ram.pop(tokens)
        assert data is not None
        if not self.cache.restore(tokens, data, out.kv_ops, self._pins(), window_floor=floor):
            self.cache.ram.put(tokens, data, floor)
            return None
        self._sync_cache_budget()
        return self.cache.match(request.cache_context_tokens, limit)
