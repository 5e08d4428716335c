"""Every chat family the engine claims, on tiny GGUFs with random weights that llama.cpp loads and
runs (magnitude_jupyter/models/tiny_models.py): the format chosen for a file without a template, the
prompt it renders, the turn end that stops an answer, and the KV arithmetic against llama.cpp's
own buffer. Nothing is downloaded; each file is made in well under a second."""

from __future__ import annotations

import pytest

from magnitude_jupyter.config import Settings
from magnitude_jupyter.engine import Engine
from magnitude_jupyter.engine.memory import plan_kv
from magnitude_jupyter.engine.request import SamplingParams
from magnitude_jupyter.models.chat_formats import family_named
from magnitude_jupyter.models.kvmath import kv_bytes_per_token
from magnitude_jupyter.models.registry import read_model_info
from magnitude_jupyter.models.tiny_models import ARCHITECTURES, WORDS, write_tiny_model

from .listing import listed_details

CONVERSATION = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "name a colour"},
]
# The two-turn conversation as each family's published format writes it (BOS where the family has one).
REFERENCE = {
    "llama3": "<s><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>assistant"
    "<|end_header_id|>\n\nyes<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nname a colour<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] hello [/INST] yes</s>[INST] name a colour [/INST]",
    "chatml": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n<|im_start|>user\n"
    "name a colour<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<s><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\nyes<end_of_turn>\n"
    "<start_of_turn>user\nname a colour<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|user|>\nhello<|end|>\n<|assistant|>\nyes<|end|>\n<|user|>\nname a colour<|end|>\n<|assistant|>\n",
    # gpt-oss's published template, without its optional current-date line
    "harmony": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must "
    "be included for every message.<|end|><|start|>user<|message|>hello<|end|><|start|>assistant<|channel|>final"
    "<|message|>yes<|end|><|start|>user<|message|>name a colour<|end|><|start|>assistant",
}
KINDS = sorted(ARCHITECTURES)


def turn_end(kind: str) -> str:
    family = family_named(ARCHITECTURES[kind].family)
    assert family is not None
    return family.stops[0] if family.stops else "</s>"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-models")
    for kind in KINDS:
        write_tiny_model(folder / f"tiny-{kind}.gguf", kind)
        write_tiny_model(folder / f"tiny-{kind}-stops.gguf", kind, predicts=turn_end(kind))
    return folder


def test_every_family_is_told_from_a_file_without_a_template(tiny_dir):
    for kind in KINDS:
        chosen = read_model_info(tiny_dir / f"tiny-{kind}.gguf").chat_format()
        assert chosen.name == ARCHITECTURES[kind].family and chosen.source.startswith("family rule: vocabulary")


def test_list_shows_the_format_and_the_sliding_layers(tiny_dir, tmp_path, monkeypatch):
    output = listed_details(tiny_dir, tmp_path, monkeypatch)
    block = output[output.index("tiny-gemma3 ") :]
    # llama.cpp's gemma3 pattern: five windowed layers in six, the sixth global
    assert "sliding window   64 on 5 layers" in block
    # a session of the trained context (4,096): every token in the global layer, the last 64 in the others
    assert (
        "KV cache (f16)   128 bytes/token (global layers) + 640 for the last 64 (windowed layers), 552.0 KiB" in block
    )
    assert "chat format      gemma (family rule: vocabulary has <start_of_turn> <end_of_turn>)" in block
    # gpt-oss's pattern: every other layer windowed; its turns end at <|return|> and <|call|>, not <|end|>
    block = output[output.index("tiny-gpt-oss ") :]
    assert "sliding window   64 on 2 layers" in block
    assert "harmony (family rule: vocabulary has <|start|> <|channel|> <|message|> <|end|>); turns end at " in block
    assert "<|return|> <|call|>" in block


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_each_family_renders_its_format_stops_at_its_turn_end_and_holds_the_planned_cells(tiny_dir, kind):
    path = tiny_dir / f"tiny-{kind}-stops.gguf"
    info = read_model_info(path)
    with Engine(str(path), settings=Settings(), parallel=2, ctx_size=2048, threads=1) as engine:
        reference = REFERENCE[ARCHITECTURES[kind].family]
        expected = engine.tokenize(reference, add_special=not reference.startswith("<s>"))  # BOS once
        assert engine.prompt_tokens_for(messages=CONVERSATION) == expected
        # The model picks its family's turn end first: the answer ends there, with nothing in it.
        result = engine.generate(messages=CONVERSATION, params=SamplingParams(max_tokens=8, temperature=0))
        assert (result.finish_reason, result.text, result.counts.output) == ("stop", "", 0)
        # llama.cpp's KV buffer is what the arithmetic plans (a windowed family: the context's cells in
        # its global layers, a window per request slot and a batch in its windowed ones: see kvmath)
        stats = engine.stats()
        planned = plan_kv(info, engine.engine_settings).bytes
        if not info.sliding_window:
            assert planned == stats.scheduler.kv_cells_total * kv_bytes_per_token(info, "f16")
        assert stats.kv_bytes_planned == round(planned) and stats.kv_buffer_bytes_reported is not None
        # llama.cpp logs each buffer in MiB with two decimals
        assert abs(stats.kv_buffer_bytes_reported - planned) <= 0.01 * 2**20


