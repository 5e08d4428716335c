"""A fake model runner for scheduler and engine-loop unit tests (in addition to the real model tests)."""

from __future__ import annotations

import time

from magnitude_jupyter.engine.request import SamplingParams
from magnitude_jupyter.engine.scheduler import DecodeItem
from magnitude_jupyter.engine.streams import TokenLogprob

EOG = 0


class FakeRunner:
    """Each sequence 'generates' prompt[-1]+1, +2, ... and never ends on its own unless told to.

    Records every decode call, so tests can see how the engine batched the work.
    """

    def __init__(self, n_ctx: int = 256, n_ctx_train: int = 1024, step_seconds: float = 0.002) -> None:
        self.step_seconds = step_seconds  # a little time per decode, like a model (lets tests cancel mid-way)
        self.n_ctx = n_ctx
        self.n_ctx_train = n_ctx_train
        self.bos_token = ""
        self.eos_token = ""
        self.calls: list[list[DecodeItem]] = []
        self.copies: list[tuple[int, int, int]] = []
        self.cells: dict[int, int] = {}
        self.next_token: dict[int, int] = {}
        self.closed = False

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [int(w) for w in text.split()]

    def token_to_piece(self, token: int) -> bytes:
        return f"{token} ".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def start_sequence(self, seq_id: int, params: SamplingParams, prompt_tokens: list[int]) -> None:
        self.next_token[seq_id] = prompt_tokens[-1] + 1

    def check_grammar(self, grammar: str) -> bool:
        return "root" in grammar

    def end_sequence(self, seq_id: int) -> None:
        self.cells.pop(seq_id, None)
        self.next_token.pop(seq_id, None)

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self.copies.append((src_seq, dst_seq, length))
        self.cells[dst_seq] = self.cells.get(dst_seq, 0) + length

    def sequence_length(self, seq_id: int) -> int:
        return self.cells.get(seq_id, 0)

    def decode(self, items: list[DecodeItem]) -> list[int | None]:
        self.calls.append(list(items))
        time.sleep(self.step_seconds)
        rows: list[int | None] = []
        n = 0
        for item in items:
            self.cells[item.seq_id] = self.cells.get(item.seq_id, 0) + len(item.tokens)
            n += len(item.tokens)
            rows.append(n - 1 if item.want_logits else None)
        return rows

    def sample(self, seq_id: int, row: int) -> int:
        token = self.next_token[seq_id]
        self.next_token[seq_id] = token + 1
        return token

    def token_logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        return TokenLogprob(self.token_to_piece(token), 0.0, ((self.token_to_piece(token), 0.0),) * min(top_n, 1))

    def set_threads(self, n_threads: int) -> None:
        self.threads = n_threads

    def close(self) -> None:
        self.closed = True
