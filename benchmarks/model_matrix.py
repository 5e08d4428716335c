"""Every chat family on the same footing: KV arithmetic against llama.cpp, sessions that fit, and the
conversation workload against llama.cpp's server on the same file.

For each family the project's tiny random-weight models cover (magnitude_jupyter/models/tiny_models.py,
written with the family's own template so both servers render the same prompts), plus the bundled
model: the KV bytes per cell the plan counts (a sliding-window model's windowed layers at a window per
sequence) against the buffer llama.cpp reports, the sessions of 8,192 tokens that fit in 1 GiB, and
S sessions x R rounds of conversation (conversations.py's workload: each round resends the history)
against `magnitude serve` and `llama-server --jinja`, alternating, best of `--repeats` runs each (a
run of a tiny model lasts seconds: one alone is noise), with the ratio of the runs' medians and
every run's range beside it: output tok/s and the share of prompt tokens
each server took from its cache (ours also counts what a sliding window kept from being reused, and
what came through window checkpoints).

A windowed family (Gemma 3, gpt-oss) is written at each of `--windows` (realistic: 512 and 1,024), and
every model runs at each of `--parallel`.

The raw ceiling comes first: `llama-batched-bench` on each file, PARALLEL sequences of a 128-token
prompt and 64 answer tokens, flash attention on and off (the better is shown), the rate llama.cpp
reaches with nothing but those sequences in its cells; `--ceiling-only` prints just that table.

    python benchmarks/model_matrix.py [--sessions 16] [--rounds 6] [--max-tokens 64] [--repeats 3]
        [--families a,b] [--windows 512,1024] [--parallel 4,16] [--no-bundled] [--ceiling-only] [--spill-rows N]
"""

from __future__ import annotations

import itertools
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import LlamaServer, MagnitudeServer, session_arguments, table
from conversations import Run, run_workload

from magnitude_jupyter.models.chat_formats import family_named
from magnitude_jupyter.models.kvmath import kv_layout
from magnitude_jupyter.models.registry import bundled_model_path, read_model_info
from magnitude_jupyter.models.tiny_models import ARCHITECTURES, TinyShape, write_tiny_model

CTX = 8192


# Cells at a parallel level: 8,192, and 2,048 a slot above 4 (llama-server ends 16 sessions' requests
# with "Context size has been exceeded" at 8,192 and, on a windowed model, at 16,384).
def cells(parallel: int) -> int:
    return max(CTX, 2048 * parallel)


# llama-server's gpt-oss parser ends a random-weight model's answers ("does not match the expected
# peg-native format"), so its answers are left unparsed; the prompt is still the file's template, as
# ours is (--no-jinja would render its built-in format instead: half the tokens of a first prompt).
PEER_FLAGS = {"gpt-oss": ("--jinja", "--skip-chat-parsing")}


def peer_flags(kind: str) -> tuple[str, ...]:
    """llama-server's flags for a model of `kind`: the file's template, and what PEER_FLAGS adds."""
    return PEER_FLAGS.get(kind, ("--jinja",))


GIB = 1 << 30
SESSION_CONTEXT = 8192
# Wider than the tests' models, so a step does some arithmetic; still a few MB.
SHAPE = TinyShape(layers=6, embedding=256, heads=8, kv_heads=4, head_dim=32, feed_forward=512, context=CTX)


def models(folder: Path, kinds: list[str], windows: list[int], bundled: bool) -> dict[str, tuple[Path, str]]:
    """Each model to run, by its row's name: its file and its kind."""
    out: dict[str, tuple[Path, str]] = {}
    if bundled:
        path = bundled_model_path()
        assert path is not None
        out["bundled (SmolLM2, ChatML)"] = (path, "bundled")
    for kind in kinds:
        arch = ARCHITECTURES[kind]
        family = family_named(arch.family)
        assert family is not None
        for window in windows if arch.sliding_window else [0]:
            name = f"tiny {kind} ({family.name})" + (f", window {window}" if window else "")
            path = write_tiny_model(
                folder / f"tiny-{kind}-{window}.gguf",
                kind,
                template=family.template,
                shape=SHAPE,
                sliding_window=window or None,
            )
            out[name] = (path, kind)
    return out


def one_model_arguments(parser, family: str) -> None:
    """The options of a script that runs one file against both servers (cells_scanned, ubatch_costs)."""
    parser.add_argument("--model", default=None, help="a GGUF file, or bundled (default: a tiny --family)")
    parser.add_argument("--family", default=family, help="tiny model family (models/tiny_models.py)")
    parser.add_argument("--window", type=int, default=1024, help="its sliding window, if it has one")
    parser.add_argument("--parallel", type=int, default=16)


