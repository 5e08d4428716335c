"""A fake model runner for scheduler and engine-loop unit tests (in addition to the real model tests)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence

from magnitude_jupyter.client.http import ClientError
from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.request import Priority, Request, SamplingParams
from magnitude_jupyter.engine.runner_api import NoRoomForBatch
from magnitude_jupyter.engine.streams import TokenLogprob

EOG = 0


class FakeRunner:
    """Each sequence 'generates' prompt[-1]+1, +2, ... and never ends on its own: the pick at a batch
    row is the token fed there plus one (so drafts are confirmed or not as a model's rows would be).

    It keeps KV cells the way llama.cpp's unified cache does: a cell holds one token at one position
    and belongs to any number of sequences; copying a range tags the same cells with another
    sequence; a cell is freed when no sequence holds it. Tests read `live_cells()` and `tokens_of()`.
    Records every decode call, so tests can see how the engine batched the work.
    """

    def __init__(self, n_ctx: int = 256, n_ctx_train: int = 1024, step_seconds: float = 0.002) -> None:
        self.step_seconds = step_seconds  # a little time per decode, like a model (lets tests cancel mid-way)
        self.n_ctx = n_ctx
        self.n_ctx_train = n_ctx_train
        self.kv_buffer_bytes: int | None = None
        self.sliding_window: int | None = None
        self.recurrent = False
        self.no_room_once = False  # the next decode finds no cells (tests of the engine's retry)
        self.room_for: int | None = None  # a decode of more tokens finds no cells (None: any fits)
        self.dead_ends: dict[int, bool] = {}  # token -> complete: sampling it finds a grammar dead end
        self.repack: bool | None = None
        self.flash_attention: bool | None = None
        self.flash_attention_reason: str | None = None
        self.flash_attention_source: str | None = None
        self.bos_token = ""
        self.eos_token = ""
        self.calls: list[list[DecodeItem]] = []
        self.copies: list[tuple[int, int, int, int]] = []
        self.seqs: dict[int, dict[int, int]] = {}  # seq id -> {position: cell id}
        self.cell_tokens: dict[int, int] = {}  # cell id -> token
        self._cell_ids = itertools.count()
        self.row_tokens: list[int] = []  # the token fed at each row of the last decode
        self.saved = 0
        self.restored = 0
        self.compactions = 0
        self.windows_loaded: list[int] = []  # load_window's seq ids, in order
        self.refuse_window_once = False  # the next load_window finds no cells (tests of the fallback)
        self.closed = False
        self.started: list[int] = []  # start_sequence's seq ids, in order
        self.resumed: list[int] = []  # resume_sequence's
        self.lanes: set[int] = set()  # reproducible requests' sequences (llama.cpp's runner: lanes)
        self.parked: set[str] = set()  # preempted requests' kept samplers, by request id

    # -- the cache, as llama.cpp keeps it ---------------------------------------------------------

    def live_cells(self) -> int:
        return len({cell for cells in self.seqs.values() for cell in cells.values()})

    def tokens_of(self, seq_id: int) -> list[int]:
        cells = self.seqs.get(seq_id, {})
        assert sorted(cells) == list(range(len(cells))), f"sequence {seq_id} has holes: {sorted(cells)}"
        return [self.cell_tokens[cells[pos]] for pos in range(len(cells))]

    def copy_cells(self, src_seq: int, dst_seq: int, start: int, end: int) -> None:
        self.copies.append((src_seq, dst_seq, start, end))
        src = self.seqs.get(src_seq, {})
        dst = self.seqs.setdefault(dst_seq, {})
        for pos in range(start, end):
            assert pos in src, f"sequence {src_seq} has no cell at {pos}"
            # llama.cpp tags the source's cell with the destination too: a destination that holds
            # another cell at that position then has two, and attention reads both.
            assert dst.get(pos, src[pos]) == src[pos], f"sequence {dst_seq} already has a cell at {pos}"
            dst[pos] = src[pos]

    def drop_cells(self, seq_id: int, start: int, end: int) -> None:
        cells = self.seqs.get(seq_id, {})
        for pos in [p for p in cells if start <= p and (p < end or end < 0)]:  # end < 0: to the end, as llama.cpp
            del cells[pos]

    def save_sequence(self, seq_id: int) -> bytes:
        self.saved += 1
        return json.dumps(self.tokens_of(seq_id)).encode()

    def restore_sequence(self, seq_id: int, data: bytes) -> bool:
        self.restored += 1
        self.seqs[seq_id] = {}
        for pos, token in enumerate(json.loads(data)):
            cell = next(self._cell_ids)
            self.cell_tokens[cell] = token
            self.seqs[seq_id][pos] = cell
        return True

    def save_window(self, seq_id: int) -> bytes:
        return json.dumps(self.tokens_of(seq_id)).encode()

    def load_window(self, seq_id: int, data: bytes) -> bool:
        if self.refuse_window_once:
            self.refuse_window_once = False
            return False
        # A checkpoint stands for the windowed cells of exactly the tokens the sequence holds.
        assert self.tokens_of(seq_id) == json.loads(data), "a window checkpoint loaded over other tokens"
        self.windows_loaded.append(seq_id)
        return True

    # -- the rest of a runner ---------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [int(w) for w in text.split()]

    def control_texts(self) -> tuple[str, ...]:
        return ()

    def logit_gap(self, row: int, token: int, other: int) -> float:
        return float("-inf")  # the fake model's picks are never near a tie

    def token_to_piece(self, token: int) -> bytes:
        return f"{token} ".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def start_sequence(self, seq_id: int, params: SamplingParams, prompt_tokens: list[int], cells: int) -> None:
        self.started.append(seq_id)
        if params.reproducible:
            self.lanes.add(seq_id)

    def suspend_sequence(self, seq_id: int, key: str) -> bytes | None:
        """As llama.cpp's runner: a lane's cells saved and returned, a main sequence's given back."""
        self.parked.add(key)
        state = self.save_sequence(seq_id) if seq_id in self.lanes else None
        self.lanes.discard(seq_id)
        self.end_sequence(seq_id)
        return state

    def resume_sequence(self, seq_id: int, key: str, state: bytes | None, cells: int) -> None:
        self.parked.remove(key)
        self.resumed.append(seq_id)
        if state is not None:
            self.lanes.add(seq_id)
            assert self.restore_sequence(seq_id, state)

    def forget_suspended(self, key: str) -> None:
        self.parked.discard(key)

    def check_grammar(self, grammar: str) -> bool:
        return "root" in grammar

    def end_sequence(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.lanes.discard(seq_id)

    def compact_cells(self, max_bytes: int, order: Sequence[int] = ()) -> int | None:
        self.compactions += 1  # cells here have no places: nothing to move
        return None

    def sequence_length(self, seq_id: int) -> int:
        return len(self.seqs.get(seq_id, {}))

    def sequence_start(self, seq_id: int) -> int:
        return min(self.seqs.get(seq_id) or {-1: 0})

    def decode(self, items: list[DecodeItem]) -> list[int | None]:
        if self.no_room_once:  # llama.cpp's 1: no cells for the batch, nothing computed
            self.no_room_once = False
            raise NoRoomForBatch("no KV cells for the batch")
        if self.room_for is not None and sum(len(item.tokens) for item in items) > self.room_for:
            raise NoRoomForBatch(f"no KV cells for a batch of more than {self.room_for} tokens")
        self.calls.append(list(items))
        time.sleep(self.step_seconds)
        rows: list[int | None] = []
        n = 0
        self.row_tokens = []
        for item in items:
            cells = self.seqs.setdefault(item.seq_id, {})
            # llama.cpp's own check: a sequence's new tokens continue right after its last position.
            last = max(cells, default=-1)
            assert item.start_pos == last + 1, f"sequence {item.seq_id} continues at {item.start_pos} after {last}"
            for offset, token in enumerate(item.tokens):
                cell = next(self._cell_ids)
                self.cell_tokens[cell] = token
                cells[item.start_pos + offset] = cell
            self.row_tokens.extend(item.tokens)
            n += len(item.tokens)
            rows.append(n - 1 - item.draft if item.want_logits else None)
        return rows

    def sample(self, seq_id: int, row: int) -> int:
        token = self.row_tokens[row] + 1
        if token in self.dead_ends:  # a grammar that lets nothing through here (runner_api.GrammarDeadEnd)
            from magnitude_jupyter.engine.runner_api import GrammarDeadEnd

            raise GrammarDeadEnd(complete=self.dead_ends[token])
        return token

    def token_logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        return TokenLogprob(self.token_to_piece(token), 0.0, ((self.token_to_piece(token), 0.0),) * min(top_n, 1))

    def set_threads(self, n_threads: int) -> None:
        self.threads = n_threads

    def close(self) -> None:
        self.closed = True


def fake_engine(**overrides) -> Engine:
    """A started engine on a FakeRunner (as `engine.fake`): 4 slots, 256 cells, steps of 16 tokens,
    unless overridden."""
    runner = FakeRunner(n_ctx=overrides.pop("n_ctx", 256), step_seconds=overrides.pop("step_seconds", 0.002))
    settings = {"parallel": 4, "ctx_size": 256, "n_batch": 16} | overrides
    engine = Engine(settings=Settings(), runner_factory=lambda es: runner, **settings)
    engine.fake = runner  # type: ignore[attr-defined]
    return engine.start()


def assert_cache_exact(runner: FakeRunner, cache) -> None:
    """Every leaf's sequence holds exactly its path's tokens, no sequence id the cache has free holds
    a cell, and the cache counts its cells exactly (with no request running)."""
    for leaf in cache.leaves():
        path, node = [], leaf
        while node is not cache.root:
            path = node.tokens + path
            node = node.parent
        assert runner.tokens_of(leaf.seq_id) == path
    assert not [seq for seq in cache.free_seq_ids if runner.seqs.get(seq)], "a free sequence id holds cells"
    assert cache.cells == runner.live_cells() == sum(len(n.tokens) for n in cache._nodes())


class RecordingClient:
    """A client that answers every chat at once with one short answer and keeps the messages it was
    sent: calibration's requests without a server, where only what goes out is under test."""

    ANSWER = "An answer."

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []
        self.origins: list[str | None] = []  # how each request names itself in the server's panel

    def stream_chat(self, messages, result=None, **body):
        self.sent.append([dict(m) for m in messages])
        self.origins.append(body.get("origin"))
        if result is not None:
            result.usage = {"prompt_tokens": 10, "completion_tokens": 1}
            result.text = self.ANSWER
        yield self.ANSWER

    def status(self):
        raise ClientError("not ours")  # as another server's: the sweep samples no /status


def make_request(
    rid: str, prompt_len: int = 4, max_tokens: int = 4, priority=Priority.INTERACTIVE, **params
) -> Request:
    """A request as the engine makes one, for scheduler tests: prompt tokens 1..prompt_len."""
    return Request(
        request_id=rid,
        prompt_tokens=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, **params),
        max_tokens=max_tokens,
        priority=priority,
    )
