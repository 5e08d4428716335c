"""Chat formats by family: the choice from what a GGUF file says of itself, and what each renders."""

from __future__ import annotations

import sys

import gguf
import pytest

from magnitude_jupyter.engine.chat import render_chat
from magnitude_jupyter.models.chat_formats import (
    CHATML_TURN,
    FAMILIES,
    GEMMA_TURN,
    LLAMA3_TURN,
    MISTRAL_TURN,
    PHI3_TURN,
    choose_format,
    family_named,
)
from magnitude_jupyter.models.gguf_reader import read_header
from magnitude_jupyter.models.registry import read_model_info


def vocab(*tokens: str) -> dict[str, int]:
    return {token: 1000 + i for i, token in enumerate(tokens)}


def choose(architecture="llama", name="some model", template=None, markers=None, config=None):
    return choose_format(
        architecture=architecture,
        model_name=name,
        file_template=template,
        vocab_markers=markers or {},
        config_template=config,
    )


@pytest.mark.parametrize(
    ("markers", "architecture", "family", "stops"),
    [
        (vocab(*GEMMA_TURN), "gemma3", "gemma", ("<end_of_turn>",)),
        (vocab(*LLAMA3_TURN, "<|eom_id|>"), "llama", "llama3", ("<|eot_id|>", "<|eom_id|>")),
        (vocab(*CHATML_TURN), "qwen2", "chatml", ("<|im_end|>",)),
        (vocab(*PHI3_TURN), "phi3", "phi3", ("<|end|>",)),
        (vocab(*MISTRAL_TURN), "llama", "mistral", ()),
    ],
)
def test_a_file_without_a_template_gets_its_familys_format_from_its_vocabulary(markers, architecture, family, stops):
    chosen = choose(architecture=architecture, markers=markers)
    assert chosen.name == family and chosen.source.startswith("family rule: vocabulary has")
    assert chosen.template == family_named(family).template and chosen.stop_tokens == stops
    assert chosen.warning is None


def test_chatml_only_when_the_vocabulary_has_its_tokens():
    # A Gemma file with no template: its vocabulary has no <|im_start|>, so never ChatML.
    assert choose(architecture="gemma3", markers=vocab(*GEMMA_TURN)).name == "gemma"
    assert choose(architecture="gemma3").source == "family rule: architecture gemma3"  # markers not found
    assert choose(name="Mistral-7B-Instruct-v0.2").source == "family rule: name has 'mistral'"


def test_an_unknown_format_is_served_plain_with_a_warning_never_silently_as_chatml():
    chosen = choose(architecture="falcon", name="tiny")
    assert chosen.name == "plain" and chosen.source == "none"
    assert "falcon" in chosen.warning and "chat_template" in chosen.warning
    text = render_chat([{"role": "user", "content": "Hi"}], chosen.template)
    assert text == "User: Hi\n\nAssistant:" and "<|im_start|>" not in text


def test_the_config_wins_then_the_file():
    markers = vocab(*GEMMA_TURN)
    assert choose(markers=markers, template="{{ x }}", config="{{ y }}").source == "config"
    file_format = choose(markers=markers, template="{{ x }}")
    assert (file_format.name, file_format.source, file_format.template) == ("file", "file", "{{ x }}")


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a colour."},
]


def test_gemma_has_no_system_role_the_system_text_opens_the_first_user_turn():
    text = render_chat(CHAT, family_named("gemma").template, bos_token="<bos>")
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
@pytest.mark.parametrize("before", [CHAT, CHAT[1:2], []])
def test_a_system_message_after_the_last_user_message_is_in_every_familys_prompt(family, before):
    """Claude Code puts its environment block there; no format may drop it (nor one with no user turn)."""
    messages = [*before, {"role": "system", "content": "ENVIRONMENT BLOCK"}]
    assert "ENVIRONMENT BLOCK" in render_chat(messages, family_named(family).template, bos_token="<s>")


