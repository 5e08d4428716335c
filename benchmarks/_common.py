"""Shared bits of the benchmark scripts: prompts, table printing, and `magnitude serve` in a child process."""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from magnitude_jupyter.client.http import Client
from magnitude_jupyter.client.runtime import LocalServer, free_port
from magnitude_jupyter.engine.runner import repack_weights
from magnitude_jupyter.models.registry import bundled_model_path

TOKEN = "bench-token"

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List ten uses for a paperclip:",
    "The history of the printing press",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your summer.",
    "What are the benefits of regular exercise?",
    "Once upon a time, in a distant kingdom,",
    "Give step-by-step instructions to bake bread.",
    "Summarize the plot of a mystery novel you invent.",
    "Why is the sky blue? Explain thoroughly.",
    "Write a product review for a pair of headphones.",
    "Describe a walk through a busy city market.",
    "Explain the rules of chess briefly.",
    "Write a poem about the ocean at night.",
    "What makes a good teacher? Discuss.",
]


def closed_loop(
    engine: Any, prompts: list[str], params: Any, concurrency: int, chat: bool = False
) -> tuple[int, float]:
    """In-process, closed loop: `concurrency` clients, each sending the next of `prompts` (as a chat
    message with `chat`) when its last answer is complete; (output tokens, seconds)."""
    work: queue.Queue[str] = queue.Queue()
    for prompt in prompts:
        work.put(prompt)
    counts: list[int] = []

    def client() -> None:
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            if chat:
                result = engine.generate(messages=[{"role": "user", "content": prompt}], params=params)
            else:
                result = engine.generate(prompt, params=params)
            counts.append(result.usage["completion_tokens"])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - start


NO_DRAFTS = "engine:\n  draft_tokens: 0\n"  # a config for `magnitude serve` without prompt-lookup drafts
# ... and one whose idle cache entries stay in KV cells until needed (engine.prefix_cache_spill_rows)
NO_SPILL = "engine:\n  prefix_cache_spill_rows: 0\n"
# ... and one that moves them after 64 idle rows (the default moves them once a step decodes without them)
SPILL_AFTER_64_ROWS = "engine:\n  prefix_cache_spill_rows: 64\n"
# llama-server keeping its idle slots' cells where they are (by default it saves and clears them
# when a task starts, and loads a slot's saved state back in one piece when its conversation returns)
PEER_KEEP_IDLE_SLOTS = ("--no-cache-idle-slots",)
# ... and one with llama.cpp's flash attention, off by default on a CPU (engine.flash_attention)
FLASH_ATTENTION = "engine:\n  flash_attention: true\n"
# llama-server with its attention as ours runs by default ("auto" is flash attention on a CPU): the
# kernel's share of the difference, measured beside the peer as the issue runs it.
PEER_NO_FLASH_ATTENTION = ("-fa", "off")


def cached_of(usage: dict | None) -> int:
    """The prompt tokens a server says it took from its cache (OpenAI's usage.prompt_tokens_details)."""
    return int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def rows_decoded(prompt_tokens: int, cached_tokens: int, answer_tokens: int, answers: int, refused: int) -> int:
    """Tokens that went through llama_decode: the prompt tokens not taken from a cache (as the server
    reports them), one row per answer token but the last (it is sampled, never decoded; a guessed
    token the picks confirmed is one of these), and the guessed tokens the picks refused (ours;
    llama-server drafts none in these benchmarks). Our server counts the same rows itself (/status
    `steps`); this form works for any server's `usage`."""
    return prompt_tokens - cached_tokens + answer_tokens - answers + refused


def refused_drafts(status: dict) -> int:
    """Guessed tokens our server decoded that its picks did not confirm, from /status."""
    return int(status["draft_tokens_total"]) - int(status["draft_accepted_total"])


