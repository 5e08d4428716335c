"""What idle KV cells cost, and when moving them to host RAM would pay (the prefix cache's idle entries).

One context as the server sizes it (8,192 cells, 16 request slots + 64 cache sequences): 16
sequences decode one token each per step, beside 0, 950, 1,900 or 3,800 cells that other sequences
hold and nobody reads (a prefix cache's idle entries). Then the same entries' state is saved to
bytes and restored (what the RAM tier does), per cell. Holding a cell costs a little time for every
row decoded; moving it costs a save and a restore once: their ratio is the number of rows after
which an idle entry is better in host RAM. Each held size is measured in alternation with the
others (`--repeats`), median ms per step, the best median kept.

    python benchmarks/idle_cells.py [--repeats 3] [--steps 48] [--flash-attention on|off]

Without flash attention (the engine's default on a CPU) every cell up to the highest one in use is
part of each row's matrix products; with it, a cell nobody reads costs a look at its mask.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import table

from magnitude_jupyter.config import EngineSettings
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.prefix_cache import SPILL_AFTER_ROWS
from magnitude_jupyter.engine.request import SamplingParams
from magnitude_jupyter.engine.runner import LlamaRunner
from magnitude_jupyter.models.registry import bundled_model_path

RUNNING = 16
ENTRY_CELLS = 95  # a short chat prompt and its answer
HELD = (0, 10, 20, 40)  # idle entries: 0, 950, 1,900, 3,800 cells


def fill_entries(runner: LlamaRunner, entries: int) -> list[int]:
    """`entries` sequences of ENTRY_CELLS distinct tokens each, after the request slots; their ids."""
    ids = list(range(RUNNING, RUNNING + entries))
    for i, seq in enumerate(ids):
        tokens = [1000 + (i * 37 + j * 11) % 15000 for j in range(ENTRY_CELLS)]
        runner.decode([DecodeItem(seq, tokens, 0, False)])
    return ids


def ms_per_step(runner: LlamaRunner, entries: int, steps: int) -> float:
    ids = fill_entries(runner, entries)
    prompts = [[2000 + s * 50 + j for j in range(16)] for s in range(RUNNING)]
    for s in range(RUNNING):
        runner.start_sequence(s, SamplingParams(temperature=0), prompts[s], len(prompts[s]))
    runner.decode([DecodeItem(s, prompts[s], 0, False) for s in range(RUNNING)])
    times = []
    for k in range(steps):
        items = [DecodeItem(s, [3000 + (k + s) % 500], 16 + k, True) for s in range(RUNNING)]
        start = time.perf_counter()
        runner.decode(items)
        times.append(time.perf_counter() - start)
    for seq in [*range(RUNNING), *ids]:
        runner.end_sequence(seq)
    return statistics.median(times) * 1000


def move_us_per_cell(runner: LlamaRunner, entries: int = 10) -> tuple[float, float]:
    """(save, restore) microseconds per cell, best of three, for entries of ENTRY_CELLS cells."""
    ids = fill_entries(runner, entries)
    save, restore = [], []
    for _ in range(3):
        start = time.perf_counter()
        saved = [runner.save_sequence(seq) for seq in ids]
        save.append(time.perf_counter() - start)
        for seq in ids:
            runner.end_sequence(seq)
        start = time.perf_counter()
        assert all(runner.restore_sequence(seq, data) for seq, data in zip(ids, saved, strict=True))
        restore.append(time.perf_counter() - start)
    for seq in ids:
        runner.end_sequence(seq)
    cells = entries * ENTRY_CELLS
    return min(save) / cells * 1e6, min(restore) / cells * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--flash-attention", choices=("on", "off"), default=None, help="default: as the engine chooses here"
    )
    args = parser.parse_args()
    flash = EngineSettings().uses_flash_attention if args.flash_attention is None else args.flash_attention == "on"
    runner = LlamaRunner(
        bundled_model_path(),
        n_ctx=8192,
        n_seq_max=RUNNING + 64,
        n_batch=512,
        n_threads=args.threads,
        flash_attention=flash,
    )
    try:
        best: dict[int, float] = {}
        for _ in range(args.repeats):
            for entries in HELD:
                ms = ms_per_step(runner, entries, args.steps)
                best[entries] = min(ms, best.get(entries, ms))
        save_us, restore_us = move_us_per_cell(runner)
    finally:
        runner.close()
    base = best[0]
    rows, costs = [], []  # costs: us per idle cell per row, for each size that held some
    for entries in HELD:
        cells = entries * ENTRY_CELLS
        per_cell_row = (best[entries] - base) * 1000 / (cells * RUNNING) if cells else None
        if per_cell_row is not None and per_cell_row > 0:
            costs.append(per_cell_row)
        rows.append(
            [
                f"{cells:,}",
                f"{best[entries]:.1f}",
                f"{best[entries] / base:.2f}×",
                f"{per_cell_row:.3f}" if per_cell_row is not None else "-",
            ]
        )
    print(
        f"{RUNNING} sequences decoding one token a step, {args.threads} threads, "
        f"flash attention {'on' if flash else 'off'}, "
        f"best median of {args.repeats} alternating runs of {args.steps} steps"
    )
    print(table(["idle cells held", "ms per step", "vs none", "us per idle cell per row"], rows))
    hold = statistics.median(costs) if costs else float("nan")
    print(
        f"save {save_us:.1f} + restore {restore_us:.1f} us per cell; holding {hold:.3f} us per cell per row: "
        f"moving an idle entry pays after {(save_us + restore_us) / hold:.0f} rows "
        f"(prefix_cache.SPILL_AFTER_ROWS is {SPILL_AFTER_ROWS})"
    )


if __name__ == "__main__":
    main()
