"""Plain data objects for one generation: what was asked, how far it got, how it ended."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

from ..token_counts import TokenCounts

if TYPE_CHECKING:
    from .answer_check import AnswerCheck
    from .ram_tier import SavedState
    from .reasoning import ReasoningSplitter
    from .speculate import NgramIndex
    from .streams import TokenStream
    from .text import TextAssembler


class RequestStatus(IntEnum):
    """Every finished state sorts after the live ones, so `status > RUNNING` means finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_CANCELLED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        return {
            FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
            FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
            FinishReason.CANCELLED: RequestStatus.FINISHED_CANCELLED,
            FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
        }[self]


class Priority(IntEnum):
    """Lower runs first: interactive cells are admitted before queued batch rows."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"priority must be 'interactive' or 'batch', got {value!r}") from None
        return cls(value)


def invalid_param(name: str, why: str) -> ValueError:
    """A ValueError that names the request field at fault (the server reports it as the `param`)."""
    err = ValueError(f"{name}: {why}")
    err.param = name  # type: ignore[attr-defined]
    return err


# One set of limits for every surface (the HTTP API validates through `SamplingParams.validate`).
NUMBER_LIMITS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (0.0, 10.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy; ``max_tokens=None`` takes the engine default."""

    max_tokens: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per earlier occurrence of the token
    presence_penalty: float = 0.0  # OpenAI's: subtracted once if the token occurred at all
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    reproducible: bool = False
    ignore_eos: bool = False
    grammar: str | None = None  # GBNF the answer must follow (JSON answers: see grammar.py)
    # The JSON Schema the whole answer is checked against once generated, where `grammar` could not
    # hold all of it; `unheld` says what it left out, in words (answer_check.py).
    answer_schema: dict[str, Any] | None = None
    unheld: tuple[str, ...] = ()
    logprobs: bool = False  # report each sampled token's log probability under the model
    top_logprobs: int = 0  # ... and this many most likely alternatives at each position

    @property
    def bans_eog(self) -> bool:
        """`ignore_eos` as llama.cpp's server means it: end-of-generation tokens are never sampled. Under
        a grammar they stay allowed, where the grammar is complete: its end is the answer's."""
        return self.ignore_eos and self.grammar is None

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the server reports it as the `param`)."""
        bad = invalid_param
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        for name, (lo, hi) in NUMBER_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a number, got {value!r}")
            if not lo <= value <= hi:
                raise bad(name, f"must be between {lo:g} and {hi:g}, got {value!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise bad("repeat_last_n", f"must be an integer >= -1, got {self.repeat_last_n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for name in ("reproducible", "ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", "must be a non-empty GBNF grammar")

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty applies (they need a sampler that has seen the prompt)."""
        repeat = self.repeat_penalty != 1.0 and self.repeat_last_n != 0
        return repeat or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def draftable(self) -> bool:
        """Whether prompt-lookup drafts may speed this request up (speculate.py): its pick is a plain
        argmax over one logits row, so a draft is confirmed by nothing but that row. Reproducible
        requests keep their one-token steps: a draft row changes the shape of the computation."""
        return self.greedy and not self.penalized and self.grammar is None and not self.reproducible

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Timings:
    load_ms: float | None = None  # waiting for the model to load (many models: it was not resident)
    queued_ms: float | None = None  # arrival to admission: the load included
    ttft_ms: float | None = None  # arrival to first token, queue time included
    prompt_ms: float | None = None  # admission to first token: prefill
    decode_ms: float | None = None
    decode_tokens_per_s: float | None = None
    total_ms: float | None = None
    preempted_ms: float | None = None  # waiting to resume after a preemption (decode_ms includes it)

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if v is not None else None) for k, v in asdict(self).items()}


