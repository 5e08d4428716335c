"""DataFrame batch throughput against `magnitude serve`: concurrency, and prompt-prefix reuse.

1. Concurrency. 64 rows at concurrency 1 and 8 against one server in the same run, for two row
   tasks: a one-word classification (8 new tokens at most) and a short reply to each review (48).
   The two levels alternate and the best of `--repeats` counts: on a shared machine noise only
   slows a run down. Beside the measured ratio stands the ratio `llama_decode` alone allows for
   the same prompts on this machine (no server, no HTTP, no scheduler; see `decode_ceiling`).
   That ceiling depends on the weights' type: llama.cpp's CPU backend multiplies Q4_1 weights
   (the bundled model) one activation row at a time, so a batch of rows costs nearly as much
   compute as the rows one by one, and only the memory traffic of decoding is shared. The same
   rows therefore run again on the model re-encoded to Q8_0, a type it multiplies in batches:
   the serving stack's ratio where the kernel leaves room for one (`--no-q8-0` skips it).
2. Prefix reuse. 64 rows whose template starts with a ~200-token fixed instruction, at
   concurrency 8, against a server with prefix reuse on and one with it off.

    python benchmarks/batch_throughput.py [--rows 64] [--repeats 2] [--model PATH] [--no-q8-0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MagnitudeServer, table

from magnitude_jupyter.batch.score import render_prompts, score_dataframe
from magnitude_jupyter.engine.plan import DecodeItem
from magnitude_jupyter.engine.prefix_cache import common_prefix_len
from magnitude_jupyter.engine.runner import LlamaRunner, requantize
from magnitude_jupyter.engine.runner_api import chat_prompt_tokens
from magnitude_jupyter.models.registry import bundled_model_path, read_model_info

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


def prompt_tokens(runner: LlamaRunner, model: Path, df: pd.DataFrame, template: str) -> list[list[int]]:
    """Each row's prompt as the engine tokenizes it: the row's text in the model's chat template."""
    chat_template = read_model_info(model).chat_template
    return [
        chat_prompt_tokens(runner, [{"role": "user", "content": text}], chat_template)
        for text in render_prompts(df, template).values()
    ]


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
            runner.copy_cells(slot, seq, 0, shared)
        runner.decode([DecodeItem(seq, tokens[shared:], shared, True) for seq, tokens in enumerate(wave)])
        for step in range(new_tokens - 1):
            runner.decode([DecodeItem(seq, tokens[-1:], len(tokens) + step, True) for seq, tokens in enumerate(wave)])
        for seq in range(len(wave)):
            runner.end_sequence(seq)
    return len(prompts) / (time.perf_counter() - start)


def concurrency_rows(label: str, model: Path, df: pd.DataFrame, repeats: int) -> list[list[str]]:
    """Both tasks at concurrency 1 and 8 against `magnitude serve`, then `llama_decode` alone on the same prompts."""
    with MagnitudeServer("engine:\n  prefix_reuse: true\n", model=model) as server:
        by_task = {task.name: best_of(server, df, task, repeats) for task in TASKS}
    # The server is gone: llama_decode alone gets the machine to itself, as the server had it.
    runner = LlamaRunner(model, n_ctx=8192, n_seq_max=9)
    rows = []
    try:
        for task in TASKS:
            one, eight = by_task[task.name][1], by_task[task.name][8]
            prompts = prompt_tokens(runner, model, df, task.template)
            new_tokens = max(1, round(one.completion_tokens))
            alone = {c: max(decode_ceiling(runner, prompts, new_tokens, c) for _ in range(repeats)) for c in (1, 8)}
            rows.append(
                [
                    label,
                    task.name,
                    f"{one.prompt_tokens:.0f}",
                    f"{one.completion_tokens:.1f}",
                    f"{one.rows_per_s:.2f}",
                    f"{eight.rows_per_s:.2f}",
                    f"{eight.rows_per_s / one.rows_per_s:.2f}×",
                    f"{alone[8] / alone[1]:.2f}×",
                ]
            )
    finally:
        runner.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the bundled model)")
    ap.add_argument("--no-q8-0", action="store_true", help="skip the Q8_0 re-encoding of the model")
    args = ap.parse_args()
    df = reviews(args.rows)
    model = args.model or bundled_model_path()
    info = read_model_info(model)

    rows = concurrency_rows(f"{model.name} ({model.stat().st_size / 2**20:.0f} MiB)", model, df, args.repeats)
    if not args.no_q8_0 and info.quantization != "Q8_0":
        with tempfile.TemporaryDirectory() as tmp:
            q8 = requantize(model, Path(tmp) / f"{model.stem}.Q8_0.gguf")
            label = f"the same, re-encoded to Q8_0 ({q8.stat().st_size / 2**20:.0f} MiB)"
            rows += concurrency_rows(label, q8, df, args.repeats)
    with MagnitudeServer("engine:\n  prefix_reuse: true\n", model=model) as server:
        long_on = run(server, df, LONG_TEMPLATE, 8, 8)
    with MagnitudeServer("engine:\n  prefix_reuse: false\n", model=model) as server:
        long_off = run(server, df, LONG_TEMPLATE, 8, 8)

    print(f"{args.rows} rows, greedy, magnitude serve (parallel 8), best of {args.repeats} alternating runs per level")
    headers = ["model", "task", "prompt tok/row", "new tok/row", "c=1 rows/s", "c=8 rows/s", "c=8 vs c=1"]
    print(table([*headers, "llama_decode alone"], rows))
    print(
        f"\n{model.name}, ~{long_on.prompt_tokens:.0f} prompt tokens per row (a ~200-token fixed instruction + "
        "the review), 8 new tokens at most, concurrency 8"
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
