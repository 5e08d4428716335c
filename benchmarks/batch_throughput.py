"""DataFrame batch throughput against `magnitude serve`: concurrency, and prompt-prefix reuse.

1. Concurrency. 64 rows at concurrency 1 and 8 against one server in the same run, for two row
   tasks: a one-word classification (8 new tokens at most) and a short reply to each review (48).
   The two levels alternate and the best of `--repeats` counts: on a shared machine noise only
   slows a run down. Beside the measured ratio stands the ratio `llama_decode` alone allows for
   the same prompts on this machine (no server, no HTTP, no scheduler; see `decode_ceiling`):
   prefill is compute-bound already one row at a time, so only the decode part of a row gains
   from batching, and a task whose rows are mostly prompt gains less.
2. Prefix reuse. 64 rows whose template starts with a ~200-token fixed instruction, at
   concurrency 8, against a server with prefix reuse on and one with it off.

    python benchmarks/batch_throughput.py [--rows 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MagnitudeServer, table

from magnitude_jupyter.batch import render_prompts, score_dataframe
from magnitude_jupyter.engine.chat import render_chat
from magnitude_jupyter.engine.prefix import common_prefix_len
from magnitude_jupyter.engine.runner import LlamaRunner
from magnitude_jupyter.engine.scheduler import DecodeItem
from magnitude_jupyter.models import bundled_model_path, read_model_info

CLASSIFY_TEMPLATE = "Is this review positive or negative? Answer with one word. Review: {{ review }}"
REPLY_TEMPLATE = "Write a short, polite reply from the shop to this customer review: {{ review }}"
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


@dataclass
class Task:
    name: str
    template: str
    max_tokens: int


TASKS = [Task("classify (one word)", CLASSIFY_TEMPLATE, 8), Task("reply (a sentence or two)", REPLY_TEMPLATE, 48)]


@dataclass
class Run:
    rows_per_s: float
    prompt_tokens: float  # per row, mean
    completion_tokens: float  # per row, mean


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


def run(server: MagnitudeServer, df: pd.DataFrame, template: str, concurrency: int, max_tokens: int) -> Run:
    score_dataframe(df.head(2), template, client=server.client, concurrency=2, max_tokens=2, progress=False)
    start = time.perf_counter()
    out = score_dataframe(
        df, template, client=server.client, concurrency=concurrency, max_tokens=max_tokens, progress=False
    )
    elapsed = time.perf_counter() - start
    failed = int(out["error"].notna().sum())
    if failed:
        raise RuntimeError(f"{failed} rows failed: {out['error'].dropna().iloc[0]}")
    return Run(len(out) / elapsed, float(out["prompt_tokens"].mean()), float(out["completion_tokens"].mean()))


def best_of(server: MagnitudeServer, df: pd.DataFrame, task: Task, repeats: int) -> dict[int, Run]:
    runs: dict[int, list[Run]] = {1: [], 8: []}
    for _ in range(repeats):
        for concurrency in runs:
            runs[concurrency].append(run(server, df, task.template, concurrency, task.max_tokens))
    return {c: max(rs, key=lambda r: r.rows_per_s) for c, rs in runs.items()}


def prompt_tokens(runner: LlamaRunner, df: pd.DataFrame, template: str) -> list[list[int]]:
    """Each row's prompt as the engine tokenizes it: the row's text in the model's chat template."""
    chat_template = read_model_info(bundled_model_path()).chat_template
    out = []
    for text in render_prompts(df, template).values():
        rendered = render_chat([{"role": "user", "content": text}], chat_template, runner.bos_token, runner.eos_token)
        add_bos = not (runner.bos_token and rendered.startswith(runner.bos_token))
        out.append(runner.tokenize(rendered, add_special=add_bos))
    return out


def decode_ceiling(runner: LlamaRunner, prompts: list[list[int]], new_tokens: int, concurrency: int) -> float:
    """Rows/s that `llama_decode` alone allows for this schedule on this machine.

    As the engine does with prefix reuse, each row shares the prompts' common prefix from a slot
    that holds it and prefills only the rest; then it decodes `new_tokens - 1` more tokens (the
    first comes from the prefill). `concurrency` rows share every decode, in lockstep.
    """
    shared = min(min(common_prefix_len(prompts[0], p) for p in prompts), min(len(p) for p in prompts) - 1)
    slot = concurrency
    runner.end_sequence(slot)
    runner.decode([DecodeItem(slot, prompts[0][:shared], 0, False)])
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        wave = prompts[first : first + concurrency]
        for seq in range(len(wave)):
            runner.copy_prefix(slot, seq, shared)
        runner.decode([DecodeItem(seq, tokens[shared:], shared, True) for seq, tokens in enumerate(wave)])
        for step in range(new_tokens - 1):
            runner.decode([DecodeItem(seq, tokens[-1:], len(tokens) + step, True) for seq, tokens in enumerate(wave)])
        for seq in range(len(wave)):
            runner.end_sequence(seq)
    return len(prompts) / (time.perf_counter() - start)


def ceiling_ratio(runner: LlamaRunner, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    one = max(decode_ceiling(runner, prompts, new_tokens, 1) for _ in range(repeats))
    eight = max(decode_ceiling(runner, prompts, new_tokens, 8) for _ in range(repeats))
    return eight / one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    df = reviews(args.rows)

    with MagnitudeServer("engine:\n  prefix_reuse: true\n") as server:
        by_task = {task.name: best_of(server, df, task, args.repeats) for task in TASKS}
        long_on = run(server, df, LONG_TEMPLATE, 8, 8)
    with MagnitudeServer("engine:\n  prefix_reuse: false\n") as server:
        long_off = run(server, df, LONG_TEMPLATE, 8, 8)

    # The servers are gone: llama_decode alone gets the machine to itself, as they had it.
    runner = LlamaRunner(bundled_model_path(), n_ctx=8192, n_seq_max=9)
    try:
        ceilings = {
            task.name: ceiling_ratio(
                runner,
                prompt_tokens(runner, df, task.template),
                max(1, round(by_task[task.name][1].completion_tokens)),
                args.repeats,
            )
            for task in TASKS
        }
    finally:
        runner.close()

    print(f"{args.rows} rows, greedy, magnitude serve (parallel 8), best of {args.repeats} alternating runs per level")
    rows = []
    for task in TASKS:
        one, eight = by_task[task.name][1], by_task[task.name][8]
        rows.append(
            [
                task.name,
                f"{one.prompt_tokens:.0f}",
                f"{one.completion_tokens:.1f}",
                f"{one.rows_per_s:.2f}",
                f"{eight.rows_per_s:.2f}",
                f"{eight.rows_per_s / one.rows_per_s:.2f}×",
                f"{ceilings[task.name]:.2f}×",
            ]
        )
    headers = ["task", "prompt tok/row", "new tok/row", "c=1 rows/s", "c=8 rows/s", "c=8 vs c=1", "llama_decode alone"]
    print(table(headers, rows))
    print(
        f"\n~{long_on.prompt_tokens:.0f} prompt tokens per row (a ~200-token fixed instruction + the review), "
        "8 new tokens at most, concurrency 8"
    )
    print(
        table(
            ["run", "rows/s", "ratio"],
            [
                ["prefix reuse off", f"{long_off.rows_per_s:.2f}", "1.00×"],
                ["prefix reuse on", f"{long_on.rows_per_s:.2f}", f"{long_on.rows_per_s / long_off.rows_per_s:.2f}×"],
            ],
        )
    )


if __name__ == "__main__":
    main()
