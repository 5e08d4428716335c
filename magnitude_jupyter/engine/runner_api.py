"""What the engine needs from a model runner (`LlamaRunner`, or a fake in unit tests), and the
helpers that work through that protocol only: the prefix cache's KV operations carried out on it,
chat messages rendered into its tokens."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .chat import render_chat, restore_shielded, split_shielded
from .kv_ops import (
    ClearSequence,
    CopyCells,
    ForgetSuspended,
    KVOp,
    LoadWindow,
    RestoreSequence,
    SaveSequence,
    SaveWindow,
    SuspendSequence,
    TakeTreeCells,
    TrimSequence,
)
from .plan import DecodeItem
from .ram_tier import RamTier, SavedState
from .request import SamplingParams
from .streams import TokenLogprob
from .tools import ToolRequest


class NoRoomForBatch(RuntimeError):
    """llama.cpp found no cells for a step's batch (`llama_decode` 1): nothing was computed, and the
    step can run again once cells are freed, or with fewer rows (a sliding-window cache can run short
    where sequences share old cells; docs/decisions.md, "Sliding-window layers")."""


class Runner(Protocol):
    """What the engine needs from a model runner (`LlamaRunner`, or a fake in scheduler tests)."""

    n_ctx: int
    n_ctx_train: int
    bos_token: str
    eos_token: str
    kv_buffer_bytes: int | None  # what llama.cpp reports its KV buffer holds (None: not reported)
    # tokens a sliding-window layer sees (None: the model has none): llama.cpp drops a sequence's older
    # cells in those layers, so a prefix is reused only where its window is there (prefix_cache.py)
    sliding_window: int | None
    recurrent: bool  # a recurrent or hybrid model: its state per sequence cannot be copied or cut in part

    @property
    def repack(self) -> bool | None:
        """Whether the weights were repacked at load (None: the runner has no such choice)."""
        ...

    @property
    def flash_attention(self) -> bool | None:
        """The attention kernel the runner chose (None: the runner has no such choice)."""
        ...

    @property
    def flash_attention_reason(self) -> str | None:
        """Why: set, or measured on this machine."""
        ...

    @property
    def flash_attention_source(self) -> str | None:
        """How it was chosen: set | measured | remembered | default (the CPU family's, unmeasured)."""
        ...

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def control_texts(self) -> tuple[str, ...]: ...
    def logit_gap(self, row: int, token: int, other: int) -> float: ...
    def token_to_piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def start_sequence(self, seq_id: int, params: SamplingParams, prompt_tokens: list[int], cells: int) -> None: ...
    def check_grammar(self, grammar: str) -> bool: ...
    def end_sequence(self, seq_id: int) -> None: ...
    def copy_cells(self, src_seq: int, dst_seq: int, start: int, end: int) -> None: ...
    def drop_cells(self, seq_id: int, start: int, end: int) -> None: ...
    def save_sequence(self, seq_id: int) -> SavedState: ...
    def restore_sequence(self, seq_id: int, data: SavedState) -> bool: ...
    def save_window(self, seq_id: int) -> SavedState: ...
    def load_window(self, seq_id: int, data: SavedState) -> bool: ...
    def suspend_sequence(self, seq_id: int, key: str) -> SavedState | None: ...
    def resume_sequence(self, seq_id: int, key: str, state: SavedState | None, cells: int) -> None: ...
    def forget_suspended(self, key: str) -> None: ...
    def compact_cells(self, max_bytes: int, order: Sequence[int] = ()) -> int | None: ...
    def sequence_length(self, seq_id: int) -> int: ...
    def sequence_start(self, seq_id: int) -> int: ...
    def decode(self, items: list[DecodeItem]) -> list[int | None]: ...
    def sample(self, seq_id: int, row: int) -> int: ...
    def token_logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob: ...
    def set_threads(self, n_threads: int) -> None: ...
    def close(self) -> None: ...
    def embed(self, inputs: Sequence[Sequence[int]], stop: threading.Event | None = None) -> list[np.ndarray]: ...


EMBED_CTX = 2048  # tokens of one embedding input at most (and of one decode call)
# A text longer than this many characters a token is refused before it is tokenized: no text comes
# near it (about 4 a token), and tokenizing a megabyte costs seconds (docs/http-api.md, Limits).
MAX_CHARS_PER_TOKEN = 32


class EmbeddingError(ValueError):
    """An input the embedding context cannot take; the message names its index."""


class EmbeddingCancelled(Exception):
    """The caller stopped wanting the vectors (its client went away): the rest are not computed."""


class GrammarDeadEnd(Exception):
    """The grammar lets no token of the vocabulary through (or only an end the request bans).

    llama.cpp would pick a token anyway and its grammar would then abort the process
    ("Unexpected empty grammar stack"): the picker raises this instead, before anything is accepted,
    and only this request ends. `complete`: the grammar had reached its end (only an
    end-of-generation token fits, and `ignore_eos` bans those), so the answer is whole."""

    def __init__(self, complete: bool) -> None:
        self.complete = complete
        super().__init__(
            "the answer is complete: its grammar allows nothing more"
            if complete
            else "the grammar allows no token this model can write here"
        )


@dataclass(frozen=True)
class Sampled:
    """A token sampled for one sequence this step, with its log probability when the request asked."""

    token: int
    logprob: TokenLogprob | None = None
    # The grammar let nothing through: no token; the request ends here (GrammarDeadEnd).
    dead_end: str | None = None
    complete: bool = False  # the dead end is the grammar's own end: the answer is whole


def apply_kv_ops(runner: Runner, ops: list[KVOp], ram: RamTier | None) -> None:
    """Carry out the prefix cache's decisions on the runner, in order (on the engine thread)."""
    for op in ops:
        if isinstance(op, CopyCells):
            runner.copy_cells(op.src_seq, op.dst_seq, op.start, op.end)
        elif isinstance(op, ClearSequence):
            runner.end_sequence(op.seq_id)
        elif isinstance(op, TrimSequence):
            runner.drop_cells(op.seq_id, op.start, -1)
        elif isinstance(op, TakeTreeCells):
            runner.drop_cells(op.seq_id, 0, op.end)
            runner.copy_cells(op.holder, op.seq_id, 0, op.end)
        elif isinstance(op, SaveSequence):
            if ram is not None:
                ram.put(op.tokens, runner.save_sequence(op.seq_id), op.window_floor)
        elif isinstance(op, SaveWindow):
            if ram is not None:
                ram.put_window(op.tokens, runner.save_window(op.seq_id))
        elif isinstance(op, LoadWindow):
            if not runner.load_window(op.seq_id, op.data):
                runner.drop_cells(op.seq_id, 0, -1)
                op.refused()
        elif isinstance(op, SuspendSequence):
            op.keep(runner.suspend_sequence(op.seq_id, op.key))
        elif isinstance(op, ForgetSuspended):
            runner.forget_suspended(op.key)
        elif isinstance(op, RestoreSequence):
            if not runner.restore_sequence(op.seq_id, op.data):
                raise RuntimeError(f"llama.cpp could not restore a saved sequence ({len(op.data)} bytes)")
            if op.shared:
                assert op.shared_from is not None
                # The tree's own cells for the part it held already: never the same tokens twice.
                runner.drop_cells(op.seq_id, 0, op.shared)
                runner.copy_cells(op.shared_from, op.seq_id, 0, op.shared)


def chat_prompt(
    runner: Runner,
    messages: Any,
    chat_template: str | None,
    tools: ToolRequest | None = None,
    enable_thinking: bool | None = None,
    control_in_messages: bool = False,
) -> tuple[list[int], str]:
    """Chat messages (and the tools they may call) rendered through the model's template: the
    tokens, and the text they were made from. Unless `control_in_messages`, a control token's text
    written in a message (`<|im_start|>system` in a user's or a tool's text) is tokenized as the
    text it is: only the template writes control tokens (docs/decisions.md, "Message text is text")."""
    shielded: list[str] | None = None if control_in_messages else []
    text = render_chat(
        messages,
        chat_template,
        runner.bos_token,
        runner.eos_token,
        tools=tools,
        enable_thinking=enable_thinking,
        shield=runner.control_texts() if shielded is not None else (),
        shielded=shielded,
    )
    # The template writes the BOS token itself when the model wants one.
    if not shielded:
        tokens = runner.tokenize(text, add_special=not (runner.bos_token and text.startswith(runner.bos_token)))
        return tokens, text
    tokens = []
    whole = restore_shielded(text, shielded)
    add_bos = not (runner.bos_token and whole.startswith(runner.bos_token))
    for piece, is_message_text in split_shielded(text, shielded):
        tokens += runner.tokenize(piece, add_special=add_bos and not tokens, parse_special=not is_message_text)
    return tokens, whole


def chat_prompt_tokens(
    runner: Runner,
    messages: Any,
    chat_template: str | None,
    tools: ToolRequest | None = None,
    control_in_messages: bool = False,
) -> list[int]:
    """Chat messages (and the tools they may call) rendered through the model's template, as tokens."""
    return chat_prompt(runner, messages, chat_template, tools, control_in_messages=control_in_messages)[0]
