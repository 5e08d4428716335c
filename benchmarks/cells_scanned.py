"""The KV cells each llama.cpp batch scans, ours against llama-server, on the conversation workload.

llama.cpp's attention visits every cell of its unified cache up to the highest one in use (`n_kv`,
padded to 256), masked or not, for every row of every batch: at 16 sessions that range, not the
model's weights, sets the cost of a row (model_matrix.py's raw ceiling against its servers). With
`LLAMA_KV_CACHE_DEBUG=1` both servers log, per batch and per cache (the global layers', and a
windowed model's windowed layers'), the range (`n`) and the cells in use; this runs S sessions x R
rounds (conversations.py's workload) on one file against `magnitude serve --verbose` and
`llama-server -v`, one after the other, and prints the mean and 90th percentile of each, and each
server's llama_decode calls, and for ours the run's seconds inside them, in whole steps and in all.

    python benchmarks/cells_scanned.py [--model FILE] [--family gemma3 --window 1024] [--parallel 16]
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
from pathlib import Path

from _common import LlamaServer, MagnitudeServer, session_arguments, table
from conversations import run_workload
from model_matrix import cells, one_model, one_model_arguments, peer_flags

SLOT = re.compile(rb"find_slot: stream\[0\], n = +(\d+), used = +(\d+), head = +\d+, size = +(\d+), n_swa = +(\d+)")
PEER_DECODES = re.compile(rb"decode: n_batch \(effective\)")


def scanned(log: bytes) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """Per cache (size, window) of the served context: the range scanned and the cells in use, at each
    slot search (llama.cpp searches once or more per batch). The attention probe's contexts, smaller,
    are left out."""
    out: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for m in SLOT.finditer(log):
        n, used, size, window = (int(g) for g in m.groups())
        ranges, in_use = out.setdefault((size, window), ([], []))
        ranges.append(n)
        in_use.append(used)
    largest: dict[bool, int] = {}  # per kind of cache (windowed or not), the served context's size
    for size, window in out:
        largest[bool(window)] = max(size, largest.get(bool(window), 0))
    return {(size, window): v for (size, window), v in out.items() if size == largest[bool(window)]}


def main() -> None:
    args = session_arguments(
        __doc__, rounds=6, max_tokens=64, more=lambda p: one_model_arguments(p, "gemma3"), sessions=16
    )
    os.environ["LLAMA_KV_CACHE_DEBUG"] = "1"  # both servers inherit it
    rows = []
    with tempfile.TemporaryDirectory(prefix="magnitude-cells-") as tmp:
        path, kind, what = one_model(args, Path(tmp))
        for name in ("magnitude serve", "llama-server"):
            log_path = Path(tmp) / f"{name}.log"
            with open(log_path, "wb") as log:
                if name == "magnitude serve":
                    server = MagnitudeServer(
                        parallel=args.parallel,
                        ctx_size=cells(args.parallel),
                        threads=args.threads,
                        model=path,
                        log=log,
                        verbose=True,
                    )
                    url, close, status = server.url, server.close, server.client.status
                else:
                    flags = (*peer_flags(kind), "-v")
                    peer = LlamaServer(
                        args.binary, args.parallel, cells(args.parallel), args.threads, flags, model=path, log=log
                    )
                    url, close, status = peer.url, peer.close, None
                try:
                    run = run_workload(name, url, args.sessions, args.rounds, args.max_tokens)
                    ours = status() if status is not None else None
                finally:
                    close()
            text = log_path.read_bytes()
            decodes = ours["steps"]["decode_calls"] if ours is not None else len(PEER_DECODES.findall(text))
            # Ours: the run's seconds inside llama_decode, in whole steps, and in all (the rest is Python
            # between steps, and waiting for requests).
            steps = ours["steps"] if ours is not None else None
            split = f"{steps['decode_seconds']:.1f} / {steps['step_seconds']:.1f} / {run.seconds:.1f}" if steps else "-"
            for (size, window), (ranges, in_use) in sorted(scanned(text).items()):
                rows.append(
                    [
                        name,
                        f"{run.tokens_per_s:.1f}",
                        "windowed" if window else "global",
                        f"{size:,}",
                        f"{len(ranges):,}",
                        f"{statistics.mean(ranges):,.0f}",
                        f"{sorted(ranges)[len(ranges) * 9 // 10]:,}",
                        f"{statistics.mean(in_use):,.0f}",
                        f"{decodes:,}",
                        split,
                    ]
                )
    print(
        f"{args.sessions} sessions x {args.rounds} rounds, {args.max_tokens} tokens per answer, "
        f"{what}, parallel {args.parallel}, "
        f"{cells(args.parallel):,} cells, {args.threads} threads (logging on: slower than without)"
    )
    headers = [
        "server",
        "tok/s",
        "cache",
        "cells",
        "slot searches",
        "range scanned, mean",
        "p90",
        "cells in use, mean",
        "llama_decode calls",
        "s in llama_decode / in steps / run",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
