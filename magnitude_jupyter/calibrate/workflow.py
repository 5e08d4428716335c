"""Agent-workflow calibration: many sessions, many rounds, each round resending the whole conversation.

Single calls do not say how a service holds up for agents and notebook conversations; multi-round
workflows do. S sessions run at once, R rounds each; every round sends the conversation so far plus
a new message (different for every session) and streams the answer. With `agent`, a session is a
tool-using agent instead: each round but the last must call one of the built-in tools (a calculator
and a lookup table, agent_tools.py), whose result goes back in the next round; the last answers in
text. Round latency then covers what agents do: call, tool result, next call. Per round: TTFT, end-to-end,
prompt and cached tokens; per S: output tokens/s and round latency percentiles. The verdict is the
largest S whose every round meets the service-level objective (p95 round latency), and whether the
largest S asked for meets it (a regression gate for CI).
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..client.agent import FunctionTool, answer_call, tool_message
from ..client.exchange import timed_stream
from ..client.http import Client, ClientError, StreamResult
from .agent_tools import TOOLS, agent_task
from .options import DEFAULT_SLO_ROUND_P95_MS
from .records import Percentiles
from .stats import percentiles

SYSTEM = (
    "You are a careful assistant inside a data notebook. Answer in plain sentences, keep every answer "
    "short, name the assumptions you make, and say when you are not sure."
)
TOPICS = (
    "lighthouses",
    "bread baking",
    "bicycle repair",
    "tide pools",
    "chess openings",
    "beekeeping",
    "city markets",
    "printing presses",
    "river deltas",
    "violin making",
    "mountain huts",
    "paper folding",
    "night trains",
    "tea gardens",
    "glass blowing",
    "weather balloons",
)
FOLLOW_UPS = ("Tell me more.", "Why is that?", "Give an example.", "What is often misunderstood?", "Summarize.")


@dataclass(frozen=True)
class RoundStats:
    round: int
    ttft_ms: Percentiles
    e2e_ms: Percentiles
    prompt_tokens: float  # mean over sessions
    cached_tokens: float  # mean over sessions: how much of the history the prefix cache held


@dataclass(frozen=True)
class WorkflowLevel:
    sessions: int
    rounds: tuple[RoundStats, ...]
    seconds: float
    output_tokens: int
    errors: int
    meets_slo: bool
    tool_calls: int = 0  # in agent sessions: calls made to the built-in tools

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def worst_round_p95_ms(self) -> float | None:
        values = [r.e2e_ms.p95 for r in self.rounds if r.e2e_ms.p95 is not None]
        return max(values) if values else None


@dataclass(frozen=True)
class WorkflowResult:
    slo_round_p95_ms: float
    rounds: int
    max_tokens: int
    levels: tuple[WorkflowLevel, ...] = field(default_factory=tuple)
    agent: bool = False  # sessions were tool-using agents

    @property
    def largest_sessions_within_slo(self) -> int | None:
        within = [lv.sessions for lv in self.levels if lv.meets_slo]
        return max(within) if within else None

    @property
    def passed(self) -> bool:
        """The SLO holds at the largest number of sessions measured."""
        return bool(self.levels) and max(self.levels, key=lambda lv: lv.sessions).meets_slo

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["largest_sessions_within_slo"] = self.largest_sessions_within_slo
        data["passed"] = self.passed
        for level, raw in zip(self.levels, data["levels"], strict=True):
            raw["output_tokens_per_s"] = level.output_tokens_per_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkflowResult:
        levels = tuple(
            WorkflowLevel(
                sessions=lv["sessions"],
                rounds=tuple(
                    RoundStats(
                        round=r["round"],
                        ttft_ms=Percentiles(**r["ttft_ms"]),
                        e2e_ms=Percentiles(**r["e2e_ms"]),
                        prompt_tokens=r["prompt_tokens"],
                        cached_tokens=r["cached_tokens"],
                    )
                    for r in lv["rounds"]
                ),
                seconds=lv["seconds"],
                output_tokens=lv["output_tokens"],
                errors=lv["errors"],
                meets_slo=lv["meets_slo"],
                tool_calls=lv.get("tool_calls", 0),
            )
            for lv in data["levels"]
        )
        return cls(data["slo_round_p95_ms"], data["rounds"], data["max_tokens"], levels, data.get("agent", False))

    def _what_next(self) -> str:
        """What to change when even the fewest sessions miss the objective, from what they measured:
        more sessions only make every round slower, so the round itself must get shorter, or the
        objective looser."""
        fewest = min(self.levels, key=lambda lv: lv.sessions, default=None)
        worst = fewest.worst_round_p95_ms() if fewest is not None else None
        if fewest is None or worst is None or not fewest.output_tokens:
            return ""
        per_token_ms = 1000 * fewest.seconds * fewest.sessions / fewest.output_tokens
        return (
            f". Even {fewest.sessions} session{'s' if fewest.sessions > 1 else ''} took {worst:.0f} ms at p95 for its "
            f"slowest round, and more sessions only slow every round down. A round is its new prompt plus up to "
            f"{self.max_tokens} tokens written one at a time (about {per_token_ms:.0f} ms each here), so: ask for "
            f"fewer tokens per answer (max_tokens), set an objective this machine can keep (at least {worst:.0f} ms), "
            "or serve a smaller model or a faster machine"
        )

    def verdict(self) -> str:
        largest = self.largest_sessions_within_slo
        if largest is None:
            return (
                f"no number of sessions met the SLO (p95 round latency <= {self.slo_round_p95_ms:.0f} ms)"
                + self._what_next()
            )
        top = max(lv.sessions for lv in self.levels)
        within = f"every round's p95 <= {self.slo_round_p95_ms:.0f} ms"
        if largest == top:  # the most sessions measured is the answer: said once
            return f"{_sessions(largest)} meet the SLO ({within}), the most this run tried"
        gate = "meets" if self.passed else "FAILS"
        return f"{_sessions(largest)} meet the SLO ({within}); {_sessions(top)} {gate} it"


def _sessions(n: int) -> str:
    return f"{n} concurrent session{'' if n == 1 else 's'}"


@dataclass
class _Sample:
    round: int
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    tool_calls: int = 0


def session_message(session: int, round_index: int) -> str:
    """The user's message in round `round_index` of session `session`: different for every session."""
    if round_index == 0:
        return f"Let us talk about {TOPICS[session % len(TOPICS)]} (conversation {session + 1})."
    return FOLLOW_UPS[(round_index + session) % len(FOLLOW_UPS)]


