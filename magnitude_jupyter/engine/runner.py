"""The only module that touches llama.cpp: one context, many sequences, per-sequence samplers.

One `llama_decode` takes the tokens of every scheduled sequence (each with its own seq id and
positions); llama.cpp's sampler chains then sample each sequence from its own logits row. A
reproducible request decodes apart, in a small context of its own on the same weights (`Lane`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from ..config import KV_CACHE_TYPES
from . import attention_probe
from .embeddings import Embedder
from .kv_state import grouped_by_sequence
from .memory import KV_PADDING
from .plan import DecodeItem
from .ram_tier import SavedState
from .request import SamplingParams
from .runner_api import NoRoomForBatch
from .sampling import TokenPicker
from .streams import TokenLogprob
from .threads import others_cores_now

log = logging.getLogger("magnitude.runner")
_backend_ready = False
_KV_BUFFER_RE = re.compile(rb"KV buffer size\s*=\s*([\d.]+) MiB")
_COMPUTE_BUFFER_RE = re.compile(rb"compute buffer size\s*=\s*([\d.]+) MiB")
_kv_buffer_mib: list[float] = []  # what llama.cpp reported for the KV cache(s) of the last context
_compute_buffer_mib: list[float] = []  # ... and for its compute buffer(s)


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # Read the KV buffer size llama.cpp allocates (calibration checks the arithmetic against it),
    # then hand the line to llama-cpp-python's own logger, which prints it or not.
    match = _KV_BUFFER_RE.search(text)
    if match:
        _kv_buffer_mib.append(float(match.group(1)))
    match = _COMPUTE_BUFFER_RE.search(text)
    if match:
        _compute_buffer_mib.append(float(match.group(1)))
    import llama_cpp._logger as llama_logger

    llama_logger.llama_log_callback(level, text, user_data)


class RunnerError(RuntimeError):
    pass


GGML_TYPES = {name: getattr(llama_cpp, f"GGML_TYPE_{name.upper()}") for name in KV_CACHE_TYPES}


def load_mode(mlock: bool, mmap: bool | None) -> int:
    """llama.cpp's load mode for the weights: mapped from the file and/or locked in RAM."""
    if mmap is None and not mlock:
        return int(llama_cpp.LLAMA_LOAD_MODE_AUTO)  # llama.cpp's own choice, as before these settings
    if mmap is False:
        return int(llama_cpp.LLAMA_LOAD_MODE_MLOCK if mlock else llama_cpp.LLAMA_LOAD_MODE_NONE)
    return int(llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK if mlock else llama_cpp.LLAMA_LOAD_MODE_MMAP)