def test_gemma_says_a_trailing_system_message_as_a_user_turn_of_its_own():
    text = render_chat([*CHAT, {"role": "system", "content": "Now: 10:00."}], family_named("gemma").template)
    assert text.endswith(
        "Name a colour.<end_of_turn>\n<start_of_turn>user\nNow: 10:00.<end_of_turn>\n<start_of_turn>model\n"
    )


def test_llama3_headers_and_turn_ends():
    text = render_chat(CHAT[:2], family_named("llama3").template, bos_token="<|begin_of_text|>")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_mistral_puts_the_system_text_in_the_last_instruction():
    text = render_chat(CHAT, family_named("mistral").template, bos_token="<s>", eos_token="</s>")
    assert text == "<s>[INST] Hi [/INST] Hello.</s>[INST] Be brief.\n\nName a colour. [/INST]"


def test_phi3_and_chatml_roles():
    assert render_chat(CHAT[1:2], family_named("phi3").template) == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert render_chat(CHAT[1:2], family_named("chatml").template) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def write_gguf(path, architecture: str, tokens: list[str], name: str = "tiny") -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_gguf_reader_notes_where_the_format_tokens_are(tmp_path):
    path = tmp_path / "gemma-like.gguf"
    write_gguf(path, "gemma3", ["<pad>", "<eos>", "<bos>", *(f"w{i}" for i in range(5000)), *GEMMA_TURN])
    header = read_header(path)
    assert header.vocab_markers == {"<start_of_turn>": 5003, "<end_of_turn>": 5004}
    assert header.array_lengths["tokenizer.ggml.tokens"] == 5005
    info = read_model_info(path)
    assert info.chat_format().name == "gemma" and not info.has_chat_template


def test_the_bundled_model_keeps_its_files_template():
    from magnitude_jupyter.models.registry import bundled_model_path

    info = read_model_info(bundled_model_path())
    assert info.vocab_markers == {"<|im_start|>": 1, "<|im_end|>": 2}
    assert info.chat_format().source == "file"


TEMPLATE_KEY = "tokenizer.chat_template"
NEW_METADATA = (sys.executable, "-m", "gguf.scripts.gguf_new_metadata")


@pytest.fixture(scope="module")
def templateless_dir(tmp_path_factory, model_path):
    """The bundled model with its chat template taken out of the file (gguf's own metadata tool): a
    file as many conversions ship, whose vocabulary still says ChatML."""
    import subprocess

    folder = tmp_path_factory.mktemp("templateless")
    target = folder / "smollm2-no-template.gguf"
    subprocess.run(
        [*NEW_METADATA, "--force", "--remove-metadata", TEMPLATE_KEY, str(model_path), str(target)],
        check=True,
        capture_output=True,
    )
    return folder


def test_cli_list_says_which_format_and_where_it_came_from(tmp_path, monkeypatch, templateless_dir):
    from .listing import listed_details

    output = listed_details(templateless_dir, tmp_path, monkeypatch)
    assert "chat format      the file's template" in output  # the bundled model
    assert (
        "chat format      chatml (family rule: vocabulary has <|im_start|> <|im_end|>); turns end at <|im_end|>"
        in output
    )


@pytest.mark.model
def test_a_file_without_a_template_is_served_in_its_familys_format_and_stops_at_its_turn_end(templateless_dir):
    from magnitude_jupyter.config import Settings
    from magnitude_jupyter.engine import Engine
    from magnitude_jupyter.engine.request import SamplingParams

    path = templateless_dir / "smollm2-no-template.gguf"
    with Engine(str(path), settings=Settings(), parallel=1, ctx_size=512) as engine:
        assert engine.chat_format is not None and engine.chat_format.name == "chatml"
        assert engine.runner.is_eog(2)  # <|im_end|>
        messages = [{"role": "user", "content": "Say hello."}]
        assert engine.prompt_tokens_for(messages=messages)[0] == 1  # <|im_start|>, one token: the family's own
        result = engine.generate(messages=messages, params=SamplingParams(max_tokens=64, temperature=0))
        assert "<|im_end" not in result.text and "<|im_start" not in result.text
