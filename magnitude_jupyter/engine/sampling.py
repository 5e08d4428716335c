"""Picking each sequence's next token from its logits row: llama.cpp sampler chains, grammars kept out
of the chains, and end-of-generation tokens banned for `ignore_eos` (the runner's other half)."""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from .request import SamplingParams
from .runner_api import GrammarDeadEnd

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data
GRAMMAR_SHORTLIST = 256  # tokens a greedy request's grammar is tried on before the whole vocabulary


def _token_data_array(candidates: np.ndarray) -> Any:
    """A llama_token_data_array over a numpy array of TOKEN_DATA (no copy)."""
    data = candidates.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
    return llama_cpp.llama_token_data_array(data=data, size=len(candidates), selected=-1, sorted=False)


class TokenPicker:
    """Per-sequence sampling state over one vocabulary; every call on the engine thread."""

    def __init__(self, vocab: Any, n_vocab: int, n_ctx: int, stop_tokens: frozenset[int] = frozenset()) -> None:
        """`stop_tokens`: turn ends of the model's chat format that llama.cpp does not count as EOG."""
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.stop_tokens = stop_tokens
        self._samplers: dict[int, ctypes.c_void_p | None] = {}
        self.eog_tokens = np.array(
            [t for t in range(n_vocab) if t in stop_tokens or llama_cpp.llama_vocab_is_eog(vocab, t)], dtype=np.int64
        )
        self._eog_banned: set[int] = set()  # sequences that ignore_eos: llama-server's rule, EOG never sampled
        self._grammars: dict[int, ctypes.c_void_p] = {}  # kept out of the chains: see `sample`
        self._shortlist_need: dict[int, int] = {}  # see _shortlist_pick
        # preempted requests' states, by request id: (chain, grammar, shortlist need, EOG banned)
        self._parked: dict[str, tuple[Any, Any, int | None, bool]] = {}
        self._candidates = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._token_ids = np.arange(n_vocab, dtype=np.int32)
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        self._shortlist = np.zeros(GRAMMAR_SHORTLIST, dtype=TOKEN_DATA)

    def grammar_sampler(self, grammar: str) -> ctypes.c_void_p | None:
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar.encode("utf-8"), b"root")
        return sampler or None

    def start(self, seq_id: int, params: SamplingParams, prompt_tokens: Sequence[int]) -> None:
        """Build the sequence's sampler; the prompt primes the repetition penalty."""
        self.free(seq_id)
        # `ignore_eos` bans end-of-generation tokens, as llama.cpp's server does, rather than sampling
        # and skipping them: the answer is the text of its tokens, so a conversation that resends it
        # tokenizes back to the same cells and the prefix cache keeps hitting.
        if params.bans_eog:
            self._eog_banned.add(seq_id)
        if params.grammar is not None:
            grammar = self.grammar_sampler(params.grammar)
            if grammar is None:
                raise ValueError("llama.cpp could not parse the grammar")
            self._grammars[seq_id] = grammar
            shortlist_need = 1 if params.greedy else params.top_k
            if not params.penalized and 0 < shortlist_need <= GRAMMAR_SHORTLIST:
                self._shortlist_need[seq_id] = shortlist_need
        if params.greedy and not params.penalized:
            self._samplers[seq_id] = None  # plain argmax over the logits row: no sampler state needed
            return
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if params.bans_eog and len(self.eog_tokens):
            biases = (llama_cpp.llama_logit_bias * len(self.eog_tokens))(
                *(llama_cpp.llama_logit_bias(int(token), float("-inf")) for token in self.eog_tokens)
            )
            bias = llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(biases), biases)
            llama_cpp.llama_sampler_chain_add(chain, bias)
        if params.penalized:
            last_n = self.n_ctx if params.repeat_last_n == -1 else params.repeat_last_n
            penalties = llama_cpp.llama_sampler_init_penalties(
                self.n_vocab, last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty
            )
            for token in prompt_tokens:  # the penalty sampler alone: a grammar must not see the prompt
                llama_cpp.llama_sampler_accept(penalties, token)
            llama_cpp.llama_sampler_chain_add(chain, penalties)
        if params.greedy:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        self._samplers[seq_id] = chain

    def park(self, seq_id: int, key: str) -> None:
        """Keep the sequence's sampling state, as it is mid-answer, under `key` (a preempted request's
        id) while its sequence id serves others; `unpark` gives it back to a sequence."""
        self._parked[key] = (
            self._samplers.pop(seq_id, None),
            self._grammars.pop(seq_id, None),
            self._shortlist_need.pop(seq_id, None),
            seq_id in self._eog_banned,
        )
        self._eog_banned.discard(seq_id)

    def unpark(self, key: str, seq_id: int) -> None:
        self.free(seq_id)
        chain, grammar, shortlist_need, banned = self._parked.pop(key)
        self._samplers[seq_id] = chain
        if grammar is not None:
            self._grammars[seq_id] = grammar
        if shortlist_need is not None:
            self._shortlist_need[seq_id] = shortlist_need
        if banned:
            self._eog_banned.add(seq_id)

    def forget(self, key: str) -> None:
        """A parked state whose request ended without resuming."""
        parked = self._parked.pop(key, None)
        if parked is not None:
            for sampler in parked[:2]:
                if sampler is not None:
                    llama_cpp.llama_sampler_free(sampler)

    def free(self, seq_id: int) -> None:
        self._eog_banned.discard(seq_id)
        self._shortlist_need.pop(seq_id, None)
        grammar = self._grammars.pop(seq_id, None)
        if grammar is not None:
            llama_cpp.llama_sampler_free(grammar)
        chain = self._samplers.pop(seq_id, None)
        if chain is not None:
            llama_cpp.llama_sampler_free(chain)

    def close(self) -> None:
        for seq_id in list(self._samplers):
            self.free(seq_id)
        for key in list(self._parked):
            self.forget(key)

    def sample(self, seq_id: int, ctx: Any, row: int, logits: Callable[[], np.ndarray]) -> int:
        """The next token of `seq_id` from batch row `row` of `ctx`'s last decode (`logits` reads it)."""
        chain = self._samplers[seq_id]
        grammar = self._grammars.get(seq_id)
        if grammar is None:
            if chain is None:
                return self._argmax(seq_id, logits())
            return int(llama_cpp.llama_sampler_sample(chain, ctx, row))
        # As llama.cpp's own sampling does: the token picked without the grammar, if the grammar
        # allows it (it mostly does), else the pick among the tokens it allows. Checking one token is
        # cheap; applying a grammar to every token of the vocabulary, each step, is not.
        row_logits = logits()
        token = self._pick(seq_id, chain, None, row_logits)
        if not self._allows(grammar, token, float(row_logits[token])):
            picked = self._shortlist_pick(seq_id, chain, grammar, row_logits)
            token = picked if picked is not None else self._pick(seq_id, chain, grammar, row_logits)
            # Never hand llama.cpp's grammar a token it refuses: it aborts the process (GrammarDeadEnd).
            if not self._allows(grammar, token, 0.0):
                raise GrammarDeadEnd(complete=self._grammar_complete(grammar))
        llama_cpp.llama_sampler_accept(grammar, token)
        if chain is not None:
            llama_cpp.llama_sampler_accept(chain, token)
        return token

    def is_eog(self, token: int) -> bool:
        return token in self.stop_tokens or bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def _argmax(self, seq_id: int, logits: np.ndarray) -> int:
        token = int(np.argmax(logits))
        if seq_id in self._eog_banned and self.is_eog(token):
            logits = logits.copy()  # the row itself stays the model's, for logprobs
            logits[self.eog_tokens] = -np.inf
            token = int(np.argmax(logits))
        return token

    def _pick(self, seq_id: int, chain: Any, grammar: Any, logits: np.ndarray) -> int:
        """The token the chain picks (argmax without one), over the tokens `grammar` allows if given;
        nothing is accepted into either."""
        if chain is None and grammar is None:
            return self._argmax(seq_id, logits)
        candidates = self._candidates
        candidates["id"] = self._token_ids  # a chain sorts and cuts them in place
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = _token_data_array(candidates)
        if grammar is not None:
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
        if chain is None:
            return int(candidates["id"][int(np.argmax(candidates["logit"][: array.size]))])
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
        return int(candidates["id"][array.selected])

    def _shortlist_pick(self, seq_id: int, chain: Any, grammar: Any, logits: np.ndarray) -> int | None:
        """The pick under a grammar made among the GRAMMAR_SHORTLIST likeliest tokens only, where that
        is the same pick as over the whole vocabulary; None where it may not be.

        Applying a grammar costs each token it is tried on times the alternatives it has open, so a
        wide choice (an enum) tried on the whole vocabulary stalls every request's step. Every token
        outside the shortlist is less likely than every token in it: when the grammar allows at least
        as many shortlisted tokens as the pick looks at (1 for greedy, top_k for a chain without
        penalties, which only lower some logits), none outside could have been picked.
        """
        need = self._shortlist_need.get(seq_id)
        if need is None:
            return None
        shortlist = np.argpartition(logits, -GRAMMAR_SHORTLIST)[-GRAMMAR_SHORTLIST:]
        if seq_id in self._eog_banned:
            shortlist = shortlist[~np.isin(shortlist, self.eog_tokens)]
        size = len(shortlist)
        candidates = self._shortlist[:size]
        candidates["id"] = shortlist
        candidates["logit"] = logits[shortlist]
        candidates["p"] = 0.0
        array = _token_data_array(candidates)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
        allowed = np.isfinite(candidates["logit"][: array.size])
        if int(allowed.sum()) < need:
            return None
        if chain is None:
            return int(candidates["id"][int(np.argmax(candidates["logit"][: array.size]))])
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
        return int(candidates["id"][array.selected])

    def _grammar_complete(self, grammar: Any) -> bool:
        """Whether the grammar has reached its end: it lets an end-of-generation token through."""
        return any(self._allows(grammar, int(token), 0.0) for token in self.eog_tokens[:8])

    def _allows(self, grammar: Any, token: int, logit: float) -> bool:
        one = self._one
        one["id"], one["logit"], one["p"] = token, logit, 0.0
        array = _token_data_array(one)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
        return bool(np.isfinite(one["logit"][0]))
