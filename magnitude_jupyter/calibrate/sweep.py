"""Load sweeps against any OpenAI-compatible server: closed-loop levels, or open-loop Poisson arrivals.

Each request is one streamed chat completion, timed on the client: time to first token, the gaps
between tokens, end-to-end. Figures only our server gives (queue wait, KV usage, process memory)
are read from its own timings and /status, and left missing (None) for other servers.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..client.exchange import timed_stream
from ..client.http import Client, ClientError
from . import options
from .records import Level, Percentiles
from .stats import percentiles, saturated

DEFAULT_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
SWEEP_SYSTEM = "You are a helpful assistant. Answer the request below in plain prose."
# Words the synthetic prompts are drawn from: each request gets its own sequence of them, so no two
# requests share more than the system prompt (one prompt for all would be a cache hit after the first).
_WORDS = (
    "river",
    "market",
    "lantern",
    "copper",
    "orchard",
    "harbor",
    "violin",
    "meadow",
    "thunder",
    "pepper",
    "canyon",
    "marble",
    "engine",
    "garden",
    "pilot",
    "ribbon",
    "saddle",
    "glacier",
    "compass",
    "cottage",
    "falcon",
    "velvet",
    "quarry",
    "pebble",
    "trumpet",
    "meteor",
    "blanket",
    "island",
    "cinnamon",
    "ladder",
    "mirror",
    "forest",
    "signal",
    "barrel",
    "rocket",
    "candle",
    "shadow",
    "puzzle",
    "ferry",
    "tunnel",
    "hammer",
    "lemon",
    "feather",
    "castle",
    "beacon",
    "walnut",
    "tiger",
    "painter",
    "bridge",
    "winter",
    "cradle",
    "sponge",
    "anchor",
    "circus",
    "kettle",
    "magnet",
)


def synthetic_words(seed: int, words: int) -> str:
    """`words` words drawn from the list, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def synthetic_prompt(index: int, words: int = 40) -> str:
    """The distinct user text of request `index`: a topic and `words` words of its own (as guidellm's data)."""
    return f"Request {index}: write about {synthetic_words(index, words)}."


@dataclass
class SweepConfig:
    """One sweep; the defaults are calibrate/options.py's, as the CLI, the magic and the widget use them."""

    concurrency: tuple[int, ...] = field(default_factory=lambda: options.parse_levels(options.DEFAULT_CONCURRENCY))
    requests_per_level: int = options.DEFAULT_REQUESTS
    seconds_per_level: float | None = None  # if set, run each level this long instead of a request count
    min_seconds_per_level: float | None = None  # and at least this long: a few short requests are noise
    warmup_requests: int = options.DEFAULT_WARMUP
    max_tokens: int = options.DEFAULT_MAX_TOKENS
    prompt: str | None = None  # one prompt for every request: a prefix-cache hit after the first, which flatters
    prompts: tuple[str, ...] = ()  # your own prompts (a list, a DataFrame column), cycled
    prompt_words: int = 40  # without either: a fixed system prompt and this many distinct words per request
    system_words: int = 0  # ... and this many words more in the system prompt every request shares (an agent's)
    system_seed: int = 0  # which words those are
    temperature: float = 0.0
    ignore_eos: bool = True  # every request generates max_tokens: levels compare like with like
    ttft_p95_limit_ms: float | None = None  # stop when a level's p95 TTFT is over this
    latency_target_ms: float | None = options.DEFAULT_LATENCY_TARGET_MS  # for the recommended `parallel` (p95 e2e)
    mode: str = "closed"  # or "open": Poisson arrivals at `rates` requests/s
    rates: tuple[float, ...] = ()
    model: str | None = None

    @classmethod
    def from_options(cls, opts: options.CalibrateOptions, model: str | None = None) -> SweepConfig:
        """The concurrency sweep a command's options ask for (validated)."""
        config = cls(
            concurrency=options.parse_levels(opts.concurrency),
            requests_per_level=opts.requests,
            max_tokens=opts.max_tokens,
            min_seconds_per_level=opts.min_seconds,
            warmup_requests=opts.warmup,
            prompt=opts.prompt,
            ttft_p95_limit_ms=opts.ttft_limit_ms,
            latency_target_ms=opts.latency_target_ms,
            model=model,
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.mode == "closed" and (not self.concurrency or min(self.concurrency) < 1):
            raise ValueError("concurrency levels must be positive integers")
        if self.mode == "open" and (not self.rates or min(self.rates) <= 0):
            raise ValueError("open-loop mode needs positive arrival rates (requests/s)")
        if self.requests_per_level < 1 or self.max_tokens < 1:
            raise ValueError("requests per level and max tokens must be at least 1")


@dataclass
class Sample:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    queued_ms: float | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


def messages_for(config: SweepConfig, index: int) -> list[dict[str, str]]:
    """Request `index`'s messages: your prompts cycled, the one prompt, or a synthetic distinct one."""
    if config.prompts:
        return [{"role": "user", "content": config.prompts[index % len(config.prompts)]}]
    if config.prompt:
        return [{"role": "user", "content": config.prompt}]
    system = SWEEP_SYSTEM
    if config.system_words:
        system += " Background: " + synthetic_words(config.system_seed, config.system_words) + "."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": synthetic_prompt(index, config.prompt_words)},
    ]


