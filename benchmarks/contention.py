"""Throughput of `magnitude serve` with and without one competing CPU-bound process.

The competitor is what a notebook beside the server does: a single-threaded pandas loop. Each
thread setting is measured quiet, then with the competitor running, in the same run; tok/s is
generated tokens over a fixed window (from the server's own counter) while closed-loop streaming
clients keep requests in flight, so a collapsed setting costs the window, not minutes.

    python benchmarks/contention.py [--window 20] [--clients 1,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from _common import PROMPTS, TOKEN, table

from magnitude_jupyter.client.http import Client
from magnitude_jupyter.client.runtime import LocalServer

COMPETITOR = """
import numpy as np, pandas as pd
df = pd.DataFrame({"k": np.random.randint(0, 1000, 200_000), "v": np.random.rand(200_000)})
while True:
    df.groupby("k")["v"].agg(["mean", "std"]).sort_values("mean")
"""

SETTINGS = [
    ("auto (default: free cores)", ()),
    ("all cores, fixed", ("--threads", str(os.cpu_count() or 1))),
    ("1 thread, fixed", ("--threads", "1")),
]


def generated(client: Client) -> int:
    return int(client.status()["generated_tokens_total"])


def measure(client: Client, clients: int, window: float) -> tuple[float, float]:
    """(tok/s over the window, mean llama.cpp threads seen) with `clients` closed-loop clients."""
    stop = threading.Event()

    def loop(worker: int) -> None:
        i = worker
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            client.chat([{"role": "user", "content": prompt}], max_tokens=48, temperature=0, ignore_eos=True)
            i += clients

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3)  # settle: the requests in flight, the thread governor's first readings
    start_tokens, start = generated(client), time.monotonic()
    seen = []
    while time.monotonic() - start < window:
        time.sleep(1)
        seen.append(client.status().get("threads") or 0)
    rate = (generated(client) - start_tokens) / (time.monotonic() - start)
    stop.set()
    for t in threads:
        t.join(120)
    return rate, sum(seen) / len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured per cell")
    parser.add_argument("--clients", default="1,4")
    args = parser.parse_args()
    levels = [int(x) for x in args.clients.split(",")]

    rows = []
    for name, flags in SETTINGS:
        with LocalServer(("--parallel", str(max(levels)), *flags), token=TOKEN, config="") as server:
            client = Client(server.url, TOKEN)
            client.chat([{"role": "user", "content": "warm up"}], max_tokens=8)
            for clients in levels:
                quiet, quiet_threads = measure(client, clients, args.window)
                env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
                competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=env)
                try:
                    busy, busy_threads = measure(client, clients, args.window)
                finally:
                    competitor.kill()
                    competitor.wait()
                rows.append(
                    [
                        name,
                        clients,
                        f"{quiet:.1f}",
                        f"{busy:.1f}",
                        f"{quiet_threads:.1f} / {busy_threads:.1f}",
                        f"{busy / quiet:.2f}×",
                    ]
                )
                print(rows[-1], file=sys.stderr, flush=True)
            client.close()
    print(f"{os.cpu_count()} cores, {args.window:.0f} s per cell, 48 new tokens per request, greedy, streaming")
    headers = [
        "threads",
        "clients",
        "quiet tok/s",
        "with a busy pandas process",
        "threads used (quiet / busy)",
        "busy vs quiet",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