@pytest.mark.model
def test_a_sliding_window_model_holds_a_window_per_sequence_and_reuses_only_what_its_window_keeps(tiny_dir):
    path = tiny_dir / "tiny-gemma3.gguf"  # window 64 on five layers in six
    info = read_model_info(path)
    with Engine(str(path), settings=Settings(), parallel=2, ctx_size=2048, threads=1, prefix_cache_entries=4) as engine:
        stats = engine.stats()
        # 2 slots x 64 + a 512-token ubatch (under 2,048-token steps), in blocks of 256: 768 cells, not
        # 2,048 (the 4 entries take their sequence ids from the slots)
        assert stats.kv_window == {
            "window": 64,
            "cells": 768,
            "bytes_per_token": kv_bytes_per_token(info, "f16") / 6 * 5,
        }
        glob = kv_bytes_per_token(info, "f16", layers=[not w for w in info.windowed_layers])
        assert stats.kv_bytes_planned == 2048 * glob + 768 * stats.kv_window["bytes_per_token"]
        assert stats.kv_buffer_bytes_reported is not None
        assert abs(stats.kv_buffer_bytes_reported - stats.kv_bytes_planned) <= 0.01 * 2**20

        # A second turn goes on from the end of the first: reused, and the same as computing it all.
        greedy = SamplingParams(max_tokens=12, temperature=0)
        first = engine.prompt_tokens_for(messages=[{"role": "user", "content": " ".join(WORDS)}])
        answer = engine.generate(prompt_tokens=first, params=greedy)
        turn = [*first, *answer.token_ids, *engine.tokenize(" say more about the water", add_special=False)]
        warm = engine.generate(prompt_tokens=turn, params=greedy)
        cold = engine.generate(
            prompt_tokens=turn, params=SamplingParams(max_tokens=12, temperature=0, reproducible=True)
        )
        assert warm.counts.cached == len(first) + len(answer.token_ids) - 1
        assert warm.token_ids[:4] == cold.token_ids[:4]
        # A prompt that parts from the entry inside it, with llama.cpp's cells whole: reused too
        inside = [*first[:-20], *engine.tokenize(" the other way round", add_special=False)]
        again = engine.generate(prompt_tokens=inside, params=greedy)
        alone = engine.generate(
            prompt_tokens=inside, params=SamplingParams(max_tokens=12, temperature=0, reproducible=True)
        )
        assert again.token_ids[:4] == alone.token_ids[:4]
        status = engine.stats().scheduler
        reused = again.counts.cached
        # either reused, or counted as what the window kept from being reused: never wrong cells
        assert reused == len(first) - 20 or status.prompt_tokens_window_missed >= len(first) - 20


