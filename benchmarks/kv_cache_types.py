"""Quantized KV caches on the bundled model: what each holds, what it costs in accuracy and speed.

For f16, q8_0 and q4_0 (K and V alike):
- capacity: bytes per token (what llama.cpp allocates, checked against its log) and tokens that
  fit in 1 GiB;
- accuracy (`probes/kv_quality.py`): eight distinct texts teacher-forced one token at a time
  through each cache, every step's logits against f16's (top-1 agreement, mean |Δlogit|), then each
  text's first half continued greedily for 64 tokens: the first token unlike f16's (median);
- speed: 8 concurrent greedy streams of 96 tokens on an engine with that cache (parallel 8,
  8,192 cells), output tok/s, the ratio to f16 measured in the same run (alternating, best of two).

    python benchmarks/kv_cache_types.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time

from _common import PROMPTS, table

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine, SamplingParams
from magnitude_jupyter.models.registry import bundled_model_path
from magnitude_jupyter.probes.kv_quality import measure

TYPES = ("f16", "q8_0", "q4_0")
TEXTS = [
    "The history of the bicycle begins in the early nineteenth century, when a German inventor built a wooden "
    "running machine that riders pushed along with their feet. Pedals came decades later, and with them the "
    "high-wheeled machines whose front wheels grew larger to make each turn of the pedals carry the rider further.",
    "To make bread at home, mix flour, water, salt and a little yeast, then knead the dough until it is smooth and "
    "springs back when pressed. Let it rise somewhere warm until it has doubled, shape it gently, let it rise "
    "again, and bake it in a very hot oven until the crust is deep brown and the loaf sounds hollow.",
    "A KV cache stores the keys and values that attention computed for earlier tokens, so that each new token "
    "needs only its own computation instead of the whole sequence's. Its size grows with the context length, "
    "the number of layers and the number of key-value heads, and it is often what limits how many users fit.",
    "The meeting opened with a review of last quarter's numbers. Sales in the northern region rose by eleven "
    "percent, while the southern region fell slightly because two large customers delayed their orders. The team "
    "agreed to revisit the forecast in six weeks and to hire one more engineer for the data platform.",
    "Tide pools form where the sea retreats at low tide and leaves water trapped among the rocks. Anemones, small "
    "crabs, snails and starfish live there, and they must survive the heat of the sun, the fresh water of rain and "
    "the pounding of waves when the tide returns, all within a few hours of each day.",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] "
    "<= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n            result.append(b[j])\n"
    "            j += 1\n    return result + a[i:] + b[j:]\n",
    "Dear Ms. Alvarez, thank you for your letter of March the fourth. We have looked into the delay you describe "
    "and found that your parcel was held at the regional depot because its label was damaged. It has now been "
    "relabelled and will reach you within three working days; we apologise for the inconvenience.",
    "In the winter of 1887 the observatory's new telescope was finally mounted, and the astronomers began a survey "
    "of the southern sky that would take eleven years. Each clear night they photographed a strip of sky, and "
    "each morning they measured the plates by hand, star by star, recording positions in thick ledgers.",
]


def decode_rate(cache_type: str, threads: int) -> tuple[float, int | None]:
    with Engine(settings=Settings(), parallel=8, ctx_size=8192, threads=threads, cache_type=cache_type) as engine:
        params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
        engine.generate(PROMPTS[0], params=SamplingParams(max_tokens=4, temperature=0))  # warm
        started = time.perf_counter()
        requests = [engine.submit(PROMPTS[i + 1], params=params) for i in range(8)]
        while not all(r.is_finished for r in requests):
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        return sum(len(r.output_tokens) for r in requests) / seconds, engine.stats().kv_buffer_bytes_reported


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    quality = {q.cache_type: q for q in measure(bundled_model_path(), TEXTS, TYPES, greedy=64, threads=args.threads)}
    rates: dict[str, float] = {t: 0.0 for t in TYPES}
    reported: dict[str, int | None] = {}
    for _ in range(2):  # alternating, best of two
        for cache_type in TYPES:
            rate, reported[cache_type] = decode_rate(cache_type, args.threads)
            rates[cache_type] = max(rates[cache_type], rate)
    rows = []
    for cache_type in TYPES:
        q = quality[cache_type]
        bpt = (reported[cache_type] or 0) / 8192
        rows.append(
            [
                cache_type,
                f"{bpt:,.0f}",
                f"{2**30 / bpt:,.0f}" if bpt else "-",
                f"{q.top1_agreement:.1%}",
                f"{q.mean_abs_dlogit:.3f}",
                f"{q.median_divergence:g} of {q.greedy_tokens}",
                f"{rates[cache_type]:.1f}",
                f"{rates[cache_type] / rates['f16']:.2f}",
            ]
        )
    positions = quality["f16"].positions
    print(
        f"{bundled_model_path().name}; {len(TEXTS)} texts, {positions} teacher-forced steps; speed: 8 streams x 96 "
        f"tokens, parallel 8, 8,192 cells, {args.threads} threads, best of 2 alternating"
    )
    print(
        table(
            [
                "KV cache",
                "bytes/token (llama.cpp)",
                "tokens in 1 GiB",
                "top-1 agreement with f16",
                "mean |Δlogit|",
                "greedy: first token unlike f16 (median)",
                "output tok/s",
                "vs f16",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
