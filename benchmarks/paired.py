"""Two servers at the same time, each on a core of its own with one thread: a ratio this machine's
drift cannot move.

Runs minutes apart on this machine differ by more than most of the gaps the other benchmarks look
for (model_matrix: llama-server's own runs of one row spread by a third). Here both servers run the
conversation workload (conversations.py: S sessions x R rounds, each round resending the history) at
once, each pinned with all its threads to one core (`taskset -a`) and given one llama.cpp thread, so
whatever the machine does to one it does to the other; the cores swap every repeat. What it measures
is each server's work per token on one core, llama.cpp's and the server's own (tokenizing, scheduling,
streaming) together; what it cannot show is how a server's threads share cores.

A side is `ours` (magnitude serve with its defaults), `ours:YAML` (with that config file text, as in
`ours:engine: {draft_tokens: 0}`), `ours@PATH` (the package in the checkout at PATH, for code before
and after a change; `ours@PATH:YAML` with a config too) or `llama-server`.

    python benchmarks/paired.py [--family mistral] [--window 1024] [--parallel 4] [--repeats 4]
        [--a ours] [--b llama-server]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

from _common import LlamaServer, MagnitudeServer, session_arguments, table
from conversations import Run, run_workload
from model_matrix import cells, one_model, one_model_arguments, peer_flags

PEER = "llama-server"


def start(side: str, args, path: Path, kind: str) -> LlamaServer | MagnitudeServer:
    """A side's server, started with one thread."""
    if side == PEER:
        return LlamaServer(args.binary, args.parallel, cells(args.parallel), 1, peer_flags(kind), model=path)
    if not side.startswith("ours"):
        raise SystemExit(f"a side is ours, ours:YAML, ours@PATH[:YAML] or {PEER}, not {side!r}")
    rest = side[len("ours") :]
    checkout, _, config = rest.partition(":")
    before = os.environ.get("PYTHONPATH")
    if checkout.startswith("@"):  # the server imports the package from that checkout
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout[1:], before]))
    try:
        return MagnitudeServer(config, parallel=args.parallel, ctx_size=cells(args.parallel), threads=1, model=path)
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def pin(pid: int, core: int) -> None:
    """Every thread of `pid`, those it has now and those it starts later, on `core`."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], capture_output=True, check=True)


def one_repeat(args, path: Path, kind: str, cores: dict[str, int]) -> dict[str, Run]:
    """Both sides at once, each pinned to its core: each side's run."""
    servers: dict[str, LlamaServer | MagnitudeServer] = {}
    runs: dict[str, Run] = {}
    try:
        for side in (args.a, args.b):
            servers[side] = start(side, args, path, kind)
        for side, server in servers.items():
            pin(server.proc.pid, cores[side])

        def run(side: str) -> None:
            runs[side] = run_workload(side, servers[side].url, args.sessions, args.rounds, args.max_tokens)

        threads = [threading.Thread(target=run, args=(side,)) for side in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for server in servers.values():
            server.close()
    if len(runs) < 2:
        raise SystemExit("a side's workload failed")
    return runs


def main() -> None:
    def more(parser) -> None:
        one_model_arguments(parser, "mistral")
        parser.add_argument("--a", default="ours", help="the side whose ratio is reported")
        parser.add_argument("--b", default=PEER, help="the side it is divided by")
        parser.set_defaults(parallel=4)

    args = session_arguments(__doc__, rounds=6, max_tokens=64, more=more, sessions=16, repeats=4)
    if args.a == args.b:
        raise SystemExit("the two sides are the same")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("paired.py needs two cores")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="magnitude-paired-") as tmp:
        path, kind, what = one_model(args, Path(tmp))
        for repeat in range(1, args.repeats + 1):
            swap = repeat % 2 == 0
            cores = {args.a: second if swap else first, args.b: first if swap else second}
            runs = one_repeat(args, path, kind, cores)
            a, b = runs[args.a], runs[args.b]
            ratios.append(a.tokens_per_s / b.tokens_per_s)
            rate_a, rate_b = f"{a.tokens_per_s:.1f}", f"{b.tokens_per_s:.1f}"
            ratio = f"{ratios[-1]:.3f}"
            rows.append([repeat, rate_a, cores[args.a], rate_b, cores[args.b], ratio, a.errors, b.errors])
    print(
        f"{args.sessions} sessions x {args.rounds} rounds, {args.max_tokens} tokens per answer, {what}, "
        f"parallel {args.parallel}, {cells(args.parallel):,} cells; both at once, one thread each, each on its own core"
    )
    print(f"a: {args.a}\nb: {args.b}")
    headers = ["repeat", "a tok/s", "a's core", "b tok/s", "b's core", "a / b", "errors a", "errors b"]
    print(table(headers, rows))
    print(f"a / b: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
