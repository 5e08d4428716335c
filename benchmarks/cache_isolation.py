"""What keeping users apart in the prefix cache costs: `cache_salt` per user against one shared cache.

Users of one server often send the same long system prompt. Shared, the second user's request
copies its cells; salted, each user computes it once for themselves (and their own later turns
still hit). Each user sends `--turns` requests that start with the same system prompt (about 300
tokens) and their own question, `--concurrency` at a time, greedy, 32 tokens. The same engine runs
both modes in turns, with a fresh system prompt each run so nothing is cached across runs.

    python benchmarks/cache_isolation.py [--users 8] [--turns 3] [--concurrency 4] [--pairs 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from _common import table

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams

SYSTEM = (
    "You are the support assistant of a bicycle shop. You answer questions about repairs, parts, "
    "opening hours and orders. Keep answers short, friendly and precise. If you do not know, say so. "
) * 4


def run(engine: Engine, users: int, turns: int, concurrency: int, salted: bool) -> dict[str, float]:
    system = f"[{uuid.uuid4().hex}] {SYSTEM}"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def one(job: tuple[int, int]) -> tuple[int, int, float]:
        user, turn = job
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"I am customer {user}. Question {turn}: how do I fix a flat tyre?"},
        ]
        salt = f"user-{user}" if salted else None
        result = engine.generate(messages=messages, params=params, cache_salt=salt)
        usage = result.usage
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return usage["prompt_tokens"], cached, float(result.timings.get("ttft_ms") or 0.0)

    jobs = [(user, turn) for turn in range(turns) for user in range(users)]
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    seconds = time.monotonic() - started
    prompt = sum(r[0] for r in results)
    cached = sum(r[1] for r in results)
    return {
        "computed": prompt - cached,
        "cached share": cached / prompt,
        "ttft p50": statistics.median(r[2] for r in results),
        "wall": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(settings=Settings(), parallel=args.concurrency, ctx_size=8192).start()
    runs: dict[str, list[dict[str, float]]] = {"shared": [], "cache_salt per user": []}
    try:
        for _ in range(args.pairs):
            for mode in runs:
                runs[mode].append(run(engine, args.users, args.turns, args.concurrency, mode != "shared"))
    finally:
        engine.shutdown()
    shared_wall = statistics.median(r["wall"] for r in runs["shared"])
    rows = []
    for mode, results in runs.items():
        wall = statistics.median(r["wall"] for r in results)
        rows.append(
            [
                mode,
                f"{statistics.median(r['computed'] for r in results):,.0f}",
                f"{statistics.median(r['cached share'] for r in results):.0%}",
                f"{statistics.median(r['ttft p50'] for r in results):,.0f}",
                f"{wall:.1f}",
                f"{shared_wall / wall:.2f}×",
            ]
        )
    print(
        f"{args.users} users × {args.turns} turns, one ~300-token system prompt shared by all, "
        f"{args.concurrency} at a time, 32 greedy tokens; median of {args.pairs} alternating runs"
    )
    headers = ["prefix cache", "prompt tokens computed", "cached", "TTFT p50 ms", "wall s", "speed vs shared"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
