"""Where each server's time inside llama.cpp goes: every ubatch it computes, its rows and its seconds,
ours against llama-server on the conversation workload.

Both servers run the same llama.cpp (the shared build comes from the pinned llama-cpp-python's
sources), so a gap between them on one file is either the batches they build or the cells those
batches read. This tells the two apart: a Linux uprobe and a return probe on llama.cpp's
`llama_context::process_ubatch` in both binaries (`libllama.so` for ours, `llama-server` for the peer)
time each ubatch and read its row count. S sessions x R rounds (conversations.py's workload) on one
file against `magnitude serve` and `llama-server`, one after the other, `--repeats` times; per
server, the ubatches by size (decode rows only, and those that carry prompt rows), their rows, the
seconds inside them, and the milliseconds a ubatch and a prompt row take. Batches of the same size
that cost the same in both servers put the gap in the batches; the same batches costing more put it
in the cells.

Needs root and tracefs (`/sys/kernel/tracing`, mounted here if it is not), and binutils' `nm` and
`readelf`. A run of a tiny model lasts seconds and this machine's speed drifts by more than the gaps
it looks for between runs minutes apart: compare servers within a repeat, not across repeats.

    python benchmarks/ubatch_costs.py [--family mistral] [--window 1024] [--parallel 16] [--repeats 2]
        [--config 'engine: {prefix_cache_ram_mib: 0}']
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import llama_cpp
from _common import LlamaServer, MagnitudeServer, session_arguments, table
from conversations import run_workload
from model_matrix import cells, one_model, one_model_arguments, peer_flags

TRACING = Path("/sys/kernel/tracing")
SYMBOL = "llama_context::process_ubatch("
# The trace line of either probe: thread id, timestamp, which probe, and the entry's row count.
EVENT = re.compile(r"-(\d+)\s+\[\d+\].*?\s(\d+\.\d+): (enter|leave)_(\w+):.*?(?:rows=(\d+))?$")
SIZES = ((1, 63, "1-63 rows (decode rows)"), (64, 511, "64-511 rows"), (512, 1 << 30, "512 rows and more"))


def file_offset(binary: Path) -> int:
    """Where `process_ubatch` starts in the file (a uprobe's address): its address, less its
    loadable segment's address, plus that segment's offset in the file."""
    listing = subprocess.run(["nm", "-C", str(binary)], capture_output=True, text=True).stdout
    if SYMBOL not in listing:
        listing = subprocess.run(["nm", "-C", "-D", str(binary)], capture_output=True, text=True).stdout
    address = next(int(line.split()[0], 16) for line in listing.splitlines() if SYMBOL in line and " T " in line)
    headers = subprocess.run(["readelf", "-lW", str(binary)], capture_output=True, text=True).stdout
    for line in headers.splitlines():
        fields = line.split()
        if fields and fields[0] == "LOAD":
            offset, vaddr, size = int(fields[1], 16), int(fields[2], 16), int(fields[5], 16)
            if vaddr <= address < vaddr + size:
                return address - vaddr + offset
    raise SystemExit(f"{binary}: process_ubatch lies in no loadable segment")


def write(name: str, text: str, append: bool = False) -> None:
    """tracefs files take plain writes (no seek, so no Python append mode)."""
    fd = os.open(TRACING / name, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
    try:
        if text:
            os.write(fd, text.encode())
    finally:
        os.close(fd)


def set_probes(binaries: dict[str, Path]) -> None:
    if not (TRACING / "uprobe_events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACING)], check=True)
    write("events/enable", "0")
    write("uprobe_events", "")
    for name, binary in binaries.items():
        offset = file_offset(binary)
        # The ubatch is the second argument (after `this`): its row count is the uint32 at offset 4.
        write("uprobe_events", f"p:ubatch/enter_{name} {binary}:{offset:#x} rows=+4(%si):u32\n", append=True)
        write("uprobe_events", f"r:ubatch/leave_{name} {binary}:{offset:#x}\n", append=True)
    write("buffer_size_kb", "65536")


def ubatches() -> list[tuple[int, float]]:
    """(rows, seconds) of every ubatch the trace holds."""
    started: dict[str, tuple[float, int]] = {}
    out = []
    for line in (TRACING / "trace").read_text().splitlines():
        m = EVENT.search(line)
        if not m:
            continue
        thread, when, kind, _, rows = m.groups()
        if kind == "enter":
            started[thread] = (float(when), int(rows))
        elif thread in started:
            began, n = started.pop(thread)
            out.append((n, float(when) - began))
    return out


def measure(args) -> tuple[list[list[object]], str]:
    """The table's rows, ubatches by size for each server and repeat, and how its title names the model."""
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="magnitude-ubatches-") as tmp:
        path, kind, what = one_model(args, Path(tmp))
        for repeat in range(1, args.repeats + 1):
            for name in ("magnitude serve", "llama-server"):
                if name == "magnitude serve":
                    server = MagnitudeServer(
                        args.config,
                        parallel=args.parallel,
                        ctx_size=cells(args.parallel),
                        threads=args.threads,
                        model=path,
                    )
                    url, close = server.url, server.close
                else:
                    flags = peer_flags(kind)
                    peer = LlamaServer(
                        args.binary, args.parallel, cells(args.parallel), args.threads, flags, model=path
                    )
                    url, close = peer.url, peer.close
                try:
                    write("trace", "")
                    write("events/ubatch/enable", "1")
                    run = run_workload(name, url, args.sessions, args.rounds, args.max_tokens)
                finally:
                    write("events/ubatch/enable", "0")
                    close()
                timed = ubatches()
                by_size: dict[str, list[tuple[int, float]]] = defaultdict(list)
                for n, seconds in timed:
                    label = next(label for low, high, label in SIZES if low <= n <= high)
                    by_size[label].append((n, seconds))
                inside = sum(seconds for _, seconds in timed)
                for _, _, label in SIZES:
                    group = by_size.get(label, [])
                    n_rows = sum(n for n, _ in group)
                    seconds = sum(s for _, s in group)
                    rows.append(
                        [
                            repeat,
                            name,
                            f"{run.tokens_per_s:.1f}",
                            f"{inside:.1f} / {run.seconds:.1f}",
                            label,
                            len(group),
                            f"{n_rows:,}",
                            f"{seconds:.2f}",
                            f"{1000 * statistics.mean(s for _, s in group):.1f}" if group else "-",
                            f"{1000 * seconds / n_rows:.2f}" if n_rows else "-",
                        ]
                    )
    return rows, what


def main() -> None:
    def more(parser) -> None:
        one_model_arguments(parser, "mistral")
        parser.add_argument("--config", default="", help="magnitude serve's config file text (YAML), to A/B a setting")

    args = session_arguments(__doc__, rounds=6, max_tokens=64, more=more, sessions=16)
    library = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    set_probes({"ours": library.resolve(), "peer": Path(args.binary).resolve()})
    try:
        rows, what = measure(args)
    finally:
        write("uprobe_events", "")  # the probes go with the run, finished or not
    print(
        f"{args.sessions} sessions x {args.rounds} rounds, {args.max_tokens} tokens per answer, {what}, "
        f"parallel {args.parallel}, {cells(args.parallel):,} cells, {args.threads} threads"
    )
    headers = [
        "repeat",
        "server",
        "tok/s",
        "s in ubatches / run",
        "ubatches of",
        "ubatches",
        "rows",
        "s",
        "ms a ubatch",
        "ms a row",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
