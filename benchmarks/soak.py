"""Soak: many clients for a long time, doing everything clients do, then checks that nothing leaked.

16 clients (default) for 10 minutes against `magnitude serve`, each looping over a mix of streamed
and non-streamed chat requests, streams dropped mid-answer and resumed with `Last-Event-ID`,
cancels, and small DataFrame batches. It prints errors by kind, text lost across resumes (every
resumed answer is compared with a full replay of its stream: must be 0), the KV cells still held
once it drains (must be only the prefix cache's), RSS at the start (after one prompt as long as
the cache has made the KV buffer resident) and at the end, and its growth less the prefix cache's
RAM tier (bounded by `prefix_cache_ram_mib`, kept on purpose): <= 5%, and the p95 end-to-end
latency of the first and the last minute.

    python benchmarks/soak.py [--clients 16] [--minutes 10]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import threading
import time

import httpx
import pandas as pd
from _common import PROMPTS, TOKEN, table

from magnitude_jupyter.batch.score import score_dataframe
from magnitude_jupyter.calibrate.stats import percentiles
from magnitude_jupyter.client.http import Client, ClientError, iter_sse
from magnitude_jupyter.client.runtime import LocalServer

ACTIONS = (("stream", 35), ("plain", 20), ("resume", 15), ("cancel", 10), ("rows", 20))


class Soak:
    def __init__(self, server: LocalServer, seconds: float) -> None:
        self.url = server.url
        self.headers = {"Authorization": f"Bearer {TOKEN}"}
        self.deadline = time.monotonic() + seconds
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.errors: collections.Counter[str] = collections.Counter()
        self.done: collections.Counter[str] = collections.Counter()
        self.latencies: list[tuple[float, float]] = []  # (seconds since start, end-to-end seconds)
        self.resumed = 0
        self.chars_lost = 0

    def body(self, rng: random.Random, stream: bool) -> dict:
        prompt = f"{rng.choice(PROMPTS)} (variant {rng.randrange(10**6)})"
        return {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": rng.randint(16, 64),
            "temperature": rng.choice((0, 0.7)),
            "stream": stream,
        }

    def record(self, kind: str, start: float | None = None) -> None:
        with self.lock:
            self.done[kind] += 1
            if start is not None:
                now = time.monotonic()
                self.latencies.append((start - self.started, now - start))

    def fail(self, kind: str, exc: BaseException) -> None:
        status = getattr(getattr(exc, "response", None), "status_code", None) or getattr(exc, "status", None)
        with self.lock:
            self.errors[f"{kind}: {type(exc).__name__}{f' {status}' if status else ''}"] += 1

    def stream(self, http: httpx.Client, rng: random.Random) -> None:
        start = time.monotonic()
        with http.stream("POST", self.url + "/v1/chat/completions", json=self.body(rng, True)) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
        self.record("stream", start)

    def plain(self, http: httpx.Client, rng: random.Random) -> None:
        start = time.monotonic()
        r = http.post(self.url + "/v1/chat/completions", json=self.body(rng, False))
        r.raise_for_status()
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        self.record("plain", start)

    def resume(self, http: httpx.Client, rng: random.Random) -> None:
        """Read a few events, drop the connection, re-attach after the last id seen, compare with a replay."""
        start = time.monotonic()
        text, last_id, completion_id = [], 0, None
        body = {**self.body(rng, True), "max_tokens": 64}
        hang_up_after = rng.randint(1, 8)
        with http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            completion_id = r.headers["X-Completion-Id"]
            for event_id, data in iter_sse(r.iter_lines()):
                if data == "[DONE]":
                    break
                text.append(_content(data))
                last_id = event_id or last_id
                if len(text) >= hang_up_after:
                    break  # hang up mid-answer
        time.sleep(rng.uniform(0, 2))
        url = f"{self.url}/v1/streams/{completion_id}"
        with http.stream("GET", url, headers={"Last-Event-ID": str(last_id)}) as r:
            r.raise_for_status()
            text += [_content(d) for _, d in iter_sse(r.iter_lines()) if d != "[DONE]"]
        replay = http.get(url, params={"starting_after": 0})
        whole = "".join(_content(d) for _, d in iter_sse(iter(replay.text.splitlines())) if d != "[DONE]")
        received = "".join(text)
        with self.lock:
            self.resumed += 1
            self.chars_lost += 0 if received == whole else max(1, abs(len(whole) - len(received)))
        self.record("resume", start)

    def cancel(self, http: httpx.Client, rng: random.Random) -> None:
        body = {**self.body(rng, True), "max_tokens": 200}
        with http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            completion_id = r.headers["X-Completion-Id"]
            for _ in zip(range(rng.randint(1, 6)), r.iter_lines(), strict=False):
                pass
            http.delete(f"{self.url}/v1/streams/{completion_id}").raise_for_status()
        self.record("cancel")

    def rows(self, client: Client, rng: random.Random) -> None:
        start = time.monotonic()
        df = pd.DataFrame({"review": [f"{rng.choice(PROMPTS)} #{rng.randrange(10**6)}" for _ in range(4)]})
        out = score_dataframe(df, "Classify as positive or negative: {{ review }}", client=client,
                              concurrency=2, max_tokens=8, progress=False)  # fmt: skip
        failed = out["error"].notna().sum()
        if failed:
            raise ClientError(f"{failed} rows failed: {out['error'].dropna().iloc[0]}")
        self.record("rows", start)

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        names, weights = zip(*ACTIONS, strict=True)
        with httpx.Client(headers=self.headers, timeout=300) as http:
            client = Client(self.url, TOKEN)
            while time.monotonic() < self.deadline:
                kind = rng.choices(names, weights)[0]
                try:
                    if kind == "rows":
                        self.rows(client, rng)
                    else:
                        getattr(self, kind)(http, rng)
                except Exception as exc:
                    self.fail(kind, exc)
            client.close()


def _content(data: str) -> str:
    chunk = json.loads(data)
    return "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    seconds = args.minutes * 60

    with LocalServer(("--parallel", "8", "--ctx-size", "8192"), token=TOKEN, config="") as server:
        client = Client(server.url, TOKEN)
        # Warm up: one prompt as long as the cache, so that every page of the KV buffer (allocated
        # whole, mapped by the OS as it is first written) is resident before the start reading.
        filler = " ".join(f"w{i % 97}x{i}" for i in range(1030))  # about 7,700 tokens
        client.chat([{"role": "user", "content": filler}], max_tokens=4)
        rss_start = client.status()["rss_bytes"]
        soak = Soak(server, seconds)
        threads = [threading.Thread(target=soak.client_loop, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        drained_by = time.monotonic() + 120  # cancelled and abandoned requests end within the grace period
        while time.monotonic() < drained_by:
            status = client.status()
            if status["running"] == 0 and status["waiting"] == 0:
                break
            time.sleep(0.5)
        status = client.status()
        client.close()
    ram_tier = status.get("prefix_cache_ram_bytes") or 0

    minute = min(60.0, seconds / 2)
    first = [e2e * 1000 for at, e2e in soak.latencies if at < minute]
    last = [e2e * 1000 for at, e2e in soak.latencies if at >= seconds - minute]
    growth = status["rss_bytes"] / rss_start - 1
    # The prefix cache's RAM tier keeps evicted conversations on purpose, up to prefix_cache_ram_mib:
    # what grows beyond it is what leaked.
    growth_net = (status["rss_bytes"] - ram_tier) / rss_start - 1
    print(f"{args.clients} clients, {args.minutes:g} minutes, magnitude serve --parallel 8 --ctx-size 8192")
    print(table(["action", "completed"], [[k, v] for k, v in sorted(soak.done.items())]))
    print(table(["error", "count"], [[k, v] for k, v in sorted(soak.errors.items())] or [["none", 0]]))
    rows = [
        ["resumed streams", soak.resumed],
        ["text lost or repeated across resumes (chars)", soak.chars_lost],
        ["running / waiting after drain", f"{status['running']} / {status['waiting']}"],
        ["KV cells held after drain", status["kv_cells_used"]],
        ["... of which the prefix cache's", status["prefix_cache_cells"]],
        ["RSS start -> end", f"{rss_start / 2**20:.0f} -> {status['rss_bytes'] / 2**20:.0f} MiB ({growth:+.1%})"],
        ["... of which the prefix cache's RAM tier (bounded)", f"{ram_tier / 2**20:.0f} MiB"],
        ["RSS at the end less the RAM tier", f"{(status['rss_bytes'] - ram_tier) / 2**20:.0f} MiB"],
        ["growth beyond the RAM tier (leaks)", f"{growth_net:+.1%}"],
        ["p95 end-to-end, first minute", f"{percentiles(first).p95 or 0:.0f} ms ({len(first)} requests)"],
        ["p95 end-to-end, last minute", f"{percentiles(last).p95 or 0:.0f} ms ({len(last)} requests)"],
    ]
    print(table(["check", "result"], rows))
    ok = (
        soak.chars_lost == 0
        and status["kv_cells_used"] == status["prefix_cache_cells"]
        and status["running"] == status["waiting"] == 0
        and growth_net <= 0.05
    )
    print("soak: PASS" if ok else "soak: FAIL")


if __name__ == "__main__":
    main()
