"""A request's answer as its tokens are sampled: stream events, the stop strings and the cap, the
reasoning split, the end (a stop, a cap, a grammar's dead end, a cancel) and its final event, and the
check after generation of what a grammar could not hold (answer_check.py).

The engine's thread calls it with the engine's lock held; the answer check runs off that thread, on
a thread of the request's tenant (one per API key: one tenant's checks never queue ahead of
another's), within its budget (answer_check.py), and takes the lock to write its final event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .metrics import EngineMetrics
from .plan import ScheduledChunk, SchedulerOutput
from .request import FinishReason, Request, RequestStatus
from .runner_api import Runner, Sampled
from .scheduler import Scheduler
from .stats import FinishedRequest
from .streams import TokenLogprob

log = logging.getLogger(__name__)


def step_chunks(out: SchedulerOutput) -> list[ScheduledChunk]:
    """A step's chunks in the order the step ran them (and sampled their tokens)."""
    return out.batched + out.solo


class AnswerWriter:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        recent: deque[FinishedRequest],
        lock: threading.Condition,
        notify: Callable[[], None],
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.metrics = metrics
        self.recent = recent  # the finished requests /status lists last
        self._lock = lock
        self.notify = notify  # wakes whoever waits on a step (after a checked answer's final event)
        self.checkers: dict[str | None, ThreadPoolExecutor] = {}  # by tenant (None: the owner)

    def close(self) -> None:
        for checker in list(self.checkers.values()):
            checker.shutdown(wait=False, cancel_futures=False)

    def update(self, out: SchedulerOutput, sampled: list[list[Sampled]]) -> list[int]:
        now = time.monotonic()
        ended: list[int] = []
        generated = 0
        for chunk, picks in zip(step_chunks(out), sampled, strict=True):
            request = chunk.request
            if request.is_finished:
                continue
            dead_end = picks[-1] if picks and picks[-1].dead_end else None
            if dead_end is not None:
                picks = picks[:-1]
            self.scheduler.advance(chunk, [pick.token for pick in picks])
            if chunk.draft:
                self.metrics.record_draft(len(chunk.draft), len(picks) - 1)
                self.scheduler.record_draft(chunk, len(picks) - 1)
            first = len(request.output_tokens) - len(picks)
            for i, pick in enumerate(picks):
                generated += 1
                seq_id = self._on_token(request, pick, now, first + i + 1, last=i == len(picks) - 1)
                if request.is_finished:
                    if seq_id is not None:
                        ended.append(seq_id)
                    break
            if dead_end is not None and not request.is_finished:
                seq_id = self._end_at_dead_end(request, dead_end)
                if seq_id is not None:
                    ended.append(seq_id)
        self.metrics.record_step(generated, now)
        return ended

    def _on_token(
        self, request: Request, sample: Sampled, now: float, answer_tokens: int, last: bool = True
    ) -> int | None:
        """Turn one sampled token, the answer's `answer_tokens`-th (`last` of its step), into stream
        events; returns a seq id to clear if the request ended (tokens sampled after that one in the
        same step are dropped)."""
        assert request.text is not None and request.stream is not None
        token = sample.token
        if request.first_token_time is None:
            request.first_token_time = now
        if self.runner.is_eog(token) and not request.params.bans_eog:
            del request.output_tokens[answer_tokens - 1 :]  # the end-of-generation token is not part of the answer
            return self.finish(request, FinishReason.STOP, text=request.text.flush())
        if request.reasoning is not None and request.reasoning.inside:
            request.reasoning_tokens += 1
        delta = request.text.push(self.runner.token_to_piece(token))
        logprobs = (sample.logprob,) if sample.logprob is not None else ()
        if request.text.stopped_by is not None or answer_tokens >= request.max_tokens:
            del request.output_tokens[answer_tokens:]
            if request.text.stopped_by is not None:
                return self.finish(request, FinishReason.STOP, text=delta, token_ids=(token,), logprobs=logprobs)
            text = delta + request.text.flush()
            return self.finish(request, FinishReason.LENGTH, text=text, token_ids=(token,), logprobs=logprobs)
        reasoning, content = _split(request, delta)
        request.output_text += content
        request.output_reasoning += reasoning
        request.stream.append("token", text=content, reasoning=reasoning, token_ids=(token,), logprobs=logprobs)
        if last and request.thinking_budget is not None and request.reasoning_tokens >= request.thinking_budget:
            self._close_thinking(request)
        return None

    def _end_at_dead_end(self, request: Request, end: Sampled) -> int | None:
        """A request whose grammar let no token through: whole if the grammar had reached its end
        (`ignore_eos` banned the only fitting token), else an error of its own."""
        assert request.text is not None
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if end.complete:
            return self.finish(request, FinishReason.STOP, text=request.text.flush())
        log.warning("request %s: %s", request.request_id, end.dead_end)
        return self.finish(request, FinishReason.ERROR, text=request.text.flush(), error=end.dead_end)

    def _close_thinking(self, request: Request) -> None:
        """A request whose reasoning has used its budget: the block's closing tag goes into its answer
        as if the model had written it (the next step computes it), and the model answers from there.
        Only where the answer has room for it after, and once a step's drafts are settled (`last`)."""
        assert request.reasoning is not None and request.text is not None
        if not request.reasoning.inside:
            return
        forced = self.runner.tokenize(request.reasoning.force, add_special=False)  # the model goes on
        if len(request.output_tokens) + len(forced) >= request.max_tokens:
            return  # the cap comes first: the answer ends with "length" inside its reasoning
        request.output_tokens.extend(forced)
        delta = "".join(request.text.push(self.runner.token_to_piece(t)) for t in forced)
        reasoning, content = _split(request, delta)
        request.output_text += content
        request.output_reasoning += reasoning
        assert request.stream is not None
        request.stream.append("token", text=content, reasoning=reasoning, token_ids=tuple(forced))

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        text: str = "",
        error: str | None = None,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> int | None:
        """End a request: free its budget and sequence, write the final event. Lock held."""
        if request.is_finished:
            return None
        seq_id = self.scheduler.finish(request, reason, error)
        reasoning, text = _split(request, text, final=True)
        request.output_text += text
        request.output_reasoning += reasoning
        final = {"text": text, "reasoning": reasoning, "token_ids": token_ids, "logprobs": logprobs}
        if reason is FinishReason.STOP and request.answer_check is not None:
            # Off the engine's thread: a client's schema may take a while to check a long answer.
            self._answer_checks(request.tenant).submit(self._check_answer, request, final)
        else:
            self.write_final(request, final)
        return seq_id

    def write_final(self, request: Request, final: dict[str, Any]) -> None:
        """A finished request's last event, its metrics and its place in the recent list. Lock held."""
        if request.stream is not None and not request.stream.closed:
            assert request.finish_reason is not None
            request.stream.append(
                "done",
                **final,
                finish_reason=request.finish_reason.value,
                counts=request.token_counts(),
                timings=request.timings().to_json(),
                error=request.error,
                stopped_by=request.text.stopped_by if request.text is not None else None,
            )
        self.metrics.record_finished(request)
        self.recent.appendleft(FinishedRequest.of(request))

    def _answer_checks(self, tenant: str | None) -> ThreadPoolExecutor:
        """The thread that checks `tenant`'s answers, one after another. Lock held."""
        checker = self.checkers.get(tenant)
        if checker is None:
            checker = self.checkers[tenant] = ThreadPoolExecutor(1, thread_name_prefix="magnitude-answer-check")
        return checker

    def _check_answer(self, request: Request, final: dict[str, Any]) -> None:
        """Validate a finished answer against what its grammar could not hold (answer_check.py); one
        that fails ends with its error instead of "stop", its text kept."""
        assert request.answer_check is not None
        try:
            problem = request.answer_check.problem(request.output_text, request.tool_form)
        except BaseException as exc:  # a check that breaks (a native panic too) must not lose the final event
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            log.exception("request %s: the answer check failed", request.request_id)
            problem = f"the answer could not be checked: {exc}"
        with self._lock:
            if problem is not None:
                log.info("request %s: %s", request.request_id, problem)
                request.status, request.finish_reason, request.error = (
                    RequestStatus.FINISHED_ERROR,
                    FinishReason.ERROR,
                    problem,
                )
            self.write_final(request, final)
        self.notify()


def _split(request: Request, text: str, final: bool = False) -> tuple[str, str]:
    """A delta of final text as (reasoning, content): all content unless the request splits reasoning."""
    if request.reasoning is None:
        return "", text
    out = request.reasoning.push(text)
    if final:
        rest = request.reasoning.flush()
        out.reasoning, out.content = out.reasoning + rest.reasoning, out.content + rest.content
    return out.reasoning, out.content
