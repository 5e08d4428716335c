"""Reasoning apart from content: the splitter on its own, over every way an answer can be cut into tokens."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from magnitude_jupyter.engine.reasoning import (
    HARMONY,
    THINK,
    ReasoningSplitter,
    ReasoningTags,
    prompt_opens_thinking,
    reasoning_tags,
)
from magnitude_jupyter.models.chat_formats import CHATML_TEMPLATE, HARMONY_TEMPLATE


def split_all(pieces: list[str], inside: bool = False, tags: ReasoningTags = THINK) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside=inside, tags=tags)
    reasoning = content = ""
    for piece in pieces:
        out = splitter.push(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = splitter.flush()
    return reasoning + out.reasoning, content + out.content


def test_a_thinking_block_goes_apart_and_the_blank_lines_after_it_are_not_content():
    assert split_all(["<think>\nLet me see.\n</think>\n\nParis."]) == ("\nLet me see.\n", "Paris.")
    assert split_all(["No thinking here."]) == ("", "No thinking here.")


def test_an_answer_that_starts_inside_the_block_the_template_opened():
    assert split_all(["The capital...", "</think>", "\n\n", "Paris."], inside=True) == ("The capital...", "Paris.")


def test_a_block_never_closed_is_all_reasoning():
    assert split_all(["<think>still thinking when max_tokens came"]) == ("still thinking when max_tokens came", "")


def test_text_that_only_looks_like_a_tag_start_is_released_at_the_end():
    assert split_all(["a <thi", "s is not a tag"]) == ("", "a <this is not a tag")
    assert split_all(["a <thi"]) == ("", "a <thi")


ANSWER = "<think>\nWeigh a < b and </thin k>.\n</think>\n\nThe answer: 4 < 5."


@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_any_cut_into_tokens_splits_as_the_whole_does(cuts):
    bounds = sorted({0, len(ANSWER), *cuts})
    pieces = [ANSWER[a:b] for a, b in itertools.pairwise(bounds)]
    assert split_all(pieces) == split_all([ANSWER]) == ("\nWeigh a < b and </thin k>.\n", "The answer: 4 < 5.")


def test_which_templates_think_and_which_prompts_open_the_block():
    assert reasoning_tags("{% if x %}<think>{% endif %}...</think>") is THINK
    assert reasoning_tags("{{ messages }}") is None and reasoning_tags(None) is None
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


# gpt-oss as its answers read (llama.cpp writes its markers out as text)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>User says hi; a < b.<|end|><|start|>assistant<|channel|>final<|message|>Hello! <|x|>"
)


def test_gpt_oss_reasoning_is_its_analysis_channel_and_its_answer_the_final_one():
    assert reasoning_tags(HARMONY_TEMPLATE) is HARMONY and reasoning_tags(CHATML_TEMPLATE) is None
    assert split_all([HARMONY_ANSWER], tags=HARMONY) == ("User says hi; a < b.", "Hello! <|x|>")
    # an answer straight in the final channel: its header is not content
    assert split_all(["<|channel|>final<|message|>Hello."], tags=HARMONY) == ("", "Hello.")
    assert not prompt_opens_thinking("<|start|>user<|message|>hi<|end|><|start|>assistant", HARMONY)


@given(st.lists(st.integers(min_value=0, max_value=len(HARMONY_ANSWER)), max_size=12))
def test_any_cut_of_a_gpt_oss_answer_splits_as_the_whole_does(cuts):
    bounds = sorted({0, len(HARMONY_ANSWER), *cuts})
    pieces = [HARMONY_ANSWER[a:b] for a, b in itertools.pairwise(bounds)]
    assert split_all(pieces, tags=HARMONY) == ("User says hi; a < b.", "Hello! <|x|>")