@pytest.mark.model
def test_a_turn_that_parts_from_the_last_answer_goes_on_from_the_window_checkpoint_of_its_prompt(tiny_dir):
    path = tiny_dir / "tiny-gemma3.gguf"  # window 64 on five layers in six
    # An entry idle for a row moves to the RAM tier, whose saved state keeps only its end's window.
    settings = dict(parallel=2, ctx_size=2048, threads=1, prefix_cache_entries=4, prefix_cache_spill_rows=1)
    with Engine(str(path), settings=Settings(), **settings) as engine:
        first = engine.prompt_tokens_for(messages=[{"role": "user", "content": " ".join(WORDS)}])
        # An answer longer than the window: the entry's windowed cells move past the prompt's end
        answer = engine.generate(prompt_tokens=first, params=SamplingParams(max_tokens=100, ignore_eos=True))
        assert len(answer.token_ids) == 100
        assert engine.stats().scheduler.prefix_cache_window_checkpoints == 1
        engine.generate(prompt="elsewhere", params=SamplingParams(max_tokens=4, ignore_eos=True))
        # The next turn sends the answer back otherwise (as a client that trims or rewrites it would)
        other = [t for t in engine.tokenize(" the tide went out", add_special=False) if t != answer.token_ids[0]]
        turn = [*first, *other, *engine.tokenize(" and then?", add_special=False)]
        greedy = SamplingParams(max_tokens=12, temperature=0)
        warm = engine.generate(prompt_tokens=turn, params=greedy)
        cold = engine.generate(
            prompt_tokens=turn, params=SamplingParams(max_tokens=12, temperature=0, reproducible=True)
        )
        status = engine.stats().scheduler
        assert warm.counts.cached == len(first)
        assert status.prompt_tokens_window_checkpoint == len(first)
        assert warm.token_ids[:4] == cold.token_ids[:4]


# A Qwen3-like template: ChatML whose answers think, and which closes the block itself when asked
# not to think (enable_thinking false).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content.split('</think>')[-1].lstrip() if m.role == 'assistant' else m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# After the prompt's last token ("\n"), the model thinks "a b", then answers "yes" and ends its turn.
THINKING_CHAIN = ("\n", "<think>", "\u2581a", "\u2581b", "</think>", "\u2581yes", "<|im_end|>")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from magnitude_jupyter.client.runtime import LocalServer

    folder = tmp_path_factory.mktemp("thinking")
    write_tiny_model(folder / "tiny-think.gguf", "qwen2", template=THINKING_TEMPLATE, predicts=THINKING_CHAIN)
    server = LocalServer(
        ("--parallel", "2", "--ctx-size", "512"),
        token="think-token",
        config=f"models_dir: {folder}\ndefault_model: tiny-think\n",
    )
    yield server
    server.stop()


