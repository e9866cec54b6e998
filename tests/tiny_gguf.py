"""A tiny random Llama as a GGUF file that OpenVINO GenAI and transformers both load, with a tiny
byte-level BPE tokenizer of its own in the file's metadata (vocabulary, merges, special tokens,
ChatML template): built in code, nothing cached or downloaded, so text round-trips through the
harness' tokenizer and the engine reads the same file.

`gguf_tokenizer(tokenizer)` writes any `PreTrainedTokenizerFast` byte-level BPE (conftest's
`byte_level_bpe`) as llama.cpp's `tokenizer.ggml.*` keys; `tiny_tokenizer()` is the one the engine
tests use; `toy_tokenizer()` a made-up vocabulary for files that tokenize no text."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from conftest import CHATML, byte_level_bpe
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize

from eval.engines.gguf_files import copy_metadata, write_gguf
from eval.tasks import haystack as hs

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
# SmolLM2's special tokens, ids 0-2 as in its vocabulary; <|im_end|> ends a turn and is the EOS.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# llama.cpp's token types (gguf.TokenType): NORMAL, CONTROL.
NORMAL, CONTROL = 1, 3


@functools.cache
def tiny_tokenizer(vocab: int = 1024):
    """A byte-level BPE trained on the needle task's noise haystack and digits (any text encodes:
    the 256 byte tokens are in the vocabulary), with SmolLM2's special tokens and ChatML."""
    corpus = [hs.NOISE_TEXT] * 20 + ["What is the magic number? The magic number is 0123456789. " * 5]
    return byte_level_bpe(corpus, vocab, SPECIAL, eos="<|im_end|>", chat_template=CHATML)


def gguf_tokenizer(tokenizer) -> dict:
    """`tokenizer` (a byte-level BPE `PreTrainedTokenizerFast`) as GGUF metadata, `copy_metadata`'s
    dict: model `gpt2` (byte-level BPE; the pre-tokenizer `gpt2`, GPT-2's split regex, as the
    tokenizer's `ByteLevel` splits), its tokens by id, merges in rank order, special tokens as
    CONTROL, SmolLM2's special ids (BOS <|im_start|>, EOS and padding <|im_end|>, no BOS added) and
    its chat template."""
    strings, i32, u32, b = GGUFValueType.STRING, GGUFValueType.INT32, GGUFValueType.UINT32, GGUFValueType.BOOL
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("the tokenizer's ids are not 0..n-1")
    special = set(tokenizer.all_special_tokens) | set(SPECIAL)
    # tokenizers writes a merge as a pair (newer releases) or as "a b" (older ones).
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    meta = {
        "tokenizer.ggml.model": ("gpt2", strings, None),
        "tokenizer.ggml.pre": ("gpt2", strings, None),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, strings),
        "tokenizer.ggml.token_type": (
            [CONTROL if t in special else NORMAL for t in tokens], GGUFValueType.ARRAY, i32,
        ),
        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY, strings),
        "tokenizer.ggml.bos_token_id": (vocab["<|im_start|>"], u32, None),
        "tokenizer.ggml.eos_token_id": (vocab["<|im_end|>"], u32, None),
        "tokenizer.ggml.unknown_token_id": (vocab["<|endoftext|>"], u32, None),
        "tokenizer.ggml.padding_token_id": (vocab["<|im_end|>"], u32, None),
        "tokenizer.ggml.add_bos_token": (False, b, None),
        "tokenizer.ggml.add_space_prefix": (False, b, None),
    }  # fmt: skip
    if tokenizer.chat_template:
        meta["tokenizer.chat_template"] = (tokenizer.chat_template, strings, None)
    return meta


def toy_tokenizer(vocab: int = 512) -> dict:
    """Tokenizer metadata of a made-up vocabulary (for files no tokenizer is built from)."""
    strings, i32 = GGUFValueType.STRING, GGUFValueType.INT32
    return {
        "tokenizer.ggml.model": ("gpt2", strings, None),
        "tokenizer.ggml.tokens": ([f"<t{i}>" for i in range(vocab)], GGUFValueType.ARRAY, strings),
        "tokenizer.ggml.token_type": ([1] * vocab, GGUFValueType.ARRAY, i32),
        "tokenizer.ggml.merges": (["<t1> <t2>"], GGUFValueType.ARRAY, strings),
    }


def tiny_llama_gguf(
    path: str | Path, tokenizer: dict, qtype: GGMLQuantizationType = GGMLQuantizationType.F16, seed: int = 0
) -> Path:
    """A 2-layer random Llama GGUF (GQA 4/2, hidden 64) with the `tokenizer` metadata
    (`gguf_tokenizer`'s or `toy_tokenizer`'s), its vocabulary the tokenizer's. Weights are drawn
    large enough that attention is far from uniform (a budget then changes the output); the layers'
    matrices are stored as `qtype`."""
    vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(seed)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    arch = {
        "block_count": (LAYERS, u32), "context_length": (4096, u32), "embedding_length": (HIDDEN, u32),
        "feed_forward_length": (FFN, u32), "attention.head_count": (HEADS, u32),
        "attention.head_count_kv": (KV_HEADS, u32), "rope.freq_base": (10000.0, f32),
        "attention.layer_norm_rms_epsilon": (1e-5, f32), "vocab_size": (vocab, u32),
        "rope.dimension_count": (HIDDEN // HEADS, u32),
    }  # fmt: skip

    def matrix(name, rows, cols, scale):
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == GGMLQuantizationType.F16 or not name.startswith("blk."):
            return w.astype(np.float16), None
        return quantize(w, qtype), qtype

    def fill(writer):
        copy_metadata(
            tokenizer, writer, **{f"llama.{k}": v for k, v in arch.items()}, **{"general.file_type": (1, u32)}
        )
        hd = HIDDEN // HEADS
        shapes = {"token_embd": (vocab, HIDDEN, 1.0), "output": (vocab, HIDDEN, 0.5)}
        for i in range(LAYERS):
            shapes |= {
                f"blk.{i}.attn_q": (HEADS * hd, HIDDEN, 0.3), f"blk.{i}.attn_k": (KV_HEADS * hd, HIDDEN, 0.3),
                f"blk.{i}.attn_v": (KV_HEADS * hd, HIDDEN, 0.3), f"blk.{i}.attn_output": (HIDDEN, HEADS * hd, 0.3),
                f"blk.{i}.ffn_gate": (FFN, HIDDEN, 0.3), f"blk.{i}.ffn_up": (FFN, HIDDEN, 0.3),
                f"blk.{i}.ffn_down": (HIDDEN, FFN, 0.3),
            }  # fmt: skip
        for name, (rows, cols, scale) in shapes.items():
            data, raw = matrix(name, rows, cols, scale)
            writer.add_tensor(f"{name}.weight", data, raw_dtype=raw)
        writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
        for i in range(LAYERS):
            writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
            writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))

    return write_gguf(path, "llama", fill)


def tiny_text_gguf(path: str | Path, seed: int = 0) -> Path:
    """`tiny_llama_gguf` with `tiny_tokenizer`'s metadata: a model file a run can name alone."""
    return tiny_llama_gguf(path, gguf_tokenizer(tiny_tokenizer()), seed=seed)