def _timed_round(client: Client, messages: list[dict[str, Any]], k: int, **body: Any) -> tuple[_Sample, StreamResult]:
    """One streamed request, timed: its sample (round k + 1) and what it answered."""
    timed = timed_stream(client, messages, temperature=0, **body)
    counts = timed.counts
    sample = _Sample(
        k + 1, timed.ttft_s, timed.e2e_s, counts.prompt, counts.cached, counts.output, len(timed.result.tool_calls)
    )
    return sample, timed.result


@functools.cache
def agent_tools() -> tuple[FunctionTool, ...]:
    return tuple(FunctionTool.of(fn) for fn in TOOLS)


def _agent_round(
    client: Client, messages: list[dict[str, Any]], k: int, rounds: int, max_tokens: int, origin: str
) -> _Sample:
    """Round k of an agent session: a call to a built-in tool (whose result joins the history), or,
    in the last round, the answer in text."""
    tools = agent_tools()
    choice = "required" if k < rounds - 1 else "none"
    schemas = [tool.openai() for tool in tools]
    sample, result = _timed_round(
        client, messages, k, max_tokens=max_tokens, tools=schemas, tool_choice=choice, origin=origin
    )
    if not result.tool_calls:
        messages.append({"role": "assistant", "content": result.text})
        return sample
    if result.finish_reason != "tool_calls":
        raise ClientError(f"round {k + 1}: max_tokens ({max_tokens}) cut the tool call short; raise it")
    messages.append({"role": "assistant", "content": None, "tool_calls": result.tool_calls})
    by_name = {tool.name: tool for tool in tools}
    # A wrong call is an agent's ordinary day: the model sees the error, as run_agent's would.
    messages += [tool_message(call["id"], *answer_call(by_name, call)) for call in result.tool_calls]
    return sample