def one_model(args, folder: Path) -> tuple[Path, str, str]:
    """The file `one_model_arguments` chose (a tiny model is written into `folder`): its path, its kind
    (a tiny family, or bundled), and how a table's title names it."""
    if args.model == "bundled":
        bundled = bundled_model_path()
        assert bundled is not None
        return bundled, "bundled", "the bundled model"
    if args.model:
        return Path(args.model), args.family, Path(args.model).name
    family = family_named(ARCHITECTURES[args.family].family)
    assert family is not None
    window = args.window if ARCHITECTURES[args.family].sliding_window else None
    path = write_tiny_model(
        folder / "model.gguf", args.family, template=family.template, shape=SHAPE, sliding_window=window
    )
    return path, args.family, args.family + (f", window {window}" if window else "")


def ceiling(binary: str, path: Path, parallel: int, threads: int) -> tuple[float, float, str]:
    """llama-batched-bench's (decode tok/s, prompt and decode tok/s, flash attention) on `path` with
    `parallel` sequences, the better of flash attention on and off by decode rate."""
    bench = Path(binary).with_name("llama-batched-bench")
    best = (0.0, 0.0, "-")
    for fa in ("on", "off"):
        cmd = [str(bench), "-m", str(path), "-c", str(cells(parallel)), "-b", "2048", "-ub", "512"]
        cmd += ["-npp", "128", "-ntg", "64", "-npl", str(parallel), "-t", str(threads), "-kvu", "-fa", fa]
        for _ in range(2):  # a run that printed no table row is run once more, then reported
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |, on stdout or stderr
            # by build: each stream read apart, since one pipe for both can split a line.
            lines = (done.stdout + "\n" + done.stderr).splitlines()
            rows = [line for line in lines if line.startswith("|") and line[1:].strip()[:1].isdigit()]
            if rows:
                break
        else:
            raise RuntimeError(f"llama-batched-bench printed no table row: {' '.join(cmd)}\n{done.stdout[-2000:]}")
        row = [c.strip() for c in rows[-1].strip("|").split("|")]
        decode, overall = float(row[7]), float(row[9])
        if decode > best[0]:
            best = (decode, overall, fa)
    return best


def ceiling_table(chosen: dict[str, tuple[Path, str]], levels: list[int], args) -> str:
    rows = []
    for (name, (path, _)), parallel in itertools.product(chosen.items(), levels):
        decode, overall, fa = ceiling(args.binary, path, parallel, args.threads)
        rows.append([name, parallel, f"{decode:.1f}", f"{overall:.1f}", fa])
    head = f"llama-batched-bench -npp 128 -ntg 64 -npl PARALLEL -c CELLS -b 2048 -ub 512 -kvu -t {args.threads}"
    return (
        head
        + "\n"
        + table(["model", "parallel", "decode tok/s (S_TG)", "prompt + decode tok/s (S)", "flash attention"], rows)
    )


def best_runs(
    path: Path, parallel: int, args, flags: tuple[str, ...]
) -> tuple[Run, Run, dict, dict, list[float], list[float]]:
    """Both servers on one file, alternating, `args.repeats` times: the best run of each (by output
    tok/s), our status at the start and after our best run, and every run's tok/s (ours, the peer's)."""
    ours_best = peer_best = None
    first: dict = {}
    after: dict = {}
    ours_rates: list[float] = []
    peer_rates: list[float] = []
    for _ in range(args.repeats):
        config = "" if args.spill_rows is None else f"engine:\n  prefix_cache_spill_rows: {args.spill_rows}\n"
        ours = MagnitudeServer(config, parallel=parallel, ctx_size=cells(parallel), threads=args.threads, model=path)
        try:
            first = first or ours.client.status()
            run = run_workload("magnitude serve", ours.url, args.sessions, args.rounds, args.max_tokens)
            ours_rates.append(run.tokens_per_s)
            if ours_best is None or run.tokens_per_s > ours_best.tokens_per_s:
                ours_best, after = run, ours.client.status()
        finally:
            ours.close()
        peer = LlamaServer(args.binary, parallel, cells(parallel), args.threads, flags, model=path)
        try:
            run = run_workload("llama-server", peer.url, args.sessions, args.rounds, args.max_tokens)
            peer_rates.append(run.tokens_per_s)
            if peer_best is None or run.tokens_per_s > peer_best.tokens_per_s:
                peer_best = run
        finally:
            peer.close()
    assert ours_best is not None and peer_best is not None
    return ours_best, peer_best, first, after, ours_rates, peer_rates


