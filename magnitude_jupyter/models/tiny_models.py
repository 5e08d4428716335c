"""Tiny GGUF models with random weights, one per architecture and chat family, made in a second.

Everything else is built and measured on the bundled model; these let formats, turn ends, KV
arithmetic and cache reuse be checked on every family the engine claims, with llama.cpp loading and
running each file as it would a real one, and nothing downloaded. Their answers mean nothing: what
they test is what the server does around the model (issue "real models, not one").

The vocabulary is SentencePiece-style (llama.cpp's `llama` tokenizer, which every architecture here
accepts): the control tokens, the family's turn markers, the 256 byte tokens, then letters and
frequent words, so any text tokenizes.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .chat_formats import family_named

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "hello colour red blue green say name yes brief"
)
WORDS = tuple(_WORD_TEXT.split(" "))
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types
# Added tokens written as text (not control): a thinking model's tags, as Qwen3's vocabulary has them.
USER_TOKENS = {"chatml": ("<think>", "</think>")}
EXTRA_CONTROL = {"phi3": ("<|endoftext|>",), "llama3": ("<|begin_of_text|>",)}  # llama.cpp looks these up


@dataclass(frozen=True)
class TinyShape:
    layers: int = 4
    embedding: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    feed_forward: int = 128
    context: int = 4096


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    family: str  # chat_formats family whose markers the vocabulary holds
    layer_tensors: Callable[[TinyShape], dict[str, tuple[int, ...]]]  # name -> numpy shape, per layer
    sliding_window: int | None = None  # written as {arch}.attention.sliding_window
    tied_output: bool = True
    layers: int = 4
    experts: int = 0  # a mixture of experts: this many, EXPERTS_USED of them per token


def _attention(s: TinyShape) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "attn_norm.weight": (s.embedding,),
        "attn_q.weight": (q, s.embedding),
        "attn_k.weight": (kv, s.embedding),
        "attn_v.weight": (kv, s.embedding),
        "attn_output.weight": (s.embedding, q),
    }


def _swiglu(s: TinyShape) -> dict[str, tuple[int, ...]]:
    return {
        "ffn_norm.weight": (s.embedding,),
        "ffn_gate.weight": (s.feed_forward, s.embedding),
        "ffn_up.weight": (s.feed_forward, s.embedding),
        "ffn_down.weight": (s.embedding, s.feed_forward),
    }


def _llama(s: TinyShape) -> dict[str, tuple[int, ...]]:
    return {**_attention(s), **_swiglu(s)}


def _qwen2(s: TinyShape) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {**_llama(s), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}


def _gemma3(s: TinyShape) -> dict[str, tuple[int, ...]]:
    return {
        **_llama(s),
        "attn_q_norm.weight": (s.head_dim,),
        "attn_k_norm.weight": (s.head_dim,),
        "post_attention_norm.weight": (s.embedding,),
        "post_ffw_norm.weight": (s.embedding,),
    }


def _phi3(s: TinyShape) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "attn_norm.weight": (s.embedding,),
        "attn_qkv.weight": (q + 2 * kv, s.embedding),
        "attn_output.weight": (s.embedding, q),
        "ffn_norm.weight": (s.embedding,),
        "ffn_up.weight": (2 * s.feed_forward, s.embedding),
        "ffn_down.weight": (s.embedding, s.feed_forward),
    }


EXPERTS, EXPERTS_USED = 4, 2


def _gpt_oss(s: TinyShape) -> dict[str, tuple[int, ...]]:
    q, kv, f, experts = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.feed_forward, EXPERTS
    return {
        **_attention(s),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_output.bias": (s.embedding,),
        "attn_sinks.weight": (s.heads,),
        "post_attention_norm.weight": (s.embedding,),
        "ffn_gate_inp.weight": (experts, s.embedding),
        "ffn_gate_inp.bias": (experts,),
        "ffn_gate_exps.weight": (experts, f, s.embedding),
        "ffn_gate_exps.bias": (experts, f),
        "ffn_up_exps.weight": (experts, f, s.embedding),
        "ffn_up_exps.bias": (experts, f),
        "ffn_down_exps.weight": (experts, s.embedding, f),
        "ffn_down_exps.bias": (experts, s.embedding),
    }


# Tensors that write into the residual stream: zero where the model is made to predict (write_tiny_model).
RESIDUAL_WRITERS = (
    "attn_output.weight",
    "attn_output.bias",
    "ffn_down.weight",
    "ffn_down_exps.weight",
    "ffn_down_exps.bias",
)

ARCHITECTURES = {
    "llama3": Architecture("llama", "llama3", _llama),
    "mistral": Architecture("llama", "mistral", _llama),
    "qwen2": Architecture("qwen2", "chatml", _qwen2),
    # six layers: llama.cpp's gemma3 pattern makes five of them windowed and the sixth global
    "gemma3": Architecture("gemma3", "gemma", _gemma3, sliding_window=64, layers=6),
    "phi3": Architecture("phi3", "phi3", _phi3, tied_output=False),
    # llama.cpp's gpt-oss pattern: every other layer windowed; four experts, two used per token
    "gpt-oss": Architecture("gpt-oss", "harmony", _gpt_oss, sliding_window=64, tied_output=False, experts=EXPERTS),
}


def vocabulary(family: str, more: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types: control tokens, the family's markers, bytes, letters, words and `more`."""
    chat = family_named(family)
    markers = (*chat.markers, *chat.stops) if chat else ()
    markers = (*dict.fromkeys((*markers, *EXTRA_CONTROL.get(family, ()))),)
    tokens = ["<unk>", "<s>", "</s>", *markers]
    types = [UNKNOWN, CONTROL, CONTROL, *([CONTROL] * len(markers))]
    user = USER_TOKENS.get(family, ())
    tokens += user
    types += [USER_DEFINED] * len(user)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = ["\u2581", *string.ascii_letters, *string.digits, *".,!?:;'\"-()\n"]
    pieces += [f"\u2581{c}" for c in string.ascii_letters] + [f"\u2581{w}" for w in WORDS]
    pieces += [p for p in dict.fromkeys(more) if p not in pieces and p not in tokens]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    # longer pieces score higher, so words merge whole
    scores[-len(pieces) :] = [float(len(p)) - i * 1e-3 for i, p in enumerate(pieces)]
    return tokens, scores, types


