"""Which chat format a model speaks: its file's template, a config's, or its family's.

A GGUF file usually carries its chat template. Where it does not (Gemma 3 files, many Mistral
conversions), serving it in a format it was never trained on makes it echo the question and run on
past its turn, so the family's format is chosen from what the file says of itself: the special
tokens in its vocabulary first (they are what the model was trained to see), its architecture and
name after. A model whose format cannot be told is served in a plain transcript with a warning
that says so, never silently in someone else's format (docs/decisions.md, "Chat formats by family").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Vocabulary entries that tell a family (and end its turns); the GGUF reader notes their ids.
GEMMA_TURN = ("<start_of_turn>", "<end_of_turn>")
LLAMA3_TURN = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_EXTRA_STOPS = ("<|eom_id|>",)
CHATML_TURN = ("<|im_start|>", "<|im_end|>")
PHI3_TURN = ("<|user|>", "<|assistant|>", "<|end|>")
MISTRAL_TURN = ("[INST]", "[/INST]")
HARMONY_TURN = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_STOPS = ("<|return|>", "<|call|>")  # `<|end|>` ends a message, not the turn: the final channel follows
VOCAB_MARKERS = frozenset(GEMMA_TURN + LLAMA3_TURN + LLAMA3_EXTRA_STOPS + CHATML_TURN + PHI3_TURN + MISTRAL_TURN).union(
    HARMONY_TURN, HARMONY_STOPS
)

# Gemma has no system role: a system message opens the next user turn (as its own template does); one
# that no user turn follows (Claude Code's environment block after the last user message) is a user
# turn of its own.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if ns.system %}<start_of_turn>user\n{{ ns.system | trim }}<end_of_turn>\n{% endif %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Mistral's instruction format: a system message goes before the last user turn's text.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] + '\n\n' %}{% endif %}{% endfor %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% if not users and ns.system %}[INST] {{ ns.system | trim }} [/INST]{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] "
    "{% if message is sameas users[-1] %}{{ ns.system }}{% endif %}{{ message['content'] | trim }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] | trim }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}[INST] {{ message['content'] | trim }} [/INST]{% endif %}"
    "{% endfor %}"
)
# gpt-oss's harmony format, as its published template writes a chat: a system message with the
# reasoning effort and the channels, the conversation's system messages as the developer's
# instructions and the tools as a `functions` namespace (each with its JSON Schema), earlier answers in
# the final channel (their reasoning dropped), calls as commentary-channel messages to a function,
# results as the function's messages, and the answer opened for the model, which picks its channel.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] %}{% endif %}{% endfor %}"
    "{% if ns.system or tools %}<|start|>developer<|message|>"
    "{% if ns.system %}# Instructions\n\n{{ ns.system }}{% endif %}"
    "{% if ns.system and tools %}{{ '\\n\\n' }}{% endif %}"
    "{% if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set f = tool['function'] %}"
    "{% if f['description'] %}// {{ f['description'] }}{{ '\\n' }}{% endif %}"
    "type {{ f['name'] }} = (_: {{ f['parameters'] | tojson }}) => any;\n\n{% endfor %}"
    "} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "<|start|>user<|message|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'tool' %}"
    "<|start|>functions.{{ message['name'] }} to=assistant<|channel|>commentary<|message|>"
    "{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ call['function']['name'] }} <|constrain|>json<|message|>"
    "{{ call['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# No format could be told: a plain transcript, which base models continue reasonably.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    markers: tuple[str, ...]  # all in the vocabulary: this family's format
    stops: tuple[str, ...] = ()  # vocabulary entries that end the model's turn
    architectures: tuple[str, ...] = ()  # ... or this architecture with no markers to tell
    name_words: tuple[str, ...] = ()  # ... or the model's name says it


FAMILIES = (
    Family("gemma", GEMMA_TEMPLATE, GEMMA_TURN, stops=("<end_of_turn>",), architectures=("gemma", "gemma2", "gemma3")),
    Family("llama3", LLAMA3_TEMPLATE, LLAMA3_TURN, stops=("<|eot_id|>", *LLAMA3_EXTRA_STOPS)),
    Family("chatml", CHATML_TEMPLATE, CHATML_TURN, stops=("<|im_end|>",)),
    Family("phi3", PHI3_TEMPLATE, PHI3_TURN, stops=("<|end|>",), architectures=("phi3",)),
    Family("mistral", MISTRAL_TEMPLATE, MISTRAL_TURN, name_words=("mistral", "mixtral")),
    Family("harmony", HARMONY_TEMPLATE, HARMONY_TURN, stops=HARMONY_STOPS, architectures=("gpt-oss",)),
)


@dataclass(frozen=True)
class ChatFormat:
    """The format a model is served in, where it came from, and the turn ends it adds to the EOG tokens."""

    name: str  # a family's name, "file", "config" or "plain"
    source: str  # "file", "config", "family rule: ..." or "none"
    template: str  # the Jinja template chats are rendered through
    stop_tokens: tuple[str, ...] = ()
    warning: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "stop_tokens": list(self.stop_tokens),
            "warning": self.warning,
        }


def family_named(name: str) -> Family | None:
    return next((f for f in FAMILIES if f.name == name), None)


def _family_format(family: Family, rule: str, vocab: Mapping[str, int]) -> ChatFormat:
    stops = tuple(stop for stop in family.stops if stop in vocab)  # only turn ends the vocabulary has
    return ChatFormat(family.name, f"family rule: {rule}", family.template, stops)


def choose_format(
    *,
    architecture: str,
    model_name: str,
    file_template: str | None,
    vocab_markers: Mapping[str, int],
    config_template: str | None = None,
) -> ChatFormat:
    """The format to serve a model in: a config's template, else the file's, else its family's by
    the rules above (vocabulary, then architecture, then name), else a plain transcript, warned."""
    if config_template:
        return ChatFormat("config", "config", config_template)
    if file_template:
        return ChatFormat("file", "file", file_template)
    for family in FAMILIES:
        if all(marker in vocab_markers for marker in family.markers):
            return _family_format(family, f"vocabulary has {' '.join(family.markers)}", vocab_markers)
    for family in FAMILIES:
        if architecture in family.architectures:
            return _family_format(family, f"architecture {architecture}", vocab_markers)
    words = model_name.lower()
    for family in FAMILIES:
        word = next((w for w in family.name_words if w in words), None)
        if word is not None:
            return _family_format(family, f"name has {word!r}", vocab_markers)
    return ChatFormat(
        "plain",
        "none",
        PLAIN_TEMPLATE,
        warning=(
            f"the file has no chat template and its vocabulary, architecture ({architecture}) and name tell no known "
            "chat format: it is served as a plain 'Role: text' transcript; give its format as models.<alias>."
            "chat_template in the config"
        ),
    )