def scope_token(scope: str, first: int) -> int:
    """A key no real token has (negative) that stands for `first` in `scope`'s part of the cache."""
    digest = hashlib.blake2b(f"{scope}\0{first}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 2)


def scoped_tokens(tokens: list[int], scope: str | None) -> list[int]:
    """`tokens` with the first one replaced by its scope's key: the cache tree and the RAM tier are
    keyed by tokens and cells by position, so one key per scope keeps the scopes' entries apart and
    leaves every position where it was."""
    if scope is None or not tokens:
        return tokens
    return [scope_token(scope, tokens[0]), *tokens[1:]]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: what the KV reservation is sized for
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_tokens: list[int] = field(default_factory=list)
    output_text: str = ""
    num_computed_tokens: int = 0  # tokens already in this request's KV cells
    cached_tokens: int = 0  # prompt tokens copied from another sequence's cells instead of computed (usage)
    copied_tokens: int = 0  # cells copied from another sequence at its (latest) admission
    cache_shared: int = 0  # ... of them from a prefix-cache entry (counted by the cache, pinned while it runs)
    seq_id: int | None = None
    tool_form: str | None = None  # the call form its answer is held to (see tools.py), when tools were given
    answer_check: AnswerCheck | None = None  # what its finished answer is checked against (answer_check.py)
    finish_reason: FinishReason | None = None
    error: str | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    load_ms: float | None = None
    stream: TokenStream | None = None
    text: TextAssembler | None = None
    ngrams: NgramIndex | None = None  # its tokens' n-gram positions, once it has been drafted for
    cache_scope: str | None = None  # prefix-cache entries are shared only with requests of the same scope
    client: str | None = None  # who asked (`user`), for the answer-length estimate (output_lengths.py)
    admission_number: int = 0  # its latest admission's place in the engine's admissions
    preemptions: int = 0  # times its cells were taken back mid-answer (scheduler.py, "Preemption")
    preempted_time: float | None = None  # when the latest preemption began, while it waits to resume
    preempted_seconds: float = 0.0  # time spent preempted, all preemptions together
    suspended_state: SavedState | None = None  # a preempted lane's saved KV state (runner.Lane), until it resumes
    reasoning: ReasoningSplitter | None = None  # a thinking model's answer: its reasoning kept apart
    output_reasoning: str = ""
    reasoning_tokens: int = 0  # answer tokens generated inside a thinking block
    thinking_budget: int | None = None  # past this many, the engine closes the block (Thinking.budget_tokens)
    continues_conversation: bool = False  # its messages hold an earlier answer: a round (slo.py)
    origin: str | None = None  # where it came from, as its client says (a notebook cell, a batch row...)
    tenant: str | None = None  # the API key it came with, where a server has several (its own cache scope)
    prompt_head: str | None = None  # the first words it asks, for the panel (prompt_head())

    @property
    def cache_tokens(self) -> list[int]:
        """Its prompt as the prefix cache knows it: see `scoped_tokens`."""
        return scoped_tokens(self.prompt_tokens, self.cache_scope)

    @property
    def kv_cells(self) -> int:
        """The most cells it can ever hold: its prompt and every token it may generate."""
        return len(self.prompt_tokens) + self.max_tokens

    @property
    def context_tokens(self) -> list[int]:
        """The tokens whose cells must be in the cache before its next step: the prompt, then every
        generated token but the last, which the next decode feeds. Running, all but a preempted
        request's are; after a preemption they are computed again (or copied, or restored)."""
        return self.prompt_tokens + self.output_tokens[:-1] if self.output_tokens else self.prompt_tokens

    @property
    def cache_context_tokens(self) -> list[int]:
        """`context_tokens` as the prefix cache knows them: see `scoped_tokens`."""
        return scoped_tokens(self.context_tokens, self.cache_scope)

    @property
    def prompt_done(self) -> bool:
        """Its context is in the cache: the next step decodes (for a new request, its prompt is computed)."""
        return self.num_computed_tokens >= len(self.prompt_tokens) + max(0, len(self.output_tokens) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_counts(self) -> TokenCounts:
        return TokenCounts(len(self.prompt_tokens), self.cached_tokens, len(self.output_tokens), self.reasoning_tokens)

    def timings(self) -> Timings:
        t = Timings(load_ms=self.load_ms)
        if self.preemptions:
            t.preempted_ms = self.preempted_seconds * 1000
        if self.admitted_time is not None:
            t.queued_ms = (self.admitted_time - self.arrival_time) * 1000
        if self.first_token_time is not None:
            t.ttft_ms = (self.first_token_time - self.arrival_time) * 1000
            if self.admitted_time is not None:
                t.prompt_ms = (self.first_token_time - self.admitted_time) * 1000
        if self.finished_time is not None:
            t.total_ms = (self.finished_time - self.arrival_time) * 1000
            if self.first_token_time is not None:
                t.decode_ms = (self.finished_time - self.first_token_time) * 1000
                later_tokens = len(self.output_tokens) - 1
                if later_tokens > 0 and t.decode_ms > 0:
                    t.decode_tokens_per_s = later_tokens / (t.decode_ms / 1000)
        return t


PROMPT_HEAD_CHARS = 60


def prompt_head(prompt: str | None, messages: Any) -> str | None:
    """The first words of a request's question (its last user message, or its prompt), for the panel
    to show on hover: at most PROMPT_HEAD_CHARS, cut at a word, whitespace folded."""
    text = prompt
    if isinstance(messages, list):
        text = next(
            (_message_text(m) for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), None
        )
    if not text:
        return None
    words = " ".join(text.split())
    if len(words) <= PROMPT_HEAD_CHARS:
        return words
    return words[:PROMPT_HEAD_CHARS].rsplit(" ", 1)[0] + "…"


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""