def one_request(client: Client, config: SweepConfig, index: int = 0, origin: str = "calibration") -> Sample:
    """One timed request; `origin` names it in the server's panel (magnitude's; others ignore it)."""
    body: dict[str, Any] = {"max_tokens": config.max_tokens, "temperature": config.temperature, "origin": origin}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.model:
        body["model"] = config.model
    try:
        timed = timed_stream(client, messages_for(config, index), **body)
    except ClientError as exc:
        return Sample(ok=False, error=str(exc))
    counts = timed.counts
    return Sample(
        ok=True,
        ttft_s=timed.ttft_s,
        e2e_s=timed.e2e_s,
        tokens=counts.output or timed.pieces,
        itl_s=timed.gaps_s,
        queued_ms=(timed.result.timings or {}).get("queued_ms"),
        prompt_tokens=counts.prompt,
        cached_tokens=counts.cached,
    )


class _StatusSampler:
    """Polls the server's /status during a level (ours only): KV usage, queue, process memory."""

    def __init__(self, client: Client, every_s: float = 0.25) -> None:
        self.client = client
        self.every_s = every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status = self.client.status()
            except ClientError:
                return  # not our server: these figures stay missing
            if "kv_cells_total" not in status:
                return
            self.samples.append(status)
            self._stop.wait(self.every_s)

    def summary(self) -> dict[str, Any]:
        """The server's side of a level: `Level` fields, missing when the server is not ours."""
        if not self.samples:
            return {}
        usage = [s["kv_cells_used"] / s["kv_cells_total"] for s in self.samples if s.get("kv_cells_total")]
        cells = [s["kv_cells_used"] for s in self.samples if s.get("kv_cells_used") is not None]
        rss = [s["rss_bytes"] for s in self.samples if s.get("rss_bytes")]
        return {
            "kv_usage_max": max(usage) if usage else None,
            "kv_usage_mean": sum(usage) / len(usage) if usage else None,
            "kv_cells_max": max(cells) if cells else None,
            "rss_bytes_max": max(rss) if rss else None,
            "waiting_max": max(s.get("waiting", 0) for s in self.samples),
            # Running requests preempted for cells during the level (admission: estimate).
            "preemptions": self.samples[-1].get("preemptions", 0) - self.samples[0].get("preemptions", 0),
        }


def summarize(samples: list[Sample], elapsed_s: float, **extra: Any) -> Level:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.tokens for s in ok)
    ms = 1000.0

    def pct(values: list[float | None]) -> Percentiles:
        return percentiles([v * ms for v in values if v is not None])

    return Level(
        requests=len(samples),
        errors=len(samples) - len(ok),
        seconds=elapsed_s,
        requests_per_s=len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        output_tokens=tokens,
        output_tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
        ttft_ms=pct([s.ttft_s for s in ok]),
        tpot_ms=pct([s.tpot_s for s in ok]),
        itl_ms=pct([gap for s in ok for gap in s.itl_s]),
        e2e_ms=pct([s.e2e_s for s in ok]),
        queue_ms=percentiles([s.queued_ms for s in ok if s.queued_ms is not None]),
        cached_share=cached_share(ok),
        prompt_tokens_mean=prompt_tokens_mean(ok),
        **extra,
    )


def prompt_tokens_mean(samples: list[Sample]) -> float | None:
    counted = [s.prompt_tokens for s in samples if s.prompt_tokens]
    return sum(counted) / len(counted) if counted else None


def cached_share(samples: list[Sample]) -> float | None:
    """Share of the prompt tokens the server took from its prefix cache (None if it does not say)."""
    prompt = sum(s.prompt_tokens for s in samples)
    return sum(s.cached_tokens for s in samples) / prompt if prompt else None


