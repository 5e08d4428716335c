"""DataFrame batch throughput against `magnitude serve`: concurrency, and prompt-prefix reuse.

1. 64 short rows at concurrency 1 and 8, same server, same run: rows/s and the ratio.
2. 64 rows whose template starts with a ~200-token fixed instruction, at concurrency 8, against a
   server with prefix reuse on and one with it off (`engine.prefix_reuse: false`), same run.

    python benchmarks/batch_throughput.py [--rows 64] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table
from server_throughput import free_port

from magnitude_jupyter.batch import score_dataframe
from magnitude_jupyter.client import Client

TOKEN = "bench-token"
SHORT_TEMPLATE = "Is this review positive or negative? Answer with one word. Review: {{ review }}"
INSTRUCTION = (
    "You are a meticulous analyst of customer feedback for an online shop that sells kitchen tools, "
    "garden furniture and small electronics. For every review you read, decide whether the customer is "
    "satisfied. Consider the tone, the specific complaints or praise, any mention of returns, refunds, "
    "broken parts, late delivery, good value, ease of use, build quality and customer service. Sarcasm "
    "counts as negative. Mixed reviews count as positive only when the customer says they would buy "
    "again. Ignore spelling mistakes and the length of the review. Do not explain your reasoning, do "
    "not repeat the review, do not add punctuation, and never answer with anything but one word in "
    "lower case: positive or negative. Here is the review to classify now. "
)
LONG_TEMPLATE = INSTRUCTION + "Review: {{ review }}"


def reviews(n: int) -> pd.DataFrame:
    moods = [
        "great value and works well",
        "broke after two days",
        "arrived late but fine",
        "excellent quality",
        "the handle snapped",
        "would buy again",
        "customer service never answered",
        "exactly as described",
    ]
    return pd.DataFrame({"review": [f"Order {i}: {moods[i % len(moods)]}." for i in range(n)]})


class Server:
    def __init__(self, config: str, parallel: int = 8) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        path = Path(self.tmp.name) / "config.yaml"
        path.write_text(config)
        self.port = free_port()
        env = {**os.environ, "MAGNITUDE_CONFIG": str(path), "MAGNITUDE_RUNTIME_DIR": str(Path(self.tmp.name) / "rt")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "magnitude_jupyter.cli",
                "serve",
                "--port",
                str(self.port),
                "--token",
                TOKEN,
                "--parallel",
                str(parallel),
                "--ctx-size",
                "8192",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = Client(f"http://127.0.0.1:{self.port}", TOKEN)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client.wait_ready(timeout=2)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("magnitude serve did not start") from None
                time.sleep(0.3)

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.tmp.cleanup()


def run(server: Server, df: pd.DataFrame, template: str, concurrency: int, max_tokens: int) -> tuple[float, int]:
    score_dataframe(df.head(2), template, client=server.client, concurrency=2, max_tokens=2, progress=False)
    start = time.perf_counter()
    out = score_dataframe(
        df, template, client=server.client, concurrency=concurrency, max_tokens=max_tokens, progress=False
    )
    elapsed = time.perf_counter() - start
    failed = int(out["error"].notna().sum())
    if failed:
        raise RuntimeError(f"{failed} rows failed: {out['error'].dropna().iloc[0]}")
    cached = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert cached.status_code == 200
    return len(out) / elapsed, int(out["prompt_tokens"].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    df = reviews(args.rows)

    with_reuse = Server("engine:\n  prefix_reuse: true\n")
    try:
        c1, _ = run(with_reuse, df, SHORT_TEMPLATE, 1, args.max_tokens)
        c8, _ = run(with_reuse, df, SHORT_TEMPLATE, 8, args.max_tokens)
        long_on, prompt_tokens = run(with_reuse, df, LONG_TEMPLATE, 8, args.max_tokens)
    finally:
        with_reuse.close()
    without = Server("engine:\n  prefix_reuse: false\n")
    try:
        long_off, _ = run(without, df, LONG_TEMPLATE, 8, args.max_tokens)
    finally:
        without.close()

    print(f"{args.rows} rows, {args.max_tokens} new tokens per row, greedy, magnitude serve (parallel 8)")
    print(
        table(
            ["run", "rows/s", "ratio"],
            [
                ["short template, concurrency 1", f"{c1:.2f}", "1.00×"],
                ["short template, concurrency 8", f"{c8:.2f}", f"{c8 / c1:.2f}×"],
            ],
        )
    )
    print(
        f"\n~{prompt_tokens // args.rows} prompt tokens per row (a ~200-token fixed instruction + the review), "
        "concurrency 8"
    )
    print(
        table(
            ["run", "rows/s", "ratio"],
            [
                ["prefix reuse off", f"{long_off:.2f}", "1.00×"],
                ["prefix reuse on", f"{long_on:.2f}", f"{long_on / long_off:.2f}×"],
            ],
        )
    )


if __name__ == "__main__":
    main()