def gpu_offload_supported() -> bool:
    """Whether this build of llama.cpp can put layers on a GPU (a CPU build ignores `gpu_layers`)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


def repack_weights(setting: bool | None) -> bool:
    """Whether llama.cpp may lay the weights out in its extra CPU buffer types (repacked blocks, AMX
    tiles): the `repack` setting, or by default on, unless this build compiled llama.cpp's AMX kernels.

    The pinned llama.cpp builds its AMX tile configuration on the stack, and GCC (12, Debian's and
    this project's CI) drops the stores that fill it in, so a prompt long enough for those kernels
    dies of SIGILL on a CPU with AMX (64 tokens did, test_runner.py; llama.cpp PR 26954). The CPU's
    plain AVX-512 kernels compute the same products; repacking also covers Q4_0/Q4_K layouts, which
    a build with working AMX (`repack: true`) keeps.
    """
    if setting is not None:
        return setting
    return b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def _map_large_blocks() -> None:
    """Serve every block of 1 MiB or more with its own mapping, returned to the OS when freed.

    glibc raises its mmap threshold each time a mapped block is freed, after which the prefix cache's
    saved sequences come from the heap and fragment it (docs/decisions.md). A no-op off glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    import llama_cpp._logger as llama_logger  # installs llama-cpp-python's log callback

    llama_logger.logger.setLevel(logging.DEBUG if verbose else logging.ERROR)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    if not _backend_ready:
        _map_large_blocks()
        llama_cpp.llama_backend_init()
        _backend_ready = True


LANE_BATCH = 64  # a lane's largest step: reproducible prompts go in chunks of 63 (scheduler.REPRODUCIBLE_CHUNK)


class Lane:
    """A reproducible request's own llama.cpp context, with the main one's attention kernel: its cells
    lie in order, nothing else's among them, so its tokens never depend on what else runs."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.batch = llama_cpp.llama_batch_init(LANE_BATCH, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


class LlamaRunner:
    """A loaded model and one context with `n_seq_max` sequences over a unified KV cache, plus a lane
    (a small context of its own) for each running reproducible request."""

    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: int = 2,
        gpu_layers: int = 0,
        cache_types: tuple[str, str] = ("f16", "f16"),
        mlock: bool = False,
        mmap: bool | None = None,
        repack: bool | None = None,
        flash_attention: bool | None = True,
        verbose: bool = False,
        stop_tokens: frozenset[int] = frozenset(),
        full_windows: bool = False,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        """`on_phase`: told what the load is doing, as it goes (progress for whoever waits on it).
        `flash_attention` None: measured now, on this machine (attention_probe.py); `stop_tokens`: the
        chat format's turn ends, end of generation beside llama.cpp's own (chat_formats.py); `n_batch`:
        the most tokens a step decodes, computed `n_ubatch` at a time;
        `full_windows`: sliding-window layers keep every cell (llama.cpp's swa_full), else a window
        per sequence (kvmath.py)."""
        _init_backend(verbose)
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = gpu_layers
        mparams.load_mode = load_mode(mlock, mmap)
        self.repack = repack_weights(repack)
        mparams.use_extra_bufts = self.repack
        if repack is None and not self.repack:
            log.info("weight repacking off: this build has llama.cpp's AMX kernels, which crash (engine.repack)")
        if gpu_layers and not gpu_offload_supported():
            log.warning("gpu_layers=%d ignored: this build of llama-cpp-python has no GPU support", gpu_layers)
        self._phase = on_phase or (lambda phase: None)

        def loading(fraction: float, user_data: Any) -> bool:
            self._phase(f"reading the model file ({fraction:.0%})")
            return True

        self._progress = llama_cpp.llama_progress_callback(loading)  # kept: llama.cpp holds a pointer to it
        mparams.progress_callback = self._progress
        self._phase("reading the model file")
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RunnerError(f"llama.cpp could not load the model file {model_path}")
        self.cache_types = cache_types
        self._n_threads = n_threads
        self._full_windows = full_windows
        self._n_ubatch = n_ubatch
        n_swa = int(llama_cpp.llama_model_n_swa(self.model))
        self.sliding_window: int | None = n_swa if n_swa > 0 else None
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model)
        )
        self.flash_attention, self.flash_attention_reason, self.flash_attention_source = self._choose_attention(
            model_path, flash_attention, n_ctx, n_seq_max, n_batch
        )
        self._phase(f"making the KV cache ({n_ctx:,} cells)")
        flash_attention = self.flash_attention
        _kv_buffer_mib.clear()
        _compute_buffer_mib.clear()
        # One cache shared by all sequences: a long request may use most of it, many short ones share it.
        self.ctx = self._new_context(n_ctx, n_seq_max, n_batch, flash_attention)
        self.kv_buffer_bytes: int | None = round(sum(_kv_buffer_mib) * 2**20) if _kv_buffer_mib else None
        # The last reservation llama.cpp logs is the one it keeps.
        self.compute_buffer_bytes: int | None = round(_compute_buffer_mib[-1] * 2**20) if _compute_buffer_mib else None
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            types = "" if cache_types == ("f16", "f16") else f" with a {'/'.join(cache_types)} KV cache (K/V)"
            raise RunnerError(
                f"llama.cpp could not create a context of {n_ctx} tokens x {n_seq_max} sequences{types}"
                + (" (llama.cpp's log says why: run with --verbose)" if not verbose else "")
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.bos_token = self._special_text(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_token = self._special_text(llama_cpp.llama_vocab_eos(self.vocab))
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.picker = TokenPicker(self.vocab, self.n_vocab, self.n_ctx, stop_tokens)
        self._embedder: Embedder | None = None
        self._embedder_lock = threading.Lock()
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}
        self._control_texts = self._read_control_texts()
        self._lanes: dict[int, Lane] = {}
        self._cells_freed = False  # a removal since the last compaction (compact_cells)
        self._last_ctx = self.ctx  # where the last decode's logits are
        self._closed = False

    def _new_context(
        self, n_ctx: int, n_seq_max: int, n_batch: int, flash_attention: bool, full_windows: bool | None = None
    ) -> Any:
        """A context on the loaded weights (the main one, a lane, or the attention probe's)."""
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, self._n_ubatch)
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = self._n_threads
        cparams.n_threads_batch = self._n_threads
        cparams.kv_unified = True
        cparams.swa_full = self._full_windows if full_windows is None else full_windows
        enabled, disabled = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.flash_attn_type = enabled if flash_attention else disabled
        cparams.type_k, cparams.type_v = (GGML_TYPES[t] for t in self.cache_types)
        cparams.no_perf = True
        return llama_cpp.llama_init_from_model(self.model, cparams)

    def _probe_context(self, n_ctx: int, n_seq_max: int, n_batch: int, flash_attention: bool) -> Any:
        """The attention probe's context, with the engine's own window settings: it measures the
        attention the engine will run (a window per sequence, unless `swa_full`)."""
        return self._new_context(n_ctx, n_seq_max, n_batch, flash_attention)

    def _choose_attention(
        self, model_path: str | Path, given: bool | None, n_ctx: int, n_seq_max: int, n_batch: int
    ) -> tuple[bool, str, str]:
        """(flash attention, why, how it was chosen: set | remembered | measured | default)."""
        if given is not None:
            return given, f"flash attention {'on' if given else 'off'}: set", "set"
        cells = min(attention_probe.PROBE_CELLS, n_ctx)
        rows = max(1, min(attention_probe.PROBE_ROWS, n_seq_max))
        key = f"{attention_probe.probe_key(model_path, self.cache_types)}|{cells}x{rows}"
        choice = attention_probe.remembered(key)
        if choice is not None:
            reason = choice.reason.replace("measured at load", "measured at an earlier load")
            return choice.flash_attention, reason, "remembered"
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        default, family = attention_probe.default_flash_attention()

        def defaulted(why: str) -> tuple[bool, str, str]:
            kind = "on" if default else "off"
            log.warning(
                "%s: flash attention %s, the default for %s; measured again at the next load", why, kind, family
            )
            return (
                default,
                f"flash attention {kind}: the default for {family} ({why}; measured at the next load)",
                "default",
            )

        def progress(done: int, total: int) -> None:
            self._phase(f"measuring the attention kernels (step {done} of {total})")

        self._phase("measuring the attention kernels")
        others = others_cores_now()  # the probe does not start where what it measured would not be kept
        if others > attention_probe.CONTENDED_CORES:
            return defaulted(
                f"the machine was busy (other processes used {others:.1f} cores), so the probe did not run"
            )
        try:
            choice = attention_probe.measure(self._probe_context, n_vocab, cells, rows, n_batch, on_step=progress)
        except attention_probe.ProbeNotTrusted as exc:
            return defaulted(str(exc))
        except RuntimeError as exc:  # the model still loads, with the family's default
            return defaulted(f"the probe failed: {exc}")
        if not choice.trusted:
            return defaulted(
                f"the machine was busy while the probe measured (other processes used {choice.others_cores:.1f} "
                f"cores, steps {choice.spread:.1f}x apart)"
            )
        attention_probe.remember(key, choice)
        return choice.flash_attention, choice.reason, "measured"

    def control_texts(self) -> tuple[str, ...]:
        """The text of every control token of the vocabulary (`<|im_start|>`, `<start_of_turn>`...):
        what the tokenizer turns into a control token when it parses special tokens."""
        return self._control_texts

    def _read_control_texts(self) -> tuple[str, ...]:
        """Read at load, in a fixed order: a scan of the whole vocabulary, kept off the first
        request's time to its first token."""
        control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        texts = {
            self._special_text(token)
            for token in range(self.n_vocab)
            if llama_cpp.llama_vocab_get_attr(self.vocab, token) & control
        }
        return tuple(sorted(t for t in texts if t.strip()))

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    # -- text ----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            raise RunnerError("tokenization failed")
        return list(buf[:n])

    def token_to_piece(self, token: int) -> bytes:
        """A token's bytes, kept once read: the prefix cache spells hundreds per admission (its
        respelling), and the vocabulary bounds what is kept."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._read_piece(token)
        return piece

    def _read_piece(self, token: int) -> bytes:
        buf = self._piece_buf
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return self.picker.is_eog(token)

    # -- sequences -------------------------------------------------------------------------

    def start_sequence(self, seq_id: int, params: SamplingParams, prompt_tokens: Sequence[int], cells: int) -> None:
        """Build the sequence's sampler (the prompt primes the repetition penalty), and a lane of
        `cells` for a reproducible request."""
        self.picker.free(seq_id)
        if params.reproducible:
            self._open_lane(seq_id, cells)
        try:
            self.picker.start(seq_id, params, prompt_tokens)
        except ValueError as exc:
            raise RunnerError(str(exc)) from None

    def _open_lane(self, seq_id: int, cells: int) -> None:
        self._close_lane(seq_id)
        n_ctx = -(-cells // KV_PADDING) * KV_PADDING
        ctx = self._new_context(n_ctx, 1, LANE_BATCH, self.flash_attention)
        if not ctx:
            raise RunnerError(f"llama.cpp could not create a lane of {n_ctx} cells for a reproducible request")
        _kv_buffer_mib.clear()  # read for the main context only
        _compute_buffer_mib.clear()
        self._lanes[seq_id] = Lane(ctx)

    def _close_lane(self, seq_id: int) -> None:
        lane = self._lanes.pop(seq_id, None)
        if lane is not None:
            if self._last_ctx is lane.ctx:
                self._last_ctx = self.ctx
            lane.close()

    @property
    def lanes(self) -> int:
        """Lanes open: reproducible requests running."""
        return len(self._lanes)

    def check_grammar(self, grammar: str) -> bool:
        """Whether llama.cpp parses this GBNF grammar (with a `root` rule)."""
        sampler = self.picker.grammar_sampler(grammar)
        if sampler is None:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def end_sequence(self, seq_id: int) -> None:
        """Give the sequence's KV cells (or its lane) back at once, and drop its sampler."""
        if seq_id in self._lanes:
            self._close_lane(seq_id)
        else:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            self._cells_freed = True
        self.picker.free(seq_id)

    def copy_cells(self, src_seq: int, dst_seq: int, start: int, end: int) -> None:
        """Let `dst_seq` share the cells of positions [start, end) of `src_seq` (no copy in a unified cache)."""
        llama_cpp.llama_memory_seq_cp(self.memory, src_seq, dst_seq, start, end)

    def drop_cells(self, seq_id: int, start: int, end: int) -> None:
        """Take positions [start, end) out of `seq_id` (end -1: to its end; cells other sequences hold stay)."""
        lane = self._lanes.get(seq_id)
        if lane is not None:
            llama_cpp.llama_memory_seq_rm(lane.memory, 0, start, end)
        else:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, start, end)
            self._cells_freed = True

    def save_sequence(self, seq_id: int) -> bytearray:
        """The KV state of one sequence (for the prefix cache's RAM tier). llama.cpp writes it straight
        into the bytearray kept: no copy out of a ctypes array (docs/decisions.md)."""
        return _save_state(self.ctx, seq_id)

    def restore_sequence(self, seq_id: int, data: SavedState) -> bool:
        """Load a saved state into an empty sequence; False if llama.cpp could not place it. llama.cpp
        reads a saved bytearray in place (docs/decisions.md)."""
        return _restore_state(self.ctx, seq_id, data)

    def compact_cells(self, max_bytes: int, order: Sequence[int] = ()) -> int | None:
        """Move every cell in use to the front of the main context's KV cache: llama.cpp's whole-cache
        state, saved and loaded back, fills cells from the first (compaction.py), the cells of each
        sequence of `order` in turn, by position, then the others in their order (kv_state.py). The
        bytes moved; None when no cell was freed since the last time, the state is over `max_bytes`, or
        the model keeps a recurrent state (its memory has no cells to move)."""
        if not self._cells_freed or self.recurrent:
            return None
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, -1, 0))
        if size > max_bytes:
            return None
        state = _save_state(self.ctx, -1, size=size)
        grouped = grouped_by_sequence(state, order) if order else None
        if grouped is not None and _restore_state(self.ctx, -1, grouped):
            self._cells_freed = False
            return len(state)
        if not _restore_state(self.ctx, -1, state):
            raise RunnerError(f"llama.cpp could not load the KV cache's own state back ({len(state)} bytes)")
        self._cells_freed = False
        return len(state)

    def save_window(self, seq_id: int) -> bytearray:
        """The state of one sequence's sliding-window layers only: a window checkpoint (ram_tier.py)."""
        return _save_state(self.ctx, seq_id, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

    def load_window(self, seq_id: int, data: SavedState) -> bool:
        """Load a window checkpoint in place of the sequence's windowed cells (its global layers' cells
        stay); False if llama.cpp could not place it, the windowed cells then gone."""
        return _restore_state(self.ctx, seq_id, data, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

    def suspend_sequence(self, seq_id: int, key: str) -> SavedState | None:
        """Take a preempted request's sequence off: its sampler is kept under `key`; a lane's KV state
        is saved and returned, and the lane closed; in the main context its cells are given back (the
        prefix cache has kept what it wants of them first)."""
        self.picker.park(seq_id, key)
        lane = self._lanes.get(seq_id)
        if lane is None:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
            self._cells_freed = True
            return None
        state = _save_state(lane.ctx, 0)
        self._close_lane(seq_id)
        return state

    def resume_sequence(self, seq_id: int, key: str, state: SavedState | None, cells: int) -> None:
        """Give a preempted request's sampler back to `seq_id`, and a lane of `cells` holding `state`
        to one that had a lane; the main context's cells come back through the prefix cache."""
        self.picker.unpark(key, seq_id)
        if state is None:
            return
        self._open_lane(seq_id, cells)
        if not _restore_state(self._lanes[seq_id].ctx, 0, state):
            raise RunnerError(f"llama.cpp could not restore a preempted lane ({len(state)} bytes)")

    def forget_suspended(self, key: str) -> None:
        """A preempted request ended without resuming: its kept sampler goes."""
        self.picker.forget(key)

    def sequence_length(self, seq_id: int) -> int:
        """Tokens this sequence holds in the KV cache (0 when empty)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)) + 1

    def sequence_start(self, seq_id: int) -> int:
        """The first position this sequence holds in every layer: its sliding-window layers drop older
        cells when llama.cpp needs room (-1 when it holds none)."""
        return int(llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id))

    # -- compute ---------------------------------------------------------------------------

    def decode(self, items: Sequence[DecodeItem]) -> list[int | None]:
        """One `llama_decode` over all items; returns, per item, the batch row of its logits (or None).
        An item with a draft has a row for each of its last `draft + 1` tokens: the first is returned,
        the others follow it. A reproducible request's item is decoded alone, in its lane."""
        lane = self._lanes.get(items[0].seq_id) if items else None
        if lane is not None and len(items) > 1:
            raise RunnerError("a reproducible request's step decodes alone, in its lane")
        ctx, batch, n_batch = (lane.ctx, lane.batch, LANE_BATCH) if lane else (self.ctx, self._batch, self.n_batch)
        n = 0
        rows: list[int | None] = []
        for item in items:
            if lane is None and item.seq_id in self._lanes:
                raise RunnerError("a reproducible request's step decodes alone, in its lane")
            seq_id = 0 if lane else item.seq_id
            pos = item.start_pos
            for token in item.tokens:
                if n >= n_batch:
                    raise RunnerError(f"a step of more than n_batch={n_batch} tokens")
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = 0
                pos += 1
                n += 1
            if item.want_logits and item.tokens:
                first = n - 1 - item.draft
                for row in range(first, n):
                    batch.logits[row] = 1
                rows.append(first)
            else:
                rows.append(None)
        batch.n_tokens = n
        if n == 0:
            return rows
        status = llama_cpp.llama_decode(ctx, batch)
        self._last_ctx = ctx
        if status == 1:
            raise NoRoomForBatch(f"llama.cpp found no KV cells for a batch of {n} tokens")
        if status != 0:
            raise RunnerError(f"llama_decode failed with status {status} ({n} tokens)")
        return rows

    def sample(self, seq_id: int, row: int) -> int:
        return self.picker.sample(seq_id, self._last_ctx, row, lambda: self._logits_view(row))

    def _logits_view(self, row: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._last_ctx, row)
        if not ptr:
            raise RunnerError(f"no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def logit_gap(self, row: int, token: int, other: int) -> float:
        """How far `token`'s logit stands above `other`'s in a logits row of the last decode."""
        logits = self._logits_view(row)
        return float(logits[token]) - float(logits[other])

    def token_logprobs(self, row: int, token: int, top_n: int) -> TokenLogprob:
        """`token`'s log probability in a logits row (the model's own distribution, before any sampler
        changes it), and the `top_n` most likely tokens there."""
        logits = self._logits_view(row).astype(np.float64)
        peak = logits.max()
        log_norm = peak + np.log(np.exp(logits - peak).sum())
        top: tuple[tuple[bytes, float], ...] = ()
        if top_n > 0:
            best = np.argpartition(logits, -top_n)[-top_n:]
            best = best[np.argsort(logits[best])[::-1]]
            top = tuple((self.token_to_piece(int(t)), float(logits[t] - log_norm)) for t in best)
        return TokenLogprob(self.token_to_piece(token), float(logits[token] - log_norm), top)

    def set_threads(self, n_threads: int) -> None:
        """Threads for the next decodes (llama.cpp reads it at each call), lanes' too."""
        self._n_threads = n_threads
        for ctx in [self.ctx, *(lane.ctx for lane in self._lanes.values())]:
            llama_cpp.llama_set_n_threads(ctx, n_threads, n_threads)

    def logits(self, row: int) -> np.ndarray:
        """A copy of one logits row of the last decode (tests and calibration read these)."""
        return self._logits_view(row).copy()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.picker.close()
        for seq_id in list(self._lanes):
            self._close_lane(seq_id)
        if self._embedder is not None:
            self._embedder.close()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def embed(self, inputs: Sequence[Sequence[int]], stop: threading.Event | None = None) -> list[np.ndarray]:
        """Pooled, normalized embeddings of token lists, in a context of their own (made on first use);
        callable from any thread but the engine's, beside generation. `stop`: see Embedder.embed."""
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = Embedder(self.model, self._n_threads, self.n_ctx_train)
        return self._embedder.embed(inputs, stop)


def _save_state(ctx: Any, seq_id: int, flags: int = 0, size: int | None = None) -> bytearray:
    """`size`: the state's size when the caller has asked llama.cpp for it already (a pass over every cell)."""
    if size is None:
        size = llama_cpp.llama_state_seq_get_size_ext(ctx, seq_id, flags)
    state = bytearray(size)
    buf = (ctypes.c_uint8 * size).from_buffer(state)
    written = llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, flags)
    del state[written:]
    return state


def _restore_state(ctx: Any, seq_id: int, data: SavedState | np.ndarray, flags: int = 0) -> bool:
    array = ctypes.c_uint8 * len(data)
    if isinstance(data, np.ndarray):
        buf = array.from_buffer(data.data)
    else:
        buf = array.from_buffer(data) if isinstance(data, bytearray) else array.from_buffer_copy(data)
    return bool(llama_cpp.llama_state_seq_set_data_ext(ctx, buf, len(data), seq_id, flags))


QUANTIZE_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "f16": "LLAMA_FTYPE_MOSTLY_F16"}


def requantize(source: str | Path, target: str | Path, weight_type: str = "q8_0", threads: int = 0) -> Path:
    """A copy of a model with its weights re-encoded (llama.cpp's quantizer; requantizing allowed): a
    second, different model made from one file in seconds, for comparisons, tests and workshops."""
    if weight_type not in QUANTIZE_TYPES:
        raise ValueError(f"weight type {weight_type!r}: choose one of {', '.join(QUANTIZE_TYPES)}")
    _init_backend(False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZE_TYPES[weight_type])
    params.allow_requantize = True
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RunnerError(f"llama.cpp could not re-encode {source} as {weight_type}")
    return Path(target)