def run_closed_level(
    client: Client,
    config: SweepConfig,
    concurrency: int,
    stop: threading.Event,
    config_offset: int = 0,
    label: str = "",
) -> Level:
    """`concurrency` clients, each sending its next request as soon as its last one completes.
    Request indexes start after `config_offset`, so levels never repeat each other's prompts;
    `label` follows the level's name in the server's panel."""
    samples: list[Sample] = []
    lock = threading.Lock()
    remaining = [config.requests_per_level]
    deadline = time.perf_counter() + config.seconds_per_level if config.seconds_per_level else None
    floor = time.perf_counter() + config.min_seconds_per_level if config.min_seconds_per_level else None

    issued = [0]

    def take() -> int | None:
        """The next request's index, or None when the level is over."""
        with lock:
            if stop.is_set():
                return None
            if deadline is not None and time.perf_counter() >= deadline:
                return None
            if deadline is None and remaining[0] <= 0 and (floor is None or time.perf_counter() >= floor):
                return None
            remaining[0] -= 1
            issued[0] += 1
            return config_offset + issued[0]

    origin = f"calibration · {concurrency} client{'' if concurrency == 1 else 's'}{label}"

    def worker() -> None:
        while (index := take()) is not None:
            sample = one_request(client, config, index, origin)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    with _StatusSampler(client) as sampler:
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    interval = throughput_interval(samples, concurrency)
    return summarize(samples, elapsed, concurrency=concurrency, output_tokens_per_s_ci95=interval, **sampler.summary())


def throughput_interval(samples: list[Sample], concurrency: int) -> float | None:
    """Half-width of a 95% interval for a closed-loop level's output tok/s. By Little's law each
    request is one estimate of it, concurrency x its tokens / its end-to-end time; their standard
    error (1.96 of them) says how far another run of the level might land. None under 3 requests."""
    rates = [concurrency * s.tokens / s.e2e_s for s in samples if s.ok and s.e2e_s]
    if len(rates) < 3:
        return None
    return 1.96 * statistics.stdev(rates) / math.sqrt(len(rates))


def run_open_level(
    client: Client, config: SweepConfig, rate: float, stop: threading.Event, seed: int = 0, index_base: int = 0
) -> Level:
    """Poisson arrivals at `rate` requests/s, whatever the server's pace (each request its own thread)."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    lock = threading.Lock()
    threads = []

    def fire(index: int) -> None:
        sample = one_request(client, config, index, f"calibration · {rate:g} requests/s")
        with lock:
            samples.append(sample)

    with _StatusSampler(client) as sampler:
        start = time.perf_counter()
        next_at = start
        for i in range(config.requests_per_level):
            if stop.is_set():
                break
            next_at += rng.expovariate(rate)
            time.sleep(max(0.0, next_at - time.perf_counter()))
            thread = threading.Thread(target=fire, args=(index_base + seed * 1_000_003 + i,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    return summarize(samples, elapsed, arrival_rate=rate, **sampler.summary())


def run_sweep(
    client: Client,
    config: SweepConfig,
    on_level: Callable[[Level], None] | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[Level], str | None]:
    """Every level in turn (after a warm-up); returns the levels measured and why it stopped early, if it did."""
    config.validate()
    stop = stop or threading.Event()
    for i in range(config.warmup_requests):
        if stop.is_set():
            break
        one_request(client, config, -1 - i, "calibration · warm-up")
    levels: list[Level] = []
    # Every run its own prompts too (and every level, below): a second calibration of the same server
    # must not find the first's prompts in its prefix cache, nor their greedy answers remembered (drafts).
    run_base = 1_000_000_000 * random.randrange(1, 1_000_000)
    steps = config.concurrency if config.mode == "closed" else config.rates
    reason = None
    for step in steps:
        if stop.is_set():
            reason = "stopped"
            break
        offset = run_base + 1_000_000 * (len(levels) + 1)  # every level its own prompts
        if config.mode == "closed":
            level = run_closed_level(client, config, int(step), stop, offset)
        else:
            level = run_open_level(client, config, float(step), stop, seed=len(levels) + 1, index_base=run_base)
        if stop.is_set() and level.requests == 0:
            reason = "stopped"
            break
        levels.append(level)
        if on_level is not None:
            on_level(level)
        reason = saturated(levels, config.ttft_p95_limit_ms)
        if reason:
            break
    if stop.is_set():
        reason = "stopped"
    return levels, reason
