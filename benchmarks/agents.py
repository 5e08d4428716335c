"""Agents: sessions that call tools round after round, against `magnitude serve` and llama.cpp's own
`llama-server` (`--jinja`, its tool calling; built by ../shared/tools/build-llama-server.sh).

S sessions (default 8) run at once, R rounds each (default 4): every round but the last must call
one of two tools (tool_choice "required": a calculator and a lookup table, agent_tools.py, real
Python run by this script), whose result goes back in the next round; the last round answers in
text (tool_choice "none"). Each session has its own task (different cities), over one system
prompt. Every round resends the whole history, calls and results included: what the prefix cache
keeps decides the later rounds. Greedy, streamed; alternating servers, best of two runs each.

Per server: wall time, output tokens/s, round latency by round, time to the first token by round,
how many calls came back and how many of their arguments validate against the tool's schema, and
prompt tokens served from cache (as each server reports them).

`--system-tokens N` makes the shared system prompt about N tokens long with a reference of further
tools (as agents send: one long prompt of tool descriptions, the same for every session): the
sessions arrive together, so round 1 shows whether a server computes that prompt once or once per
session.

    python benchmarks/agents.py [--sessions 8] [--rounds 4] [--repeats 2] [--system-tokens 0]
                                [--llama-server PATH]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    FLASH_ATTENTION,
    TOKEN,
    LlamaServer,
    MagnitudeServer,
    cached_of,
    chosen,
    run_sessions,
    session_arguments,
    table,
)

from magnitude_jupyter.api.tools import tool_request
from magnitude_jupyter.calibrate.agent_tools import agent_task
from magnitude_jupyter.calibrate.workflow import SYSTEM, agent_tools
from magnitude_jupyter.client.agent import answer_call, tool_message
from magnitude_jupyter.client.http import StreamResult, iter_sse
from magnitude_jupyter.engine.tools import GENERIC, generic_messages, parse_answer, tools_grammar


def long_system(tokens: int) -> str:
    """SYSTEM and a reference of made-up tools, about `tokens` tokens in all (4 characters a token)."""
    text = SYSTEM
    i = 0
    while len(text) < 4 * tokens:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"}, "limit": {"type": "integer"}}}
        text += (
            f"\n\nReference tool {i}: records_{i}. Looks up entry {i} of the archive and returns its fields as "
            f"JSON. Parameters: {json.dumps(schema)}. Not callable in this task."
        )
        i += 1
    return text


@dataclass
class Run:
    server: str
    seconds: float = 0.0
    tokens: int = 0
    latency_by_round: dict[int, list[float]] = field(default_factory=dict)
    ttft_by_round: dict[int, list[float]] = field(default_factory=dict)
    calls: int = 0
    valid_calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def p50(self, values: dict[int, list[float]], rounds: range) -> float:
        flat = [v for r in rounds for v in values.get(r, [])]
        return statistics.median(flat) * 1000 if flat else float("nan")


def request_body(messages: list[dict], choice: str, max_tokens: int, client_side: bool) -> dict:
    """The round's request: OpenAI `tools`, or (`client_side`) the same prompt and grammar that
    magnitude makes of them, written out by the client: the same tokens for a server without tools."""
    tools = [tool.openai() for tool in agent_tools()]
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not client_side:
        return {**body, "messages": messages, "tools": tools, "tool_choice": choice}
    request = tool_request(tools, choice)
    prompt = generic_messages(messages, request.tools, lambda content, _: content or "")
    return {**body, "messages": prompt, "grammar": tools_grammar(request, GENERIC.name)}


def one_round(http: httpx.Client, url: str, messages: list[dict], choice: str, max_tokens: int, client_side: bool):
    """(seconds in all, seconds to the first token, the answer put together, with its usage)."""
    body = request_body(messages, choice, max_tokens, client_side)
    result = StreamResult()
    start = time.perf_counter()
    first: float | None = None
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code >= 400:
            response.read()
            raise httpx.HTTPStatusError(response.text[:300], request=response.request, response=response)
        for _, data in iter_sse(response.iter_lines()):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                # The first token's chunk: its role, text or a call's first piece (a call is streamed once
                # its name is whole, some tokens in: that is not when the first token came).
                if first is None and (delta.get("role") or delta.get("content") or delta.get("tool_calls")):
                    first = time.perf_counter() - start
                result.text += delta.get("content") or ""
                result.finish_reason = c.get("finish_reason") or result.finish_reason
                result.add_tool_call_deltas(delta.get("tool_calls") or [])
            if chunk.get("usage"):
                result.usage = chunk["usage"]
    elapsed = time.perf_counter() - start
    if client_side:  # read the calls out of the text, as magnitude does
        answer = parse_answer(result.text, GENERIC.name)
        if answer.is_call:
            result.text = ""
            if result.finish_reason == "stop" and all(call.complete for call in answer.calls):
                result.finish_reason = "tool_calls"
            for i, call in enumerate(answer.calls):
                function = {"name": call.name, "arguments": call.arguments}
                result.tool_calls.append({"id": f"call_{i}", "type": "function", "function": function})
    return elapsed, first if first is not None else elapsed, result


def run_workload(
    name: str, url: str, sessions: int, rounds: int, max_tokens: int, client_side: bool, system: str = SYSTEM
) -> Run:
    run = Run(name)
    lock = threading.Lock()
    tools = {tool.name: tool for tool in agent_tools()}
    schemas = {tool.name: tool.parameters for tool in agent_tools()}

    def session(i: int) -> None:
        messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": agent_task(i)}]
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            for k in range(rounds):
                choice = "required" if k < rounds - 1 else "none"
                try:
                    elapsed, ttft, result = one_round(http, url, messages, choice, max_tokens, client_side)
                except httpx.HTTPError as exc:
                    print(f"  {name}: session {i} round {k + 1}: {exc}", flush=True)
                    with lock:
                        run.errors += 1
                    return
                valid = 0
                for call in result.tool_calls:
                    try:
                        jsonschema.validate(
                            json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]
                        )
                        valid += 1
                    except (ValueError, KeyError, jsonschema.ValidationError):
                        pass
                with lock:
                    run.tokens += int((result.usage or {}).get("completion_tokens") or 0)
                    run.prompt_tokens += int((result.usage or {}).get("prompt_tokens") or 0)
                    run.cached_tokens += cached_of(result.usage)
                    run.calls += len(result.tool_calls)
                    run.valid_calls += valid
                    run.latency_by_round.setdefault(k + 1, []).append(elapsed)
                    run.ttft_by_round.setdefault(k + 1, []).append(ttft)
                if not result.tool_calls:
                    messages.append({"role": "assistant", "content": result.text})
                    continue
                if result.finish_reason != "tool_calls":  # max_tokens cut the call short
                    print(f"  {name}: session {i} round {k + 1}: the call was cut short", flush=True)
                    with lock:
                        run.errors += 1
                    return
                messages.append({"role": "assistant", "content": None, "tool_calls": result.tool_calls})
                messages += [tool_message(call["id"], *answer_call(tools, call)) for call in result.tool_calls]

    run.seconds = run_sessions(sessions, session)
    return run


def options(parser: Any) -> None:
    parser.add_argument("--system-tokens", type=int, default=0, help="the shared system prompt's length")
    parser.add_argument("--ctx-size", type=int, default=8192, help="KV cells of each server")


def main() -> None:
    args = session_arguments(
        __doc__,
        rounds=4,
        max_tokens=96,
        more=options,
    )
    binary = args.binary
    system = long_system(args.system_tokens) if args.system_tokens else SYSTEM

    # (start, client_side): llama-server's own tool calling (--jinja) drops the tools of a template that
    # knows none (the bundled model's); given magnitude's prompt and grammar it does the same work.
    def ours(config: str = "") -> Any:
        return MagnitudeServer(config, parallel=16, ctx_size=args.ctx_size, threads=args.threads)

    servers = {
        "magnitude serve": (ours, False),
        # The same server with flash attention forced on (this workload computes long prompts), and
        # charging every request its whole max_tokens: what each default costs here, this run.
        "magnitude serve, flash attention": (lambda: ours(FLASH_ATTENTION), False),
        "magnitude serve, admission reserve": (lambda: ours("engine:\n  admission: reserve\n"), False),
        "llama-server, our prompt+grammar": (lambda: LlamaServer(binary, 16, args.ctx_size, args.threads), True),
        "llama-server --jinja, its tools": (
            lambda: LlamaServer(binary, 16, args.ctx_size, args.threads, extra_args=("--jinja",)),
            False,
        ),
    }
    servers = chosen(servers, args.servers, peer="llama-server, our prompt+grammar")
    best: dict[str, Run] = {}
    for repeat in range(args.repeats):
        for name, (start, client_side) in servers.items():
            server = start()
            try:
                run = run_workload(name, server.url, args.sessions, args.rounds, args.max_tokens, client_side, system)
            finally:
                server.close()
            print(
                f"run {repeat + 1}: {name}: {run.tokens_per_s:.1f} tok/s, round p50 "
                f"{run.p50(run.latency_by_round, range(1, args.rounds + 1)):.0f} ms, errors {run.errors}",
                flush=True,
            )
            if name not in best or run.seconds < best[name].seconds:
                best[name] = run

    peer = best["llama-server, our prompt+grammar"]
    rows = []
    for name, run in best.items():
        by_round = " / ".join(
            f"{run.p50(run.latency_by_round, range(r, r + 1)):.0f}" for r in range(1, args.rounds + 1)
        )
        ttft_by_round = " / ".join(
            f"{run.p50(run.ttft_by_round, range(r, r + 1)):.0f}" for r in range(1, args.rounds + 1)
        )
        round_1 = run.p50(run.ttft_by_round, range(1, 2)) / peer.p50(peer.ttft_by_round, range(1, 2))
        rows.append(
            [
                name,
                f"{run.seconds:.1f}",
                f"{run.tokens_per_s:.1f}",
                f"{run.p50(run.latency_by_round, range(2, args.rounds + 1)):.0f}",
                by_round,
                ttft_by_round,
                f"{round_1:.2f}×",
                f"{run.valid_calls}/{run.calls}",
                f"{run.cached_tokens / run.prompt_tokens:.0%}" if run.prompt_tokens else "—",
                run.errors,
                f"{peer.seconds / run.seconds:.2f}×",
            ]
        )
    print(
        f"{args.sessions} agent sessions × {args.rounds} rounds ({args.rounds - 1} tool calls, then the answer), "
        f"a shared system prompt of {args.system_tokens or 'about 300'} tokens, "
        f"≤{args.max_tokens} tokens per round, greedy, streamed, {args.threads} threads, parallel 16, "
        f"{args.ctx_size:,} cells "
        f"(llama-server: -np 16 --kv-unified -c {args.ctx_size}); best of {args.repeats} alternating runs"
    )
    headers = ["server", "wall s", "output tok/s", "round p50 rounds 2+ ms", "round p50 by round ms"]
    headers += ["TTFT p50 by round ms", "round-1 TTFT vs llama-server"]
    headers += ["valid calls", "prompt cached", "errors", "speed vs llama-server (same work)"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
