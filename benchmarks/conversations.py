"""Conversations, the way notebooks and agents hold them: every round resends the whole history.

S sessions (default 8) run at once, R rounds each (default 6); each round sends the conversation so
far plus a new user message (distinct per session), over a shared ~60-token system prompt, and
streams a 48-token greedy answer. The same workload runs against `magnitude serve` and llama.cpp's
own `llama-server` (built from the llama.cpp vendored in our pinned llama-cpp-python by
../shared/tools/build-llama-server.sh), alternating, best of two runs each, in one run of this script.
Each server's RSS is read at the end of its last run and again after it has idled two seconds.

    python benchmarks/conversations.py [--sessions 8] [--rounds 6] [--repeats 2] [--llama-server PATH]
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
from _common import (
    FLASH_ATTENTION,
    NO_DRAFTS,
    NO_SPILL,
    PEER_KEEP_IDLE_SLOTS,
    PEER_NO_FLASH_ATTENTION,
    SPILL_AFTER_64_ROWS,
    TOKEN,
    LlamaServer,
    MagnitudeServer,
    cached_of,
    chosen,
    refused_drafts,
    rows_decoded,
    run_sessions,
    session_arguments,
    step_split,
    table,
)

from magnitude_jupyter.calibrate.workflow import SYSTEM, session_message
from magnitude_jupyter.client.http import iter_sse

IDLE_SECONDS = 2.0  # RSS is read at the end of a run and again this long after


@dataclass
class Run:
    server: str
    seconds: float = 0.0
    tokens: int = 0
    ttft_by_round: dict[int, list[float]] = field(default_factory=dict)
    errors: int = 0
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # as each server reports it (usage.prompt_tokens_details.cached_tokens)
    refused: int = 0  # guessed tokens decoded and refused (magnitude's drafts; llama-server drafts none here)
    steps: str = "-"  # our engine thread per llama_decode call (/status steps)

    @property
    def rows(self) -> int:
        return rows_decoded(self.prompt_tokens, self.cached_tokens, self.tokens, self.answers, self.refused)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def ttft_p50(self, rounds: range) -> float:
        values = [v for r in rounds for v in self.ttft_by_round.get(r, [])]
        return statistics.median(values) * 1000 if values else float("nan")


def one_round(http: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict, str]:
    """(TTFT seconds, usage, answer text) of one streamed, greedy answer of exactly `max_tokens` tokens."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for _, data in iter_sse(response.iter_lines()):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # a server that fails mid-stream (the status was 200 already)
                raise httpx.HTTPError(f"error event: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return (ttft if ttft is not None else time.perf_counter() - start), usage, "".join(text)


def run_workload(name: str, url: str, sessions: int, rounds: int, max_tokens: int) -> Run:
    run = Run(name)
    lock = threading.Lock()

    def session(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            for k in range(rounds):
                messages.append({"role": "user", "content": session_message(i, k)})
                try:
                    ttft, usage, answer = one_round(http, url, messages, max_tokens)
                except httpx.HTTPError:
                    with lock:
                        run.errors += 1
                    return
                messages.append({"role": "assistant", "content": answer})
                with lock:
                    run.tokens += usage["completion_tokens"]
                    run.answers += 1
                    run.prompt_tokens += usage["prompt_tokens"]
                    run.cached_tokens += cached_of(usage)
                    run.ttft_by_round.setdefault(k + 1, []).append(ttft)

    run.seconds = run_sessions(sessions, session)
    return run


def main() -> None:
    args = session_arguments(__doc__, rounds=6, max_tokens=48)
    binary = args.binary

    servers = {
        "magnitude serve": lambda: MagnitudeServer(parallel=16, ctx_size=8192, threads=args.threads),
        # The same server without prompt-lookup drafts (engine/speculate.py): what they bring, this run.
        "magnitude serve, no drafts": lambda: MagnitudeServer(
            NO_DRAFTS, parallel=16, ctx_size=8192, threads=args.threads
        ),
        # ... and with idle cache entries held in KV cells until needed (engine.prefix_cache_spill_rows).
        "magnitude serve, no spill": lambda: MagnitudeServer(
            NO_SPILL, parallel=16, ctx_size=8192, threads=args.threads
        ),
        # ... and moving them after 64 idle rows, not once a step decodes without them (the clock before).
        "magnitude serve, spill after 64 rows": lambda: MagnitudeServer(
            SPILL_AFTER_64_ROWS, parallel=16, ctx_size=8192, threads=args.threads
        ),
        # ... and with llama.cpp's flash attention, which a CPU runs without by default (engine.flash_attention).
        "magnitude serve, flash attention": lambda: MagnitudeServer(
            FLASH_ATTENTION, parallel=16, ctx_size=8192, threads=args.threads
        ),
        "llama-server": lambda: LlamaServer(binary, parallel=16, ctx_size=8192, threads=args.threads),
        # The peer with its attention as ours runs by default: the kernel's share of the difference.
        "llama-server -fa off": lambda: LlamaServer(binary, 16, 8192, args.threads, PEER_NO_FLASH_ATTENTION),
        # ... and with its idle slots' cells left in place: what writing a conversation back in one piece brings it.
        "llama-server --no-cache-idle-slots": lambda: LlamaServer(binary, 16, 8192, args.threads, PEER_KEEP_IDLE_SLOTS),
    }
    servers = chosen(servers, args.servers)
    best: dict[str, Run] = {}
    rss: dict[str, tuple[int, int]] = {}
    for repeat in range(args.repeats):
        for name, start in servers.items():
            server = start()
            try:
                run = run_workload(name, server.url, args.sessions, args.rounds, args.max_tokens)
                process = psutil.Process(server.proc.pid)
                # At the end, and once the server has idled IDLE_SECONDS (ours brings saved cache entries
                # back into its KV cells then, giving their host memory back): both servers alike.
                at_end = process.memory_info().rss
                time.sleep(IDLE_SECONDS)
                rss[name] = (at_end, process.memory_info().rss)
                if not isinstance(server, LlamaServer):
                    status = server.client.status()
                    run.refused = refused_drafts(status)
                    run.steps = step_split(None, status["steps"])
            finally:
                server.close()
            print(f"run {repeat + 1}: {name}: {run.tokens_per_s:.1f} tok/s, errors {run.errors}", flush=True)
            if name not in best or run.tokens_per_s > best[name].tokens_per_s:
                best[name] = run

    peer = best["llama-server"]
    rows = []
    for name, run in best.items():
        by_round = " / ".join(f"{run.ttft_p50(range(r, r + 1)):.0f}" for r in range(1, args.rounds + 1))
        rows.append(
            [
                name,
                f"{run.tokens_per_s:.1f}",
                f"{run.ttft_p50(range(2, args.rounds + 1)):.0f}",
                by_round,
                " / ".join(f"{b / 2**20:.0f}" for b in rss[name]),
                f"{run.prompt_tokens - run.cached_tokens:,}",
                f"{run.rows:,}",
                f"{run.rows / run.seconds:.1f}",
                run.errors,
                run.steps,
                f"{run.tokens_per_s / peer.tokens_per_s:.2f}×",
            ]
        )
    print(
        f"{args.sessions} sessions × {args.rounds} rounds, {args.max_tokens} tokens per answer, greedy, streamed, "
        f"{args.threads} threads, parallel 16, 8,192 cells (llama-server: -np 16 --kv-unified -c 8192); "
        f"best of {args.repeats} alternating runs"
    )
    headers = ["server", "output tok/s", "TTFT p50 rounds 2+ ms", "TTFT p50 by round ms"]
    headers += [f"RSS MiB, end / {IDLE_SECONDS:.0f} s idle"]
    headers += ["prompt tokens computed", "rows decoded", "rows/s", "errors", "our llama_decode + rest per call"]
    print(table([*headers, "vs llama-server"], rows))
    print(
        "rows decoded: prompt tokens computed + answer tokens decoded + guessed tokens refused, i.e. the work "
        "each server did; rows/s is how fast the machine did it. A prompt row costs less than an answer row "
        "(llama-batched-bench: S_PP above S_TG), so rows/s only compares servers whose mix of the two is alike. "
        "The last column splits our engine thread's time per llama_decode call (/status steps): inside it, "
        "and the rest of the step (planning, sampling, events)."
    )


if __name__ == "__main__":
    main()
