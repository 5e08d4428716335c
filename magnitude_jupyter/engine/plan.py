"""What a step's plan is made of: the chunks the scheduler hands the engine, the decode items the
runner sees of them, the scheduler's figures, and the errors admission raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .kv_ops import KVOp
from .ram_tier import SavedState
from .request import Request


@dataclass(frozen=True)
class DecodeItem:
    """What the runner sees of a chunk: a sequence id, tokens and where they go."""

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    want_logits: bool
    draft: int = 0  # the last `draft` tokens are a guess (speculate.py): each gets a logits row too


@dataclass
class ScheduledChunk:
    """Tokens of one request to feed this step, starting at KV position `start_pos`."""

    request: Request
    tokens: list[int]
    start_pos: int
    sample: bool  # the last token's logits are wanted: the prompt is complete, or this is a decode step
    draft: list[int] = field(default_factory=list)  # guessed tokens after the sampled one, ending `tokens`
    draft_match: int = 0  # how many tokens matched where the draft was found
    # The kept answer's tokens from this step's first pick on, where the request repeats an earlier
    # greedy one (anchors.py): a pick within a near tie of one takes it (step.py).
    expected: list[int] = field(default_factory=list)

    def item(self) -> DecodeItem:
        return DecodeItem(self.seq_id, self.tokens, self.start_pos, self.sample, len(self.draft))

    @property
    def seq_id(self) -> int:
        assert self.request.seq_id is not None, "a scheduled request holds a sequence"
        return self.request.seq_id


class PrefixSource(NamedTuple):
    """Where an admitted request's prompt starts: cells to copy, and a window checkpoint to load over them."""

    seq_id: int | None = None  # the sequence to copy from
    length: int = 0  # the tokens to copy
    from_cache: bool = False  # the cache's cells (else a running request's)
    window: SavedState | None = None  # a window checkpoint to load after the copy (prefix_cache.py)


@dataclass
class SchedulerOutput:
    batched: list[ScheduledChunk] = field(default_factory=list)  # decoded together in one llama_decode
    solo: list[ScheduledChunk] = field(default_factory=list)  # reproducible requests: one llama_decode each
    admitted: list[Request] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)  # cache operations, in order, before the decode

    @property
    def empty(self) -> bool:
        """Nothing to decode (the cache may still have work: see `kv_ops`)."""
        return not self.batched and not self.solo

    def leave_out(self, request: Request) -> None:
        """Take a request's chunks out of this step: its cells changed after the plan (a window
        checkpoint llama.cpp refused), and it starts again from its first token at the next step."""
        self.batched = [c for c in self.batched if c.request is not request]
        self.solo = [c for c in self.solo if c.request is not request]

    @property
    def places_prompt(self) -> bool:
        """The batched step computes prompt rows: llama.cpp places a run of new cells."""
        return not self.decodes_only

    @property
    def decodes_only(self) -> bool:
        """The batched step holds decode rows only (no prompt chunk)."""
        return all(c.request.prompt_done for c in self.batched)


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler holds at one moment (after vLLM's `SchedulerStats`): hosts render it."""

    running: int
    waiting: int
    kv_cells_total: int
    kv_cells_reserved: int  # by running requests and the prefix slot: what admission counts
    kv_cells_used: int  # holding tokens now, a prefix shared between sequences counted once
    prefix_cache_cells: int  # held by cache entries (some of them shared with running requests)
    prefix_cache_entries: int
    prefix_cache_ram_entries: int
    prefix_cache_ram_bytes: int
    prompt_tokens_looked_up: int  # prompt tokens of admitted requests that could use the cache
    prompt_tokens_cached: int  # ... of which came from the cache instead of being computed
    prompt_tokens_restored: int  # ... of which the RAM tier brought back
    prompt_tokens_respelled: int = 0  # ... of which where the prompt spelled a cached answer's text otherwise
    prompt_tokens_window_missed: int = 0  # cached but not reused: a sliding window had moved past them
    prompt_tokens_window_checkpoint: int = 0  # cached tokens reused through a window checkpoint
    prefix_cache_window_checkpoints: int = 0  # window checkpoints the RAM tier holds
    prefix_cache_spilled: int = 0  # entries moved to the RAM tier for being idle (prefix_cache.SPILL_AFTER_ROWS)
    admission: str = "estimate"
    preemptions: int = 0  # running requests whose cells were taken back, since the engine started
    preempted_waiting: int = 0  # ... of them waiting to resume now
    preempted_cells: int = 0  # cells they gave back, all preemptions together
    preempted_seconds: float = 0.0  # time they spent waiting to resume, all together
    preempted_state_bytes: int = 0  # preempted lanes' KV states held in memory now
    answer_charge_tokens: int = 0  # under `estimate`: an interactive answer's charge now (its likely length)