def step_split(before: dict | None, after: dict) -> str:
    """Our engine thread per llama_decode call between two /status `steps` readings: ms inside it, ms
    of the rest of the step (planning, sampling, events), and the rows a call computed."""
    before = before or {"decode_calls": 0, "decode_rows": 0, "decode_seconds": 0.0, "step_seconds": 0.0}
    calls = after["decode_calls"] - before["decode_calls"]
    if not calls:
        return "-"
    decode = after["decode_seconds"] - before["decode_seconds"]
    rest = after["step_seconds"] - before["step_seconds"] - decode
    rows = after["decode_rows"] - before["decode_rows"]
    return f"{decode / calls * 1000:.2f} + {rest / calls * 1000:.2f} ms × {calls:,} ({rows / calls:.1f} rows)"


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LlamaServer:
    """llama.cpp's own server (the peer that counts), built by ../shared/tools/build-llama-server.sh."""

    def __init__(
        self,
        binary: str,
        parallel: int,
        ctx_size: int,
        threads: int,
        extra_args: tuple[str, ...] = (),
        model: str | Path | None = None,
        log: Any = subprocess.DEVNULL,
    ) -> None:
        """`log`: where its output goes."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = str(model or bundled_model_path())
        cmd = [binary, "-m", path, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["-np", str(parallel), "--kv-unified", "-c", str(ctx_size), "-t", str(threads), "--api-key", TOKEN]
        cmd += peer_repack_args() + list(extra_args)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not start")

    def close(self) -> None:
        stop_process(self.proc)


def use_our_weight_layout() -> None:
    """Make llama-cpp-python's `Llama` (a baseline) load weights in the layout ours uses (engine.repack):
    it has no argument for it, and with a build's AMX kernels its default layout crashes
    (docs/decisions.md, "repacked weights"). Call before creating a `Llama`."""
    import llama_cpp.llama_cpp as low_level  # the module `Llama` takes its default parameters from

    default_params = low_level.llama_model_default_params

    def model_params() -> Any:
        params = default_params()
        params.use_extra_bufts = repack_weights(None)
        return params

    low_level.llama_model_default_params = model_params


def peer_repack_args() -> list[str]:
    """llama-server's weight layout as ours (engine/runner.py `repack_weights`): where our build turns
    repacking off (its AMX kernels crash; the peer's, built from the same sources, too), so does the peer."""
    return [] if repack_weights(None) else ["--no-repack"]


def find_llama_server(given: str | None) -> str | None:
    candidates = [given, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")]
    candidates.append(str(Path.home() / ".cache/magnitude-peers/llama.cpp-0.3.36/bin/llama-server"))
    return next((c for c in candidates if c and Path(c).is_file()), None)


class MagnitudeServer(LocalServer):
    """`magnitude serve` for a benchmark (`runtime.LocalServer`, isolated config), with a client on it."""

    def __init__(
        self,
        config: str = "",
        parallel: int = 8,
        threads: int | None = None,
        ctx_size: int = 8192,
        model: str | Path | None = None,
        log: Any = subprocess.DEVNULL,
        verbose: bool = False,
    ) -> None:
        """`log`: where its output goes; `verbose`: llama.cpp's log in it too."""
        args = ["--parallel", str(parallel), "--ctx-size", str(ctx_size)] + (["--verbose"] if verbose else [])
        if threads is not None:
            args += ["--threads", str(threads)]
        if model is not None:
            args += ["--model", str(model)]
        super().__init__(args, token=TOKEN, config=config, log=log)
        self.client = Client(self.url, TOKEN)

    def close(self) -> None:
        self.client.close()
        self.stop()

    def __exit__(self, *exc: object) -> None:
        self.close()


SERVERS_HELP = "names of the servers to run, each quoted (default: all; llama-server always runs)"


def chosen(servers: dict[str, Any], names: list[str] | None, peer: str = "llama-server") -> dict[str, Any]:
    """The servers `--servers` names (all by default), the `peer` always: the ratios' base."""
    if not names:
        return servers
    wanted = set(names) | {peer}
    unknown = wanted - set(servers)
    if unknown:
        raise SystemExit(f"unknown server {sorted(unknown)[0]!r}: choose from {', '.join(servers)}")
    return {name: start for name, start in servers.items() if name in wanted}


def session_arguments(
    description: str | None,
    rounds: int,
    max_tokens: int,
    peer: bool = True,
    repeats: int = 2,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
    sessions: int = 8,
) -> argparse.Namespace:
    """The options of the session benchmarks (conversations, agents, drafts), llama-server found if `peer`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=sessions)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-server", default=None, help="path (default: the shared build's cache)")
    parser.add_argument("--servers", nargs="+", default=None, help=SERVERS_HELP)
    if more is not None:
        more(parser)
    args = parser.parse_args()
    args.binary = find_llama_server(args.llama_server)
    if args.binary is None and peer:
        raise SystemExit("llama-server not found: run ../shared/tools/build-llama-server.sh first")
    return args


def run_sessions(sessions: int, session: Callable[[int], None]) -> float:
    """Run `session(i)` for every session at once, on threads; the seconds they took together."""
    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start