@dataclass(frozen=True)
class BorrowedTokenizer:
    """A real model's tokenizer, as its GGUF holds it (a byte-level BPE: tokens, types, merges)."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int
    eos: int
    template: str | None

    @classmethod
    def read(cls, path: str | Path) -> BorrowedTokenizer:
        reader = gguf.GGUFReader(str(path))

        def text(key: str) -> str:
            field = reader.fields[key]
            return bytes(field.parts[field.data[0]]).decode()

        def texts(key: str) -> list[str]:
            field = reader.fields[key]
            return [bytes(field.parts[i]).decode() for i in field.data]

        def number(key: str) -> int:
            field = reader.fields[key]
            return int(field.parts[field.data[0]][0])

        types = reader.fields["tokenizer.ggml.token_type"]
        return cls(
            model=text("tokenizer.ggml.model"),
            pre=text("tokenizer.ggml.pre"),
            tokens=texts("tokenizer.ggml.tokens"),
            types=[int(types.parts[i][0]) for i in types.data],
            merges=texts("tokenizer.ggml.merges"),
            bos=number("tokenizer.ggml.bos_token_id"),
            eos=number("tokenizer.ggml.eos_token_id"),
            template=text("tokenizer.chat_template") if "tokenizer.chat_template" in reader.fields else None,
        )


AGENT_CONTEXT = 65536  # agents refuse smaller windows (Hermes Agent asks for 64k) and send 10-21k tokens
AGENT_ANSWER = ("\u010a", "Hi", "!", "<|im_end|>")  # after the prompt's last token ("\\n"): "Hi!", then the turn ends


def write_agent_model(path: str | Path, tokenizer_from: str | Path, context: int = AGENT_CONTEXT) -> Path:
    """A tiny llama with a real model's tokenizer and chat template (the bundled SmolLM2's) and a
    trained context of `context`: an agent's whole first turn fits, is computed in seconds, and the
    answer is "Hi!" and the end of the turn, by construction."""
    return write_tiny_model(
        path,
        "mistral",  # llama's architecture; the chat template is the tokenizer's model's
        shape=TinyShape(layers=2, context=context),
        name="tiny-agent",
        predicts=AGENT_ANSWER,
        tokenizer=BorrowedTokenizer.read(tokenizer_from),
    )


def write_tiny_model(
    path: str | Path,
    kind: str,
    *,
    template: str | None = None,
    shape: TinyShape | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    name: str | None = None,
    predicts: str | tuple[str, ...] | None = None,
    pieces: tuple[str, ...] = (),
    tokenizer: BorrowedTokenizer | None = None,
) -> Path:
    """A GGUF of architecture `kind` (a key of ARCHITECTURES) with random F32 weights; `template` is
    written as its chat template (none: the file has none, as many conversions ship). `predicts`: a
    token the model picks greedily after any input, or a chain of tokens (t0, t1, ..., tn): after t0
    it writes t1, after t1 t2, and so on. Its layers add nothing to the residual stream, so the
    logits are the output rows against the last token's embedding: a constant prediction gives every
    token one embedding and only the predicted token that row; a chain gives its tokens orthogonal
    embeddings and each successor's row its predecessor's (so a chain holds a token once: text it
    writes twice is spelled in other `pieces` the second time, which join the vocabulary)."""
    arch = ARCHITECTURES[kind]
    s = shape or TinyShape(layers=arch.layers)
    window = sliding_window if sliding_window is not None else arch.sliding_window
    if tokenizer is not None:
        tokens, types = tokenizer.tokens, tokenizer.types
        scores: list[float] = []  # a BPE tokenizer ranks by its merges
        template = template or tokenizer.template
    else:
        tokens, scores, types = vocabulary(arch.family, pieces)
    writer = gguf.GGUFWriter(str(path), arch.name)
    writer.add_name(name or f"tiny-{kind}")
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.embedding)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.feed_forward)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if window:
        writer.add_sliding_window(window)
    if arch.experts:
        writer.add_expert_count(arch.experts)
        writer.add_expert_used_count(EXPERTS_USED)
        writer.add_expert_feed_forward_length(s.feed_forward)
    if tokenizer is not None:
        writer.add_tokenizer_model(tokenizer.model)
        writer.add_tokenizer_pre(tokenizer.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(tokenizer.merges)
        writer.add_bos_token_id(tokenizer.bos)
        writer.add_eos_token_id(tokenizer.eos)
        writer.add_add_bos_token(False)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    if template:
        writer.add_chat_template(template)
    rng = np.random.default_rng(seed)
    embedding = rng.normal(0.0, 1.0, size=s.embedding).astype(np.float32)
    chain = [tokens.index(t) for t in predicts] if isinstance(predicts, tuple) else []
    if chain:
        # orthogonal embeddings for the chain's tokens (as many as the width allows), scaled like the rest
        basis = np.linalg.qr(rng.normal(size=(s.embedding, s.embedding)))[0].T * np.sqrt(s.embedding)
        assert len(set(chain)) <= s.embedding, "a chain longer than the embedding width"
        chain_rows = {token: basis[i].astype(np.float32) for i, token in enumerate(dict.fromkeys(chain))}

    def tensor(tensor_name: str, dims: tuple[int, ...]) -> None:
        if tensor_name.endswith("norm.weight"):
            data = np.ones(dims, dtype=np.float32)
        elif predicts is not None and tensor_name.endswith(RESIDUAL_WRITERS):
            data = np.zeros(dims, dtype=np.float32)
        elif chain and tensor_name == "token_embd.weight":
            data = rng.normal(0.0, 1.0, size=dims).astype(np.float32)
            for token, row in chain_rows.items():
                data[token] = row
        elif chain and tensor_name == "output.weight":
            data = np.zeros(dims, dtype=np.float32)
            for before, after in itertools.pairwise(chain):
                data[after] += chain_rows[before]
        elif predicts is not None and tensor_name == "token_embd.weight":
            data = np.tile(embedding, (dims[0], 1))
        elif isinstance(predicts, str) and tensor_name == "output.weight":
            data = np.zeros(dims, dtype=np.float32)
            data[tokens.index(predicts)] = embedding
        else:
            data = rng.normal(0.0, 0.02, size=dims).astype(np.float32)
        writer.add_tensor(tensor_name, data)

    tensor("token_embd.weight", (len(tokens), s.embedding))
    for layer in range(s.layers):
        for tensor_name, dims in arch.layer_tensors(s).items():
            tensor(f"blk.{layer}.{tensor_name}", dims)
    tensor("output_norm.weight", (s.embedding,))
    if not arch.tied_output or predicts is not None:
        tensor("output.weight", (len(tokens), s.embedding))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
