"""The same greedy request, sent again and again to an idle server: how many different answers.

Each prompt is sent `--repeats` times, one after another, streamed and not in turn (chat
completions, temperature 0, `--max-tokens` tokens), to `magnitude serve` with its defaults (drafts
on, the prefix cache warm after the first), and to llama-server on the same file when it is built
(../shared/tools/build-llama-server.sh). Prints, per prompt and server, the number of distinct
answers and which send gave which (0 is the answer the first send gave). docs/decisions.md, "One
greedy answer", says why a repeat could answer otherwise and what keeps it to one answer.

    python benchmarks/greedy_repeats.py [--repeats 10] [--max-tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import httpx
from _common import PROMPTS, TOKEN, LlamaServer, MagnitudeServer, find_llama_server, table

HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def ask(url: str, prompt: str, max_tokens: int, streamed: bool) -> str:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body["temperature"] = 0
    if not streamed:
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=300)
        return str(r.json()["choices"][0]["message"]["content"])
    text = ""
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=HEADERS, timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += (choices[0]["delta"].get("content") or "") if choices else ""
    return text


def repeats(url: str, prompts: list[str], times: int, max_tokens: int) -> list[list[int]]:
    """Per prompt, for each send, the index of its answer among the distinct ones in order of first
    appearance."""
    patterns = []
    for prompt in prompts:
        seen: list[str] = []
        pattern = []
        for i in range(times):
            answer = ask(url, prompt, max_tokens, streamed=bool(i % 2))
            if answer not in seen:
                seen.append(answer)
            pattern.append(seen.index(answer))
        patterns.append(pattern)
    return patterns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--llama-server", default=None, help="path (default: the shared build's cache)")
    args = parser.parse_args()
    prompts = PROMPTS[: args.prompts]
    results: dict[str, list[list[int]]] = {}
    with MagnitudeServer(parallel=8, threads=args.threads) as ours:
        results["magnitude serve"] = repeats(ours.url, prompts, args.repeats, args.max_tokens)
    binary = find_llama_server(args.llama_server)
    if binary is not None:
        peer = LlamaServer(binary, parallel=8, ctx_size=8192, threads=args.threads)
        try:
            results["llama-server"] = repeats(peer.url, prompts, args.repeats, args.max_tokens)
        finally:
            peer.close()
    else:
        print("llama-server not found: magnitude serve alone (../shared/tools/build-llama-server.sh builds it)")
    print(f"\n{args.repeats} sends of each prompt, greedy, {args.max_tokens} tokens, {args.threads} threads")
    rows = []
    for i, prompt in enumerate(prompts):
        for server, patterns in results.items():
            pattern = patterns[i]
            rows.append([prompt[:40], server, max(pattern) + 1, " ".join(map(str, pattern))])
    print(table(["prompt", "server", "answers", "which send gave which"], rows))
    for server, patterns in results.items():
        one = sum(max(p) == 0 for p in patterns)
        print(f"{server}: {one} of {len(patterns)} prompts gave one answer")


if __name__ == "__main__":
    main()
