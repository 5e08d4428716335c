"""Past the knee: interactive clients at the calibrated concurrency, plus a burst at three times it,
with shedding off and on, against the same burst on llama.cpp's server.

`magnitude serve --parallel P` with a TTFT objective (`slo.ttft_p95_ms`), shedding off and then on
(`slo.shed`), and `llama-server -np P`, one after the other. P interactive clients run closed loop
for the whole run; after a warm-up, 3P more join for the burst. Per server: the interactive clients'
TTFT p95 against the objective, goodput (requests answered with their first token within the
objective, per second), requests refused (503/429, each retried after its Retry-After by a client
that waits for it, as the OpenAI SDK does), and errors.

    python benchmarks/overload.py [--parallel 8] [--objective-ms 2000] [--seconds 60] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from _common import TOKEN, LlamaServer, MagnitudeServer, find_llama_server, table

from magnitude_jupyter.calibrate.sweep import synthetic_prompt
from magnitude_jupyter.client.http import iter_sse


@dataclass
class Tally:
    ttfts_s: list[float] = field(default_factory=list)  # the interactive clients' answers
    good: int = 0  # answers whose first token came within the objective
    refused: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def one(http: httpx.Client, url: str, index: int, max_tokens: int) -> tuple[float | None, int, float]:
    """(TTFT seconds or None, HTTP status, Retry-After seconds) of one streamed answer."""
    body = {
        "messages": [{"role": "user", "content": synthetic_prompt(index, 40)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return None, response.status_code, float(response.headers.get("Retry-After") or 1)
        ttft = None
        for _, data in iter_sse(response.iter_lines()):
            if data == "[DONE]":
                break
            if ttft is None and '"content"' in data:
                ttft = time.perf_counter() - start
    return ttft, 200, 0.0


def run(url: str, parallel: int, objective_s: float, seconds: float, max_tokens: int) -> tuple[Tally, float]:
    tally, stop, burst = Tally(), threading.Event(), threading.Event()
    counter = [0]

    def client(interactive: bool) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            while not stop.is_set() and (interactive or burst.is_set()):
                with tally.lock:
                    counter[0] += 1
                    index = counter[0]
                try:
                    ttft, status, retry = one(http, url, index, max_tokens)
                except httpx.HTTPError:
                    with tally.lock:
                        tally.errors += 1
                    continue
                with tally.lock:
                    if status in (429, 503):
                        tally.refused += 1
                    elif status != 200 or ttft is None:
                        tally.errors += 1
                    else:
                        tally.good += ttft <= objective_s
                        if interactive:
                            tally.ttfts_s.append(ttft)
                if status in (429, 503):
                    stop.wait(retry)

    threads = [threading.Thread(target=client, args=(True,)) for _ in range(parallel)]
    threads += [threading.Thread(target=client, args=(False,)) for _ in range(3 * parallel)]
    start = time.perf_counter()
    for t in threads[:parallel]:
        t.start()
    time.sleep(seconds / 4)  # the warm-up: the interactive clients alone, at the knee
    burst.set()
    for t in threads[parallel:]:
        t.start()
    time.sleep(seconds * 3 / 4)
    stop.set()
    for t in threads:
        t.join()
    return tally, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", type=int, default=8, help="the knee: interactive clients and slots")
    ap.add_argument("--objective-ms", type=float, default=2000.0, help="the TTFT p95 objective")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit("llama-server not found: run ../shared/tools/build-llama-server.sh first")
    slo = f"slo:\n  ttft_p95_ms: {args.objective_ms}\n  window: 1m\n"
    servers = {
        "magnitude serve, shedding off": lambda: MagnitudeServer(slo, args.parallel, args.threads),
        "magnitude serve, shedding on": lambda: MagnitudeServer(slo + "  shed: true\n", args.parallel, args.threads),
        "llama-server": lambda: LlamaServer(binary, args.parallel, 8192, args.threads),
    }
    rows, goodput = [], {}
    for name, start in servers.items():
        server = start()
        try:
            tally, seconds = run(server.url, args.parallel, args.objective_ms / 1000, args.seconds, args.max_tokens)
        finally:
            server.close()
        p95 = float(np.percentile(tally.ttfts_s, 95)) * 1000 if tally.ttfts_s else float("nan")
        goodput[name] = tally.good / seconds
        rows.append(
            [
                name,
                f"{p95:,.0f}",
                f"{p95 / args.objective_ms:.2f}×",
                f"{goodput[name]:.2f}",
                tally.refused,
                tally.errors,
                len(tally.ttfts_s),
            ]
        )
    base = goodput["magnitude serve, shedding off"] or float("nan")
    for row in rows:
        row.append(f"{goodput[row[0]] / base:.2f}×")
    print(
        f"{args.parallel} interactive clients (the knee) + a burst of {3 * args.parallel} more after "
        f"{args.seconds / 4:.0f} s, {args.seconds:.0f} s in all, {args.max_tokens} tokens per answer, TTFT objective "
        f"{args.objective_ms:,.0f} ms (p95), parallel {args.parallel}, {args.threads} threads"
    )
    print(
        table(
            [
                "server",
                "interactive TTFT p95 ms",
                "vs objective",
                "goodput req/s",
                "refused",
                "errors",
                "interactive answers",
                "goodput vs shedding off",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
