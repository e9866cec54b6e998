"""Tiny random models (Llama / Qwen2 / Mistral with GQA / Gemma 3 hybrid), built in code: offline,
milliseconds per forward. `SHARED` is ../shared beside the checkout (tests may read it)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Idle OpenMP workers that sleep cost a scheduler tick per wake-up on these VMs (see
# scripts/bench_speed.py); must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, layers: int = 3):
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=layers, **COMMON)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=layers, **COMMON)
    if arch == "mistral":  # sliding_window=None as in Mistral-7B-Instruct-v0.2: full attention
        return MistralConfig(num_hidden_layers=layers, sliding_window=None, **COMMON)
    if arch == "gemma3":  # hybrid: 5 sliding layers per full one; only the full layers compress
        return Gemma3TextConfig(num_hidden_layers=6, sliding_window=16, head_dim=16, **COMMON)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", attn: str = "sdpa", layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(arch, layers)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def random_ids(n: int, batch: int = 1, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g)
