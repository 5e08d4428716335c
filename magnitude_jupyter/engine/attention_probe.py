"""Flash attention on or off, measured on the machine the engine runs on (`flash_attention: null`).

Which of llama.cpp's CPU attention kernels is faster depends on the CPU and the context length:
flash attention wins at every length measured on an AVX2 EPYC and loses at long contexts on a Xeon
with AMX (docs/decisions.md, "Attention kernel"). So at load, before the main context is made, a
short probe decodes the same steps both ways, the kinds alternating: decode steps of `PROBE_ROWS`
sequences that share `PROBE_CELLS` cells, the same beside cells of their own, and prompt chunks of
`PROBE_CHUNK` tokens beside the cells in use. The kind that serves a reference workload faster
(`PROMPT_PER_OUTPUT` prompt tokens computed for each token generated) is kept. The result is
remembered per model file, machine and cache type (`remembered_path`), so a later load reads it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import llama_cpp

# The CPU time read before and after the probe (a module name of its own: the tests give it a fake clock).
from .threads import busy_and_own_seconds as _busy_seconds

log = logging.getLogger("magnitude.runner")

PROBE_CELLS = 1024  # cells each decode attends over: a conversation's worth of context
PROBE_ROWS = 16  # sequences decoded together, one row each: a busy server's step
PROBE_STEPS = 2  # timed steps per kind and round
PROBE_ROUNDS = 2  # rounds at least, the kinds alternating; each kind's fastest step counts
# Rounds go on while the timed rounds have taken less than this, up to PROBE_MAX_ROUNDS: a small
# model's steps last milliseconds, and two of each are OS noise (docs/decisions.md, "Attention kernel").
PROBE_TIMED_SECONDS = 2.0
PROBE_MAX_ROUNDS = 8
PROBE_CHUNK = 32  # tokens of a prompt chunk (the prompt shape): small, so that a large model's probe stays short
# Prompt tokens computed per output token in the reference workload the kinds are compared on: a
# conversation or an agent resends its history, and what the cache does not hold is computed again
# (docs/decisions.md, "Attention kernel").
PROMPT_PER_OUTPUT = 4.0
PROBE_FILL_SECONDS = 1.5  # filling the cells stops here, at what is filled (a large model on a small CPU)
PROBE_BUDGET_SECONDS = 10.0  # the whole probe, every phase: past it the CPU family's default runs
# Measured while other processes kept more than this many cores busy, or with a kind's steps this
# far apart, a result is not trusted: the default runs, and the next load measures again.
CONTENDED_CORES = 0.5
PROBE_VERSION = 3  # results remembered before the probe timed prompt chunks are measured again
NOISY_SPREAD = 1.5  # a kind's median step over its best: above it, the machine was busy while it measured


class ProbeNotTrusted(RuntimeError):
    """The probe ran out of its time, or measured a busy machine: its result is not used."""


def default_flash_attention() -> tuple[bool, str]:
    """The kind for this CPU family when nothing was measured (docs/decisions.md, "Attention kernel"):
    off where the CPU has AMX tiles (a Xeon whose matrix units make attention without it faster at
    long contexts), on elsewhere (an AVX2 EPYC's every workload ran faster with it)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    if "amx_tile" in flags.split():
        return False, "a CPU with AMX tiles"
    return True, f"{platform.machine() or 'this'} CPUs without AMX"


def remembered_path() -> Path:
    """Where probe results are kept (`MAGNITUDE_ATTENTION_FILE`, else ~/.magnitude/attention.json)."""
    return Path(os.environ.get("MAGNITUDE_ATTENTION_FILE") or Path.home() / ".magnitude" / "attention.json")


@dataclass(frozen=True)
class AttentionChoice:
    flash_attention: bool
    on_ms: float  # the reference workload's time per output token with flash attention (prompt and decode)
    off_ms: float  # ... without
    cells: int
    rows: int
    detail: str = ""  # each shape's step, on against off
    # The conditions it was measured in: cores other processes kept busy, and the widest ratio of a
    # kind's slowest timed step to its fastest.
    others_cores: float = 0.0
    spread: float = 1.0

    @property
    def trusted(self) -> bool:
        return self.others_cores <= CONTENDED_CORES and self.spread <= NOISY_SPREAD

    @property
    def reason(self) -> str:
        kind = "on" if self.flash_attention else "off"
        return (
            f"flash attention {kind}: measured at load, steps of {self.rows} rows over {self.cells} shared cells "
            f"and over {self.cells // max(1, self.rows)} cells each, and prompt chunks of {PROBE_CHUNK} tokens "
            f"beside them ({self.detail}; on against off; {PROMPT_PER_OUTPUT:g} prompt tokens an output token: "
            f"{self.on_ms:.2f} against {self.off_ms:.2f} ms)"
        )


def probe_key(model_path: str | Path, cache_types: tuple[str, str]) -> str:
    """What a remembered result holds for. Not the thread count: engines of one model on one machine
    then run the same kind, so a reproducible answer does not depend on how many threads ran it."""
    stat = Path(model_path).stat()
    parts = (str(Path(model_path).resolve()), str(stat.st_size), str(int(stat.st_mtime)))
    return "|".join((*parts, platform.machine(), _cpu_name(), "/".join(cache_types), f"v{PROBE_VERSION}"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def remembered(key: str) -> AttentionChoice | None:
    try:
        entry = json.loads(remembered_path().read_text()).get(key)
        return AttentionChoice(**entry) if entry else None
    except (OSError, ValueError, TypeError):
        return None


def remembered_for(model_path: str | Path, cache_types: tuple[str, str]) -> AttentionChoice | None:
    """What an earlier load measured for this model file, machine and cache type, at any probe size."""
    prefix = probe_key(model_path, cache_types) + "|"
    try:
        known = json.loads(remembered_path().read_text())
        entry = next((value for key, value in known.items() if key.startswith(prefix)), None)
        return AttentionChoice(**entry) if entry else None
    except (OSError, ValueError, TypeError):
        return None


def remember(key: str, choice: AttentionChoice) -> None:
    """Keep a result for later loads: only one measured on a quiet machine (`trusted`)."""
    if not choice.trusted:
        return
    path = remembered_path()
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        known[key] = asdict(choice)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except (OSError, ValueError):
        log.debug("could not remember the attention probe's result", exc_info=True)


def measure(
    make_context: Any,
    n_vocab: int,
    cells: int,
    rows: int,
    n_batch: int,
    budget_s: float = PROBE_BUDGET_SECONDS,
    on_step: Callable[[int, int], None] | None = None,
) -> AttentionChoice:
    """Time steps, flash attention on and off, in three shapes: decode steps of `rows` sequences that
    all see the same cells (a long conversation's, an agent's shared prompt), the same for `rows`
    sequences of their own, shorter, beside them (many requests among the cells in use), and prompt
    chunks of PROBE_CHUNK tokens of a new sequence beside all of them. The kind kept serves the
    reference workload faster: PROMPT_PER_OUTPUT prompt tokens (chunks) for each output token (a
    decode row, half of them shared, half own). `make_context(n_ctx, n_seq_max, n_batch, flash_attention)` makes a
    llama.cpp context. Filling stops after PROBE_FILL_SECONDS, at the same count for both kinds.
    Every phase counts against `budget_s`: past it, ProbeNotTrusted. `on_step(done, total)` follows
    its decodes. The result says how busy the rest of the machine was (`trusted`)."""
    deadline = time.perf_counter() + budget_s
    per_round = 3 * 2 * (PROBE_STEPS + 1)
    total = 2 * 2 + per_round * PROBE_ROUNDS  # fills, then the timed rounds (more if they are quick)
    done = 0

    def step_done() -> None:
        nonlocal done
        done += 1
        if on_step is not None:
            on_step(done, total)
        if time.perf_counter() > deadline:
            raise ProbeNotTrusted(f"the probe ran out of its {budget_s:g} s")

    busy_before, own_before, wall_before = *_busy_seconds(), time.perf_counter()
    n_ctx = 2 * (cells + rows * PROBE_MAX_ROUNDS * (PROBE_STEPS + 1)) + 256 + PROBE_CHUNK
    chunk_seq = 2 * rows  # the prompt shape's sequence, cleared after each chunk
    contexts = {flash: make_context(n_ctx, 2 * rows + 1, n_batch, flash) for flash in (True, False)}
    batch = llama_cpp.llama_batch_init(max(n_batch, rows, PROBE_CHUNK), 0, 1)
    try:
        if not all(contexts.values()):
            raise RuntimeError("llama.cpp could not make the attention probe's contexts")
        tokens = [100 + (i * 7919) % max(1, n_vocab - 200) for i in range(cells)]  # any ids: only the count matters
        # Four fills of this size come before the timed steps (shared and own cells, both kinds).
        fill_budget = min(PROBE_FILL_SECONDS, budget_s / 10)
        filled = _fill_cells(contexts[True], batch, tokens, n_batch, rows, fill_budget)
        step_done()
        _fill_cells(contexts[False], batch, tokens[:filled], n_batch, rows, None, deadline)
        step_done()
        own = max(1, filled // rows)
        for ctx in contexts.values():
            _fill_own(ctx, batch, tokens[:own], n_batch, rows, deadline)
            step_done()
        shapes = {"shared": (0, filled), "own": (rows, own)}  # (first sequence, position of the next token)
        timed: dict[tuple[str, bool], list[float]] = {
            (shape, flash): [] for shape in (*shapes, "prompt") for flash in contexts
        }
        timed_from = time.perf_counter()
        for round_ in range(PROBE_MAX_ROUNDS):  # the kinds alternate: drift on a busy machine hits both
            if round_ >= PROBE_ROUNDS:  # one more round only if it fits well inside both limits
                spent = time.perf_counter() - timed_from
                if spent > PROBE_TIMED_SECONDS or time.perf_counter() + 2 * spent / round_ > deadline:
                    break
                total += per_round
            for shape, (first, start) in shapes.items():
                for flash, ctx in contexts.items():
                    for step in range(PROBE_STEPS + 1):  # the first step of each round warms up
                        position = start + round_ * (PROBE_STEPS + 1) + step
                        _rows(batch, [(tokens[seq % filled], position, first + seq) for seq in range(rows)])
                        _timed_decode(ctx, batch, timed[shape, flash] if step else None)
                        step_done()
            for flash, ctx in contexts.items():  # the prompt shape: a new sequence's chunk beside every cell in use
                memory = llama_cpp.llama_get_memory(ctx)
                for step in range(PROBE_STEPS + 1):
                    _rows(batch, [(tokens[i % filled], i, chunk_seq) for i in range(PROBE_CHUNK)])
                    _timed_decode(ctx, batch, timed["prompt", flash] if step else None)
                    llama_cpp.llama_memory_seq_rm(memory, chunk_seq, -1, -1)
                    step_done()
        best = {key: min(steps) for key, steps in timed.items()}
        # How far a kind's typical step lies above its best: one slow step is the OS's, not contention.
        spread = max(statistics.median(steps) / max(min(steps), 1e-6) for steps in timed.values())
        busy_after, own_after, wall_after = *_busy_seconds(), time.perf_counter()
        others = max(0.0, ((busy_after - busy_before) - (own_after - own_before)) / max(1e-6, wall_after - wall_before))
        on, off = (per_output_ms(best["shared", f], best["own", f], best["prompt", f], rows) for f in (True, False))
        detail = ", ".join(
            f"{shape} {best[shape, True]:.1f} against {best[shape, False]:.1f} ms" for shape in (*shapes, "prompt")
        )
        return AttentionChoice(
            on <= off, round(on, 2), round(off, 2), filled, rows, detail, round(others, 2), round(spread, 2)
        )
    finally:
        llama_cpp.llama_batch_free(batch)
        for ctx in contexts.values():
            if ctx:
                llama_cpp.llama_free(ctx)


def per_output_ms(shared_ms: float, own_ms: float, prompt_ms: float, rows: int) -> float:
    """The reference workload's time per output token: a decode row (half the rows see shared cells,
    half their own) and PROMPT_PER_OUTPUT prompt tokens."""
    decode_row = (shared_ms + own_ms) / (2 * rows)
    return decode_row + PROMPT_PER_OUTPUT * prompt_ms / PROBE_CHUNK


def _timed_decode(ctx: Any, batch: Any, into: list[float] | None) -> None:
    started = time.perf_counter()
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("the attention probe's step did not decode")
    if into is not None:
        into.append((time.perf_counter() - started) * 1000)


def _past(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise ProbeNotTrusted("the probe ran out of its time while filling its cells")


def _fill_own(ctx: Any, batch: Any, tokens: list[int], n_batch: int, rows: int, deadline: float | None = None) -> None:
    """Sequences `rows` to `2 * rows - 1`, each with `tokens` in cells of its own."""
    pending = [(token, pos, rows + seq) for seq in range(rows) for pos, token in enumerate(tokens)]
    chunk = max(1, min(n_batch, 256))
    for start in range(0, len(pending), chunk):
        _past(deadline)
        _rows(batch, pending[start : start + chunk])
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("the attention probe's prompts did not decode")


def _fill_cells(
    ctx: Any,
    batch: Any,
    tokens: list[int],
    n_batch: int,
    rows: int,
    budget_s: float | None,
    deadline: float | None = None,
) -> int:
    """Decode `tokens` into sequence 0 and share its cells with the other `rows - 1` sequences; stop
    early once `budget_s` has passed (or fail past `deadline`). Returns how many cells were filled."""
    started = time.perf_counter()
    filled = 0
    chunk = max(1, min(n_batch, 256))
    while filled < len(tokens):
        _past(deadline)
        part = tokens[filled : filled + chunk]
        _rows(batch, [(token, filled + i, 0) for i, token in enumerate(part)])
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("the attention probe's prompt did not decode")
        filled += len(part)
        if budget_s is not None and time.perf_counter() - started > budget_s:
            break
    memory = llama_cpp.llama_get_memory(ctx)
    for seq in range(1, rows):
        llama_cpp.llama_memory_seq_cp(memory, 0, seq, -1, -1)
    return filled


def _rows(batch: Any, rows: list[tuple[int, int, int]]) -> None:
    for n, (token, pos, seq) in enumerate(rows):
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = 0
    batch.logits[len(rows) - 1] = 1
    batch.n_tokens = len(rows)