@pytest.mark.model
def test_a_thinking_models_reasoning_comes_apart_through_the_openai_sdk(thinking_server):
    import openai

    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key=thinking_server.token, max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    answer = client.chat.completions.create(model="tiny-think", messages=messages, max_tokens=16, temperature=0)
    message = answer.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"].strip()) == ("yes", "a b")
    assert answer.usage.completion_tokens_details.reasoning_tokens == 3  # a, b and the closing tag
    assert answer.choices[0].finish_reason == "stop"

    stream = client.chat.completions.create(
        model="tiny-think", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    content = reasoning = ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
    assert (content, reasoning) == (message.content, message.model_extra["reasoning_content"])

    inline = client.chat.completions.create(
        model="tiny-think", messages=messages, max_tokens=16, temperature=0, extra_body={"reasoning_format": "none"}
    )
    assert inline.choices[0].message.content == "<think> a b</think> yes"
    assert "reasoning_content" not in (inline.choices[0].message.model_extra or {})

    off = client.chat.completions.create(
        model="tiny-think",
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > answer.usage.prompt_tokens  # the template closed the block in the prompt

    # A budget of one reasoning token: the engine closes the block after "a", and the model answers
    capped = client.chat.completions.create(
        model="tiny-think", messages=messages, max_tokens=16, temperature=0, extra_body={"thinking_token_budget": 1}
    )
    message = capped.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"].strip()) == ("yes", "a")
    assert capped.usage.completion_tokens_details.reasoning_tokens == 1
    with pytest.raises(openai.BadRequestError, match="'thinking_token_budget' must be an integer"):
        client.chat.completions.create(model="tiny-think", messages=messages, extra_body={"thinking_token_budget": -1})

    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs\.add_vision_id is not supported"):
        client.chat.completions.create(
            model="tiny-think", messages=messages, extra_body={"chat_template_kwargs": {"add_vision_id": True}}
        )


# A gpt-oss whose answer reasons in the analysis channel, then answers in the final one. After the
# prompt's last token (the "t" of `<|start|>assistant`) each token writes the next; the second
# channel header is spelled in pieces of its own, as a chain holds a token once.
HARMONY_CHAIN = (
    "t",
    "<|channel|>",
    "analysis",
    "<|message|>",
    "\u2581a",
    "\u2581b",
    "<|end|>",
    "<|start|>",
    "assistant",
    "<|chan",
    "nel|>",
    "final",
    "<|mess",
    "age|>",
    "\u2581yes",
    "<|return|>",
)


@pytest.mark.model
def test_gpt_oss_reasoning_is_its_analysis_channel_and_its_answer_the_final_one(tmp_path):
    import openai

    from magnitude_jupyter.client.runtime import LocalServer

    write_tiny_model(
        tmp_path / "tiny-oss.gguf",
        "gpt-oss",
        predicts=HARMONY_CHAIN,
        pieces=("analysis", "final", *HARMONY_CHAIN[8:14]),
    )
    server = LocalServer(("--parallel", "2", "--ctx-size", "512"), token="oss", config=f"models_dir: {tmp_path}\n")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        answer = client.chat.completions.create(model="tiny-oss", messages=messages, max_tokens=32, temperature=0)
        message = answer.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"].strip()) == ("yes", "a b")
        assert answer.choices[0].finish_reason == "stop"  # at <|return|>, not at the analysis message's <|end|>
        stream = client.chat.completions.create(
            model="tiny-oss", messages=messages, max_tokens=32, temperature=0, stream=True
        )
        content = reasoning = ""
        for chunk in stream:
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, reasoning) == (message.content, message.model_extra["reasoning_content"])
        listed = client.models.retrieve("tiny-oss").model_extra["meta"]["chat_format"]
        assert (listed["name"], listed["stop_tokens"]) == ("harmony", ["<|return|>", "<|call|>"])
    finally:
        server.stop()


@pytest.mark.model
def test_a_thinking_models_reasoning_is_a_thinking_block_through_the_anthropic_sdk(thinking_server):
    import anthropic

    client = anthropic.Anthropic(base_url=thinking_server.url, api_key=thinking_server.token, max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    # the tiny model's chain outweighs every other token by e^58: sampling at the default temperature picks it
    message = client.messages.create(model="tiny-think", messages=messages, max_tokens=16)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking.strip(), message.content[1].text) == ("a b", "yes")
    with client.messages.stream(model="tiny-think", messages=messages, max_tokens=16) as stream:
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]
    off = client.messages.create(model="tiny-think", messages=messages, max_tokens=16, thinking={"type": "disabled"})

    def prompt(usage):
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(off.usage) > prompt(message.usage)  # the template closed the block in the prompt
    capped = client.messages.create(
        model="tiny-think", messages=messages, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1}
    )
    assert (capped.content[0].thinking.strip(), capped.content[1].text) == ("a", "yes")  # closed after one token