def spread(rates: list[float]) -> str:
    return f"{min(rates):.0f}–{max(rates):.0f}"


def main() -> None:
    def more(parser) -> None:
        parser.add_argument("--families", default=",".join(sorted(ARCHITECTURES)), help="tiny models to run")
        parser.add_argument("--windows", default="512,1024", help="sliding windows of the windowed families")
        parser.add_argument("--parallel", default="4,16", help="request slots, each a row")
        parser.add_argument("--no-bundled", action="store_true", help="only the tiny models")
        parser.add_argument("--ceiling-only", action="store_true", help="only llama-batched-bench's table")
        parser.add_argument("--spill-rows", type=int, default=None, help="ours with engine.prefix_cache_spill_rows set")

    args = session_arguments(__doc__, rounds=6, max_tokens=64, repeats=3, more=more, sessions=16)
    windows = [int(w) for w in args.windows.split(",")]
    levels = [int(p) for p in args.parallel.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="magnitude-matrix-") as tmp:
        chosen = models(Path(tmp), args.families.split(","), windows, not args.no_bundled)
        print(ceiling_table(chosen, levels, args), flush=True)
        if args.ceiling_only:
            return
        for (name, (path, kind)), parallel in itertools.product(chosen.items(), levels):
            info = read_model_info(path)
            session = kv_layout(info, SESSION_CONTEXT).session_bytes(SESSION_CONTEXT)
            flags = peer_flags(kind)
            run_ours, run_peer, status, after, ours_rates, peer_rates = best_runs(path, parallel, args, flags)
            reported = status.get("kv_buffer_bytes_reported")
            planned, bpt = status["kv_bytes_planned"], status["kv_bytes_per_token"]
            window = status.get("kv_window")
            missed = after.get("prompt_tokens_window_missed", 0)
            checkpointed = after.get("prompt_tokens_window_checkpoint", 0)
            swa = f"{info.sliding_window} on {info.sliding_window_layers}/{info.layers}" if info.sliding_window else "-"
            if window:
                swa += f", {window['cells']:,} cells"
            rows.append(
                [
                    name,
                    parallel,
                    swa,
                    f"{bpt:,.0f}",
                    f"{planned / 2**20:,.2f}",
                    f"{reported / 2**20:,.2f}" if reported else "-",
                    f"{GIB // session:,.0f}",
                    f"{run_ours.tokens_per_s:.1f}",
                    f"{run_peer.tokens_per_s:.1f}",
                    f"{run_ours.tokens_per_s / run_peer.tokens_per_s:.2f}×" if run_peer.tokens_per_s else "-",
                    f"{statistics.median(ours_rates) / statistics.median(peer_rates):.2f}×"
                    if statistics.median(peer_rates)
                    else "-",
                    f"{spread(ours_rates)} / {spread(peer_rates)}",
                    f"{run_ours.cached_tokens / max(1, run_ours.prompt_tokens):.0%}"
                    + (
                        f" ({checkpointed / max(1, run_ours.prompt_tokens):.0%} checkpoints, "
                        f"{missed / max(1, run_ours.prompt_tokens):.0%} missed)"
                        if window
                        else ""
                    ),
                    f"{run_peer.cached_tokens / max(1, run_peer.prompt_tokens):.0%}",
                    f"{run_ours.errors} / {run_peer.errors}",
                    "on" if after.get("flash_attention") else "off",
                ]
            )
    print(
        f"{args.sessions} sessions x {args.rounds} rounds, {args.max_tokens} tokens per answer, greedy, best of "
        f"{args.repeats} alternating runs, "
        f"{args.threads} threads, "
        + ("" if args.spill_rows is None else f"ours with prefix_cache_spill_rows {args.spill_rows}, ")
        + "CELLS cells (llama-server: -np PARALLEL --kv-unified "
        f"-c CELLS --jinja, gpt-oss also --skip-chat-parsing), CELLS 8,192 or 2,048 a slot above 4; "
        f"tiny models: {SHAPE.layers} layers x {SHAPE.embedding}, random F32 weights"
    )
    print(
        table(
            [
                "model",
                "parallel",
                "sliding window",
                "KV bytes/cell (global)",
                "planned KV MiB",
                "llama.cpp KV MiB",
                "8k sessions in 1 GiB",
                "ours tok/s",
                "llama-server tok/s",
                "ratio",
                "ratio of medians",
                "every run: ours / llama-server tok/s",
                "ours cached",
                "llama-server cached",
                "errors (ours / llama-server)",
                "our flash attention (the probe's)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
