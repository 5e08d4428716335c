"""The same agent-style workload through every API this server speaks, and embeddings beside llama.cpp's.

Part 1, generation: S sessions (default 8) run at once, R rounds each (default 6); every round sends
the whole conversation so far plus a new user message (distinct per session) over a shared system
prompt, streamed, greedy, 64 tokens (`ignore_eos`, llama.cpp's extra, which every route takes: the
same work whatever the API), as an agent resends its history. The same workload runs
through Chat Completions (`/v1/chat/completions`), the Responses API (`/v1/responses`, the history as
input items, as Codex CLI sends it; and a second time continuing with `previous_response_id`, only
the new message sent) and Anthropic's Messages API (`/v1/messages`), each on a freshly started
`magnitude serve` (so no run finds another's prompts cached; one short request warms it first),
alternating (each repeat starting with another API), best of three runs each. The APIs share one
engine path: their rows should be within a few percent of each other.

Part 2, embeddings: distinct texts (about 26 tokens each) through `/v1/embeddings`, one client,
calls of 1 and of 64 inputs, rows/s, against llama.cpp's `llama-server --embeddings --pooling mean`
on the same model (mean pooling is what ours does for a model whose GGUF names none).

    python benchmarks/protocols.py [--sessions 8] [--rounds 6] [--repeats 3] [--part generation|embeddings]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from _common import TOKEN, LlamaServer, MagnitudeServer, run_sessions, session_arguments, table

from magnitude_jupyter.calibrate.workflow import SYSTEM, session_message
from magnitude_jupyter.client.http import iter_sse

MODEL = "smollm2-135m"
EMBED_ROWS = {1: 64, 64: 512}  # inputs per call → rows embedded per run


@dataclass
class Answer:
    ttft: float
    text: str
    output_tokens: int
    input_tokens: int
    cached_tokens: int
    response_id: str | None = None


@dataclass
class Run:
    api: str
    seconds: float = 0.0
    tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttfts) * 1000 if self.ttfts else float("nan")


def _stream(http: httpx.Client, url: str, body: dict[str, Any], on_event: Callable[[dict[str, Any]], bool]) -> float:
    """POST a streamed request; `on_event` says whether an event carried answer text. TTFT seconds."""
    start = time.perf_counter()
    ttft = None
    with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for _, data in iter_sse(response.iter_lines()):
            if data == "[DONE]":
                break
            if on_event(json.loads(data)) and ttft is None:
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start


def chat_round(http: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int, _: Any) -> Answer:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *messages], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    usage: dict[str, Any] = {}

    def on_event(chunk: dict[str, Any]) -> bool:
        nonlocal usage
        usage = chunk.get("usage") or usage
        piece = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
        text.append(piece)
        return bool(piece)

    ttft = _stream(http, url + "/v1/chat/completions", body, on_event)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Answer(ttft, "".join(text), usage["completion_tokens"], usage["prompt_tokens"], cached)


def responses_round(
    http: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int, previous: str | None
) -> Answer:
    body: dict[str, Any] = {"model": MODEL, "instructions": SYSTEM, "max_output_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    if previous is not None:
        body |= {"previous_response_id": previous, "input": [messages[-1]]}
    else:
        body["input"] = messages
    text: list[str] = []
    final: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> bool:
        nonlocal final
        if event["type"] == "response.completed":
            final = event["response"]
        if event["type"] == "response.output_text.delta":
            text.append(event["delta"])
            return True
        return False

    ttft = _stream(http, url + "/v1/responses", body, on_event)
    usage = final["usage"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    return Answer(ttft, "".join(text), usage["output_tokens"], usage["input_tokens"], cached, final["id"])


def messages_round(http: httpx.Client, url: str, messages: list[dict[str, str]], max_tokens: int, _: Any) -> Answer:
    body = {"model": MODEL, "system": SYSTEM, "messages": messages, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    text: list[str] = []
    usage: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> bool:
        if event["type"] == "message_start":
            usage.update(event["message"]["usage"])
        elif event["type"] == "message_delta":
            usage.update(event["usage"])
        elif event["type"] == "content_block_delta" and event["delta"].get("type") == "text_delta":
            text.append(event["delta"]["text"])
            return True
        return False

    ttft = _stream(http, url + "/v1/messages", body, on_event)
    cached = usage.get("cache_read_input_tokens", 0)
    return Answer(ttft, "".join(text), usage["output_tokens"], usage["input_tokens"] + cached, cached)


APIS: dict[str, Callable[..., Answer]] = {
    "chat completions": chat_round,
    "responses (history as input)": responses_round,
    "responses (previous_response_id)": responses_round,
    "messages": messages_round,
}


def run_workload(api: str, url: str, sessions: int, rounds: int, max_tokens: int) -> Run:
    run = Run(api)
    lock = threading.Lock()
    one_round = APIS[api]
    chained = "previous_response_id" in api

    def session(i: int) -> None:
        messages: list[dict[str, str]] = []
        previous = None
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            for k in range(rounds):
                messages.append({"role": "user", "content": session_message(i, k)})
                try:
                    answer = one_round(http, url, messages, max_tokens, previous)
                except (httpx.HTTPError, KeyError):
                    with lock:
                        run.errors += 1
                    return
                messages.append({"role": "assistant", "content": answer.text})
                previous = answer.response_id if chained else None
                with lock:
                    run.tokens += answer.output_tokens
                    run.input_tokens += answer.input_tokens
                    run.cached_tokens += answer.cached_tokens
                    run.ttfts.append(answer.ttft)

    run.seconds = run_sessions(sessions, session)
    return run


OPENINGS = ["Rivers", "Markets", "Engines", "Gardens", "Bridges", "Harbours", "Orchards", "Libraries"]


def embedding_texts(count: int, offset: int) -> list[str]:
    """Distinct texts that differ from their first token on (no server can reuse a neighbour's prefix)."""
    return [
        f"{OPENINGS[(i + offset) % len(OPENINGS)]} report {offset + i}: "
        f"{['delays', 'growth', 'repairs', 'visitors'][i % 4]} in week {i % 52}, "
        f"noted by team {i * 7 + offset} after the {['spring', 'autumn'][i % 2]} review."
        for i in range(count)
    ]


def embed_rows_per_s(url: str, per_call: int, rows: int, offset: int) -> float:
    texts = embedding_texts(rows, offset)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
        # Warm: ours makes its embedding context on the first call, llama-server at start.
        http.post(url + "/v1/embeddings", json={"model": MODEL, "input": "warm up"}).raise_for_status()
        start = time.perf_counter()
        for i in range(0, rows, per_call):
            response = http.post(url + "/v1/embeddings", json={"model": MODEL, "input": texts[i : i + per_call]})
            response.raise_for_status()
            assert len(response.json()["data"]) == len(texts[i : i + per_call])
        return rows / (time.perf_counter() - start)


def main() -> None:
    def parts(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--part", choices=("all", "generation", "embeddings"), default="all")

    args = session_arguments(__doc__, rounds=6, max_tokens=64, repeats=3, more=parts)
    if args.part != "embeddings":
        generation(args)
    if args.part != "generation":
        embeddings(args)


def generation(args: argparse.Namespace) -> None:
    best: dict[str, Run] = {}
    names = list(APIS)
    for repeat in range(args.repeats):
        # Each repeat starts with another API: none always runs first, or after the same neighbour.
        for api in names[repeat % len(names) :] + names[: repeat % len(names)]:
            with MagnitudeServer(parallel=16, ctx_size=8192, threads=args.threads) as server:
                server.client.wait_ready()
                server.client.chat([{"role": "user", "content": "Warm up."}], max_tokens=4)
                run = run_workload(api, server.url, args.sessions, args.rounds, args.max_tokens)
            print(f"run {repeat + 1}: {api}: {run.tokens_per_s:.1f} tok/s, errors {run.errors}", flush=True)
            if api not in best or run.tokens_per_s > best[api].tokens_per_s:
                best[api] = run

    best = {api: best[api] for api in names}
    base = best["chat completions"]
    rows = [
        [
            api,
            f"{run.tokens:,}",
            f"{run.tokens_per_s:.1f}",
            f"{run.ttft_p50_ms:.0f}",
            f"{run.input_tokens:,}",
            f"{run.cached_tokens:,}",
            run.errors,
            f"{run.tokens_per_s / base.tokens_per_s:.3f}×",
            f"{run.ttft_p50_ms / base.ttft_p50_ms:.3f}×",
        ]
        for api, run in best.items()
    ]
    print(
        f"\n{args.sessions} sessions × {args.rounds} rounds, {args.max_tokens} tokens per answer, greedy, "
        f"streamed, {args.threads} threads, parallel 16, 8,192 cells; a fresh server per run, best of "
        f"{args.repeats} alternating runs"
    )
    headers = ["API", "output tokens", "output tok/s", "TTFT p50 ms", "input tokens", "cached", "errors"]
    print(table([*headers, "tok/s vs chat", "TTFT vs chat"], rows))


def embeddings(args: argparse.Namespace) -> None:
    embed_best: dict[tuple[str, int], float] = {}
    for repeat in range(args.repeats):
        servers: dict[str, Callable[[], Any]] = {
            "magnitude serve": lambda: MagnitudeServer(parallel=16, ctx_size=8192, threads=args.threads),
            "llama-server --embeddings": lambda: LlamaServer(
                args.binary, 16, 8192, args.threads, ("--embeddings", "--pooling", "mean")
            ),
        }
        for name, start in servers.items():
            server = start()
            try:
                if isinstance(server, MagnitudeServer):
                    server.client.wait_ready()
                for per_call, count in EMBED_ROWS.items():
                    rate = embed_rows_per_s(server.url, per_call, count, offset=1000 * repeat + per_call)
                    embed_best[(name, per_call)] = max(rate, embed_best.get((name, per_call), 0.0))
            finally:
                server.close()
            print(f"run {repeat + 1}: embeddings on {name} done", flush=True)
    embed_rows = []
    for per_call in EMBED_ROWS:
        ours, peer = embed_best[("magnitude serve", per_call)], embed_best[("llama-server --embeddings", per_call)]
        embed_rows.append([per_call, f"{ours:.1f}", f"{peer:.1f}", f"{ours / peer:.2f}×"])
    print(f"\nembeddings: one client, texts of about 26 tokens, {args.threads} threads, best of {args.repeats} runs")
    print(table(["inputs per call", "magnitude rows/s", "llama-server rows/s", "vs llama-server"], embed_rows))


if __name__ == "__main__":
    main()