def run_level(
    client: Client,
    sessions: int,
    rounds: int,
    max_tokens: int,
    stop: threading.Event,
    agent: bool = False,
    first_session: int = 0,
) -> list[_Sample]:
    """`sessions` conversations at once, numbered from `first_session` (a number picks the topic or
    task, and is written into the first message, so no two numbers hold the same conversation)."""
    samples: list[_Sample] = []
    errors: list[str] = []
    lock = threading.Lock()

    def session(index: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        if agent:
            messages.append({"role": "user", "content": agent_task(index)})
        for k in range(rounds):
            if stop.is_set():
                return
            # named in the server's panel: which level, session and round (magnitude's; others ignore it)
            origin = f"workflow · {_sessions(sessions)} · session {index + 1} · round {k + 1}"
            try:
                if agent:
                    sample = _agent_round(client, messages, k, rounds, max_tokens, origin)
                else:
                    messages.append({"role": "user", "content": session_message(index, k)})
                    sample, result = _timed_round(
                        client, messages, k, max_tokens=max_tokens, ignore_eos=True, origin=origin
                    )
                    messages.append({"role": "assistant", "content": result.text})
            except ClientError as exc:
                with lock:
                    errors.append(str(exc))
                return
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=session, args=(first_session + i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples.extend(_Sample(0, None, 0.0, 0, 0, 0) for _ in errors)  # round 0 marks a failed session
    return samples


def summarize_level(sessions: int, samples: list[_Sample], seconds: float, rounds: int, slo_ms: float) -> WorkflowLevel:
    done = [s for s in samples if s.round]
    by_round = []
    for r in range(1, rounds + 1):
        these = [s for s in done if s.round == r]
        if not these:
            continue
        by_round.append(
            RoundStats(
                round=r,
                ttft_ms=percentiles([s.ttft_s * 1000 for s in these if s.ttft_s is not None]),
                e2e_ms=percentiles([s.e2e_s * 1000 for s in these]),
                prompt_tokens=sum(s.prompt_tokens for s in these) / len(these),
                cached_tokens=sum(s.cached_tokens for s in these) / len(these),
            )
        )
    errors = len(samples) - len(done)
    meets = errors == 0 and len(by_round) == rounds and all((r.e2e_ms.p95 or 0) <= slo_ms for r in by_round)
    return WorkflowLevel(
        sessions=sessions,
        rounds=tuple(by_round),
        seconds=seconds,
        output_tokens=sum(s.output_tokens for s in done),
        errors=errors,
        meets_slo=meets,
        tool_calls=sum(s.tool_calls for s in done),
    )


def run_workflow(
    client: Client,
    sessions: Sequence[int] = (1, 4, 8),
    rounds: int = 6,
    max_tokens: int = 48,
    slo_round_p95_ms: float = DEFAULT_SLO_ROUND_P95_MS,
    on_level: Callable[[WorkflowLevel], None] | None = None,
    stop: threading.Event | None = None,
    agent: bool = False,
) -> WorkflowResult:
    """Each number of sessions in turn; returns every level and the verdict."""
    if not sessions or min(sessions) < 1 or rounds < 1 or max_tokens < 1:
        raise ValueError("sessions, rounds and max tokens must be at least 1")
    stop = stop or threading.Event()
    levels = []
    # Every level's conversations, and every run's, are new: a conversation sent again would find its
    # history in the prefix cache and its greedy answers remembered (drafts), and flatter the level.
    first_session = random.randrange(1_000_000) * 1_000
    for count in sessions:
        if stop.is_set():
            break
        start = time.perf_counter()
        samples = run_level(client, count, rounds, max_tokens, stop, agent, first_session)
        first_session += count
        level = summarize_level(count, samples, time.perf_counter() - start, rounds, slo_round_p95_ms)
        levels.append(level)
        if on_level is not None:
            on_level(level)
    return WorkflowResult(slo_round_p95_ms, rounds, max_tokens, tuple(levels), agent)


def format_workflow(result: WorkflowResult) -> str:
    kind = "agent workflow (each round a tool call, then the answer)" if result.agent else "workflow"
    lines = [
        f"{kind}: sessions × {result.rounds} rounds, {result.max_tokens} tokens per answer; "
        f"SLO: p95 round latency <= {result.slo_round_p95_ms:.0f} ms"
    ]
    header = (
        f"{'sessions':>8}  {'tok/s':>7}  {'worst round p95 ms':>18}  {'p95 by round ms':<40}  {'cached share':>12}  SLO"
    )
    lines.append(header)
    for lv in result.levels:
        by_round = " / ".join(f"{r.e2e_ms.p95 or 0:.0f}" for r in lv.rounds)
        prompt = sum(r.prompt_tokens for r in lv.rounds)
        cached = sum(r.cached_tokens for r in lv.rounds)
        share = f"{cached / prompt:.0%}" if prompt else "—"
        worst = lv.worst_round_p95_ms()
        calls = f"  {lv.tool_calls} tool calls" if result.agent else ""
        lines.append(
            f"{lv.sessions:>8}  {lv.output_tokens_per_s:>7.1f}  {worst or 0:>18.0f}  {by_round:<40}  {share:>12}  "
            f"{'ok' if lv.meets_slo else 'MISSED'}{calls}"
        )
    lines.append(result.verdict())
    return "\n".join(lines)