@pytest.mark.model
def test_a_thinking_models_reasoning_is_a_reasoning_item_through_the_responses_api(thinking_server):
    import openai

    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key=thinking_server.token, max_retries=0)
    response = client.responses.create(model="tiny-think", input="hello", max_output_tokens=16, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert (response.output[0].content[0].text.strip(), response.output_text) == ("a b", "yes")
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    with client.responses.stream(model="tiny-think", input="hello", max_output_tokens=16, temperature=0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [item.type for item in streamed.output] == ["reasoning", "message"]
    assert (streamed.output[0].content[0].text, streamed.output_text) == (response.output[0].content[0].text, "yes")
    off = client.responses.create(
        model="tiny-think", input="hello", max_output_tokens=16, temperature=0, reasoning={"effort": "none"}
    )
    assert off.usage.input_tokens > response.usage.input_tokens  # the template closed the block in the prompt


@pytest.mark.model
def test_the_magic_shows_a_thinking_models_reasoning_folded_above_its_answer(thinking_server, monkeypatch, tmp_path):
    from tests.notebook_helpers import run_notebook

    monkeypatch.setenv("MAGNITUDE_URL", thinking_server.url)
    monkeypatch.setenv("MAGNITUDE_TOKEN", thinking_server.token)
    nb = run_notebook(
        ["%load_ext magnitude_jupyter", "%%magnitude --model tiny-think --max-tokens 16 -o answer\nhello", "answer"],
        tmp_path,
    )
    shown = nb.cells[1].outputs[-1].data
    assert shown["text/plain"] == "[reasoning: 2 words]\nyes"
    assert shown["text/html"].startswith("<details><summary>reasoning (2 words)</summary><pre>a b</pre></details>")
    assert nb.cells[2].outputs[0].data["text/plain"] == "'yes'"  # the answer kept is the answer alone


@pytest.mark.model
def test_a_chat_formats_turn_end_is_end_of_generation_even_where_llama_cpp_does_not_say_so(tmp_path):
    # llama.cpp itself counts the families' turn ends above as EOG by their text, so the stop test
    # would pass without the engine's own set: here a plain word is made a turn end, which only the
    # engine's set can make end an answer.
    from magnitude_jupyter.engine.runner import LlamaRunner
    from magnitude_jupyter.models.tiny_models import vocabulary

    path = write_tiny_model(tmp_path / "tiny-chain.gguf", "qwen2", predicts=THINKING_CHAIN)
    tokens = vocabulary("chatml")[0]
    a, b = tokens.index("\u2581a"), tokens.index("\u2581b")
    plain = LlamaRunner(path, n_ctx=256, n_seq_max=1, n_threads=1, flash_attention=False)
    try:
        assert not plain.is_eog(b)
    finally:
        plain.close()
    runner = LlamaRunner(path, n_ctx=256, n_seq_max=1, n_threads=1, flash_attention=False, stop_tokens=frozenset({b}))
    try:
        assert runner.is_eog(b) and not runner.is_eog(a)
        assert b in runner.picker.eog_tokens  # ignore_eos bans it like llama.cpp's own end tokens
    finally:
        runner.close()


def test_a_recurrent_model_says_its_state_is_not_counted_and_is_served_without_prefix_reuse(tmp_path, monkeypatch):
    import gguf

    from tests.fakes import FakeRunner

    models = tmp_path / "models"
    models.mkdir()
    # Mamba's header as llama.cpp's converter writes it, tensors aside (the listing reads the header)
    writer = gguf.GGUFWriter(str(models / "tiny-mamba.gguf"), "mamba")
    writer.add_block_count(2)
    writer.add_context_length(1024)
    writer.add_embedding_length(64)
    writer.add_uint32("mamba.ssm.state_size", 16)
    writer.add_uint32("mamba.ssm.conv_kernel", 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_model_info(models / "tiny-mamba.gguf").recurrent_state == "ssm"
    output = listed_details(models, tmp_path, monkeypatch)
    assert "recurrent state  ssm layers: not counted (see docs/models.md)" in output

    runner = FakeRunner(step_seconds=0)
    runner.recurrent = True
    with Engine(settings=Settings(), runner_factory=lambda es: runner, parallel=2, ctx_size=256, n_batch=16) as engine:
        prompt = list(range(100, 140))
        engine.generate(prompt_tokens=prompt, params=SamplingParams(max_tokens=4))
        again = engine.generate(prompt_tokens=[*prompt, 7], params=SamplingParams(max_tokens=4, temperature=0))
        assert again.counts.cached == 0
        assert not engine.engine_settings.prefix_reuse and engine.engine_settings.draft_tokens == 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"unit": "c"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "12 degrees"},
]


@pytest.mark.parametrize("kind", KINDS)
def test_each_familys_format_carries_the_tools_a_call_and_its_result(kind):
    from magnitude_jupyter.api.tools import tool_request
    from magnitude_jupyter.engine.chat import render_chat

    family = family_named(ARCHITECTURES[kind].family)
    assert family is not None
    text = render_chat(TOOL_TURNS, family.template, "<s>", "</s>", tools=tool_request([WEATHER]))
    if family.name == "harmony":  # its template writes tools, calls and results itself, as gpt-oss reads them
        assert "namespace functions {\n\ntype weather = (_: {" in text
        assert "<|channel|>commentary to=functions.weather <|constrain|>json<|message|>" in text
        assert "<|start|>functions.weather to=assistant<|channel|>commentary<|message|>12 degrees<|end|>" in text
        return
    assert "You can call these functions" in text and '"name": "weather"' in text
    assert '{"tool_calls": [{"name": "weather", "arguments": {"unit": "c"}}]}' in text
    assert '{"tool_results": [{"name": "weather", "content": "12 degrees"}]}' in text


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_each_family_calls_a_tool_the_parser_reads_back(tiny_dir, kind):
    import json

    from magnitude_jupyter.api.tools import tool_request
    from magnitude_jupyter.engine.tools import parse_answer, template_form

    tools = tool_request([WEATHER], "required")
    with Engine(
        str(tiny_dir / f"tiny-{kind}.gguf"), settings=Settings(), parallel=1, ctx_size=1024, threads=1
    ) as engine:
        # random weights, held to the call's form by the grammar: a complete call, whatever they pick
        result = engine.generate(
            messages=TOOL_TURNS[:2], tools=tools, params=SamplingParams(max_tokens=160, temperature=0)
        )
        family = family_named(ARCHITECTURES[kind].family)
        assert family is not None
        form = template_form(family.template).name  # gpt-oss: its own form
        if form == "harmony" and result.finish_reason == "length" and not result.text:
            # its form lets it reason first (the analysis channel), as gpt-oss does before a call:
            # random weights may reason past max_tokens; the grammar held the reasoning to its channel
            assert result.reasoning
            return
        answer = parse_answer(result.text, form)
        assert [(call.name, call.complete) for call in answer.calls] == [("weather", True)], result.text
        assert json.loads(answer.calls[0].arguments)["unit"] in ("c", "f")


# A gpt-oss that calls a tool as its format does: a commentary-channel message to the function, its
# arguments JSON, the turn ended by <|call|>. Each token writes the next after the prompt's last.
HARMONY_CALL_CHAIN = (
    "t",
    "<|channel|>",
    "commentary",
    "\u2581to=functions.weather",
    "\u2581<|constrain|>json",
    "<|message|>",
    '{"unit":',
    '\u2581"c"}',
    "<|call|>",
)


@pytest.mark.model
def test_gpt_oss_calls_a_tool_in_its_commentary_channel_and_the_api_reads_it(tmp_path):
    import openai

    from magnitude_jupyter.client.runtime import LocalServer

    write_tiny_model(tmp_path / "tiny-oss.gguf", "gpt-oss", predicts=HARMONY_CALL_CHAIN, pieces=HARMONY_CALL_CHAIN[2:8])
    server = LocalServer(("--parallel", "1", "--ctx-size", "1024"), token="oss", config=f"models_dir: {tmp_path}\n")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0)
        answer = client.chat.completions.create(
            model="tiny-oss", messages=TOOL_TURNS[:2], tools=[WEATHER], max_tokens=64, temperature=0
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("weather", '{"unit": "c"}')
        # the call and its result go back through the template's own forms, and the next turn reads on
        history = [*TOOL_TURNS[:2], choice.message.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": call.id, "content": "12 degrees"})
        again = client.chat.completions.create(
            model="tiny-oss", messages=history, tools=[WEATHER], max_tokens=64, temperature=0
        )
        assert again.usage.prompt_tokens > answer.usage.prompt_tokens
    finally:
        server.stop()
