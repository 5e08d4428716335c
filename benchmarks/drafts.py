"""Prompt-lookup drafts: what a row costs on this machine, how often guesses are kept, what it gains.

Runs the conversation workload of `conversations.py` (S sessions × R rounds, each round resending
the history) against `magnitude serve` with drafts and without, alternating, and prints what the
server's draft policy measured while it ran (`/status` → `drafts`, engine/draft_policy.py):

- a step's milliseconds by the tokens in it, and what one more row adds, as a share of a one-token
  step: the price of a draft token here;
- the chance a draft token is kept, by the length of the match its guess came from and by its
  position in the draft (given the ones before it were kept), with the drafts counted;
- output tok/s with and without drafts, measured in the same run.

    python benchmarks/drafts.py [--sessions 8] [--rounds 6] [--repeats 2]
"""

from __future__ import annotations

import httpx
from _common import NO_DRAFTS, TOKEN, MagnitudeServer, session_arguments, table
from conversations import run_workload


def main() -> None:
    args = session_arguments(__doc__, rounds=6, max_tokens=48, peer=False)
    configs = {"drafts": "", "no drafts": NO_DRAFTS}
    best: dict[str, float] = {}
    status: dict = {}
    for repeat in range(args.repeats):
        for name, config in configs.items():
            with MagnitudeServer(config, parallel=16, ctx_size=8192, threads=args.threads) as server:
                run = run_workload(name, server.url, args.sessions, args.rounds, args.max_tokens)
                if name == "drafts":
                    status = httpx.get(server.url + "/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            print(f"run {repeat + 1}: {name}: {run.tokens_per_s:.1f} tok/s, errors {run.errors}", flush=True)
            best[name] = max(best.get(name, 0.0), run.tokens_per_s)

    drafts = status["drafts"]
    what = f"{args.sessions} sessions × {args.rounds} rounds, {args.max_tokens} tokens per answer"
    print(f"\n{what}, {args.threads} threads")
    step_ms = drafts["step_ms"]
    one = step_ms["1"]
    sizes = list(step_ms)
    rows = []
    for size, following in zip(sizes, [*sizes[1:], None], strict=True):
        extra = (step_ms[following] - step_ms[size]) / (int(following) - int(size)) if following else None
        rows.append([size, f"{step_ms[size]:.1f}", f"{extra / one:.2f}" if extra is not None else "-"])
    print("\nstep time by its tokens (the last run with drafts; what the policy measured)")
    print(table(["tokens in step", "ms", "one more row, in one-token steps"], rows))

    kept = drafts["kept_chance"]
    positions = len(next(iter(kept.values())))
    print("\nchance a draft token is kept (given the ones before it were), by match length and position")
    print(
        table(
            ["matching tokens", *(f"#{j + 1}" for j in range(positions)), "drafts counted"],
            [
                [label, *(f"{p:.2f}" for p in chances), drafts["drafts_counted"][label]]
                for label, chances in kept.items()
            ],
        )
    )
    decoded, confirmed = status["draft_tokens_total"], status["draft_accepted_total"]
    share = confirmed / max(decoded, 1)
    print(f"\ndraft tokens decoded {decoded}, kept {confirmed} ({share:.0%}); best of {args.repeats}:")
    print(
        table(
            ["server", "output tok/s", "vs no drafts"],
            [
                [f"magnitude serve, {name}", f"{tps:.1f}", f"{tps / best['no drafts']:.2f}×"]
                for name, tps in best.items()
            ],
        )
    )


if __name__ == "__main__":
    main()
