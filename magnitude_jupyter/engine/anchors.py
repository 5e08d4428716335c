"""One greedy answer: the same greedy request, sent again, answers as it did.

The logits of a row depend a little on how it was computed: the rows beside it in its batch (a
draft's, a prompt's), where its sequence's cells lie in the KV cache and how far they reach (on
several threads llama.cpp splits a one-token step's attention by cell range), what the prefix cache
held. Those differences are rounding, a few hundredths of a logit, but where two tokens stand
that close the greedy pick can go either way, and an idle server gave the same request three
different answers in eight.

So each greedy answer given is kept (`GreedyAnchors`, bounded in answers and tokens) under a digest
of its prompt and its cache scope, and a later request with the same prompt and scope follows it: wherever its
own pick beats the kept token by less than `NEAR_TIE`, the kept token is taken (step.py). A pick
that beats it by more is the model's answer and stands; from there on, the request is on its own.
Another scope's answers are never followed: a tenant must not learn another's answer from its own.
docs/decisions.md, "One greedy answer", gives the noise measured and the tolerance.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .request import Request

NEAR_TIE = 1.0  # logits: a kept token within this of the model's own pick is taken
MAX_ANSWERS = 256  # answers kept, the least recently used out first
MAX_TOKENS = 65_536  # tokens kept over all of them


Key = tuple[str | None, bool, int | None, bytes]


def _key(request: Request) -> Key:
    """What makes two greedy requests the same: their prompt (by a digest: prompts are not kept),
    their scope, and what else moves their tokens (end-of-generation banned, a reasoning budget whose
    closing tag the engine writes)."""
    digest = hashlib.blake2b(array("i", request.prompt_tokens).tobytes(), digest_size=32).digest()
    return request.cache_scope, request.params.bans_eog, request.thinking_budget, digest


class GreedyAnchors:
    """Greedy answers given lately, by prompt and scope (see the module doc)."""

    def __init__(self, max_answers: int = MAX_ANSWERS, max_tokens: int = MAX_TOKENS) -> None:
        self.max_answers = max_answers
        self.max_tokens = max_tokens
        self._answers: OrderedDict[Key, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        # request id -> (the answer it follows, its tokens compared so far); None: it follows none
        self._following: dict[str, tuple[Key, int] | None] = {}

    def remember(self, request: Request) -> None:
        """Keep a finished greedy request's answer (the latest answer to a prompt replaces the one before)."""
        if not request.params.draftable or not request.output_tokens:
            return
        answer = tuple(request.output_tokens)
        if len(answer) > self.max_tokens:
            return
        key = _key(request)
        old = self._answers.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        self._answers[key] = answer
        self._tokens += len(answer)
        while len(self._answers) > self.max_answers or self._tokens > self.max_tokens:
            _, dropped = self._answers.popitem(last=False)
            self._tokens -= len(dropped)

    def expected(self, request: Request, count: int) -> list[int]:
        """The kept answer's next `count` tokens for `request`, from where its answer stands, while its
        answer so far is the kept one's; [] when there is none to follow. Each of its tokens is
        compared once (a request followed keeps its place here until `forget`)."""
        if not request.params.draftable:
            return []
        done, rid = len(request.output_tokens), request.request_id
        if rid in self._following:
            place = self._following[rid]
            if place is None or place[0] not in self._answers:
                self._following[rid] = None
                return []
        else:
            key = _key(request)
            if key not in self._answers:
                self._following[rid] = None
                return []
            place = (key, 0)
        key, confirmed = place
        answer = self._answers[key]
        if done > len(answer) or request.output_tokens[confirmed:done] != list(answer[confirmed:done]):
            self._following[rid] = None  # it went its own way: on its own from here
            return []
        self._following[rid] = (key, done)
        self._answers.move_to_end(key)
        return list(answer[done : done + count])

    def forget(self, request: Request) -> None:
        """A finished request's place (its answer is kept by `remember`, not here)."""
        self._following.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._answers)
