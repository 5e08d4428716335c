"""One greedy answer: a request that repeats an earlier greedy one follows its answer wherever its own
pick is within a near tie of it (engine/anchors.py); against the real server, one request sent ten
times, streamed and not, gives one answer."""

from __future__ import annotations

import json

import httpx
import pytest

from magnitude_jupyter.engine.anchors import NEAR_TIE, GreedyAnchors
from magnitude_jupyter.engine.plan import ScheduledChunk
from magnitude_jupyter.engine.request import Request, SamplingParams
from magnitude_jupyter.engine.step import sample


def request(rid: str, prompt: list[int], output: list[int] = (), scope: str | None = None, **params) -> Request:
    params.setdefault("temperature", 0)
    req = Request(rid, list(prompt), SamplingParams(max_tokens=16, **params), max_tokens=16)
    req.output_tokens = list(output)
    req.cache_scope = scope
    return req


def test_a_repeated_greedy_request_is_given_the_earlier_answer_from_where_it_stands():
    anchors = GreedyAnchors()
    anchors.remember(request("first", [1, 2, 3], [7, 8, 9, 10]))
    again = request("again", [1, 2, 3])
    assert anchors.expected(again, 2) == [7, 8]
    again.output_tokens = [7, 8, 9]
    assert anchors.expected(again, 5) == [10]  # never past the kept answer's end
    again.output_tokens = [7, 8, 9, 10]
    assert anchors.expected(again, 1) == []


def test_a_request_that_went_its_own_way_follows_nothing_from_there():
    anchors = GreedyAnchors()
    anchors.remember(request("first", [1, 2, 3], [7, 8, 9, 10]))
    again = request("again", [1, 2, 3], [7, 5])  # the model's own pick beat the kept one clearly
    assert anchors.expected(again, 2) == []
    again.output_tokens = [7, 5, 9]
    assert anchors.expected(again, 1) == []  # not back on the kept answer by chance either
    anchors.forget(again)


@pytest.mark.parametrize(
    "other",
    [
        request("other prompt", [1, 2, 4]),
        request("other scope", [1, 2, 3], scope="tenant:bob|"),
        request("sampled", [1, 2, 3], temperature=0.7),
        request("penalized", [1, 2, 3], repeat_penalty=1.2),
        request("grammar", [1, 2, 3], grammar='root ::= "a"'),
        request("eos banned", [1, 2, 3], ignore_eos=True),
    ],
)
def test_only_the_same_greedy_request_in_the_same_scope_follows_an_answer(other):
    anchors = GreedyAnchors()
    anchors.remember(request("first", [1, 2, 3], [7, 8, 9, 10]))
    assert anchors.expected(other, 2) == []


def test_the_kept_answers_are_bounded_in_answers_and_tokens():
    anchors = GreedyAnchors(max_answers=3, max_tokens=10)
    for n in range(6):
        anchors.remember(request(f"r{n}", [n], [n] * 4))
    assert len(anchors) == 2  # 10 tokens hold two answers of 4
    assert anchors.expected(request("again", [5]), 1) == [5]
    assert anchors.expected(request("old", [0]), 1) == []


class TiedRunner:
    """A runner whose logits row puts `gap` between the kept token and its own pick, 3."""

    def __init__(self, gap: float) -> None:
        self.gap = gap

    def sample(self, seq_id: int, row: int) -> int:
        return 3

    def logit_gap(self, row: int, token: int, other: int) -> float:
        return self.gap


@pytest.mark.parametrize(("gap", "picked"), [(-0.4, 5), (-NEAR_TIE + 0.01, 5), (-NEAR_TIE - 0.01, 3), (-8.0, 3)])
def test_a_pick_within_a_near_tie_of_the_kept_token_takes_it(gap, picked):
    req = request("again", [1, 2, 3])
    req.seq_id = 0
    chunk = ScheduledChunk(req, [3], 3, sample=True)
    assert sample(TiedRunner(gap), chunk, 0, expected=5).token == picked  # type: ignore[arg-type]
    assert sample(TiedRunner(gap), chunk, 0).token == 3


def ask(server, prompt: str, streamed: bool) -> str:
    headers = {"Authorization": f"Bearer {server.token}"}
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0}
    url = server.url + "/v1/chat/completions"
    if not streamed:
        return httpx.post(url, json=body, headers=headers, timeout=120).json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += (choices[0]["delta"].get("content") or "") if choices else ""
    return text


@pytest.mark.model
def test_the_same_greedy_request_gives_one_answer_ten_times_streamed_or_not(server):
    """Drafts on, the prefix cache warm after the first, threads following the machine's load: the
    steps of each repeat differ in shape from the first's, and its answer does not."""
    for prompt in ("Write a short poem about the colour of the sea.", "What does courage mean? Three sentences."):
        answers = {ask(server, prompt, streamed=bool(i % 2)) for i in range(10)}
        assert len(answers) == 1, answers
