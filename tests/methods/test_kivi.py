"""KIVI's quantized storage against a naive transcription of the original (github.com/jy-yuan/KIVI
at 876b4d2d08e3b1d5f70d0969c299d8c7c42ddfb6): `quant_and_pack_kcache` / `quant_and_pack_vcache`
(min / max per group, scale = (max - min) / (2^bits - 1), clamp, round) read back as
`unpack_and_dequant_*` does, and the prefill / decode residual rule of `models/llama_kivi.py`
(`LlamaAttention_KIVI.forward`), written step by step with Python loops over the groups."""

from __future__ import annotations

import pytest
import torch

from snapkv import build_method, generate_ids
from snapkv.cache import CompressibleLayer
from snapkv.kv_quant import KVQuant, kivi_keys, kivi_values
from tests.conftest import random_ids, tiny_model


def naive_kcache(k: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """`quant_and_pack_kcache` then `unpack_and_dequant_kcache`: per channel, over each run of
    `group` tokens."""
    out = torch.empty_like(k)
    top = 2**bits - 1
    for g in range(k.shape[2] // group):
        data = k[:, :, g * group : (g + 1) * group, :]
        mn = data.min(dim=2, keepdim=True).values
        mx = data.max(dim=2, keepdim=True).values
        scale = (mx - mn) / top
        code = ((data - mn) / scale).clamp(0, top).round()
        out[:, :, g * group : (g + 1) * group, :] = code * scale + mn
    return out


def naive_vcache(v: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """`quant_and_pack_vcache` then `unpack_and_dequant_vcache`: per token, over each run of `group`
    channels."""
    out = torch.empty_like(v)
    top = 2**bits - 1
    for g in range(v.shape[-1] // group):
        data = v[..., g * group : (g + 1) * group]
        mn = data.min(dim=-1, keepdim=True).values
        mx = data.max(dim=-1, keepdim=True).values
        scale = (mx - mn) / top
        code = ((data - mn) / scale).clamp(0, top).round()
        out[..., g * group : (g + 1) * group] = code * scale + mn
    return out


class NaiveKIVI:
    """The cache of `LlamaAttention_KIVI.forward`: quantized and full-precision parts of keys and
    values; `visible` is what a decode step's attention reads (its new token included)."""

    def __init__(self, k, v, group: int, bits: int, residual: int):
        self.g, self.bits, self.r = group, bits, residual
        t = k.shape[2]
        if t % residual != 0:
            if t < residual:
                self.kq, self.kf = None, k
            else:
                self.kq, self.kf = k[:, :, : t - t % residual], k[:, :, t - t % residual :]
        else:
            self.kq, self.kf = k, None
        if self.kq is not None:
            self.kq = naive_kcache(self.kq, group, bits)
        if t <= residual:
            self.vq, self.vf = None, v
        else:
            self.vq, self.vf = naive_vcache(v[:, :, :-residual], group, bits), v[:, :, -residual:]

    def step(self, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        self.kf = k if self.kf is None else torch.cat([self.kf, k], dim=2)
        keys = self.kf if self.kq is None else torch.cat([self.kq, self.kf], dim=2)
        if self.kf.shape[2] == self.r:
            new = naive_kcache(self.kf, self.g, self.bits)
            self.kq = new if self.kq is None else torch.cat([self.kq, new], dim=2)
            self.kf = None
        self.vf = torch.cat([self.vf, v], dim=2)
        values = self.vf if self.vq is None else torch.cat([self.vq, self.vf], dim=2)
        if self.vf.shape[2] > self.r:
            new = naive_vcache(self.vf[:, :, :1], self.g, self.bits)
            self.vq = new if self.vq is None else torch.cat([self.vq, new], dim=2)
            self.vf = self.vf[:, :, 1:]
        return keys, values


def drive(kv_heads: int, prompt: int, steps: int, group: int, bits: int, residual: int):
    """The layer and the transcription fed the same prompt and decode tokens; yields each decode
    step's (ours, reference) keys and values."""
    g = torch.Generator().manual_seed(prompt * 31 + steps)
    shape = (2, kv_heads, prompt, 16)
    k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    layer = CompressibleLayer()
    layer.kv_quant = KVQuant(kind="kivi", bits=bits, group_size=group, residual=residual)
    layer.update(k.clone(), v.clone())
    layer.state = "ready"  # what the hooks set once the prefill is compressed
    ref = NaiveKIVI(k, v, group, bits, residual)
    for _ in range(steps):
        nk, nv = torch.randn(2, kv_heads, 1, 16, generator=g), torch.randn(2, kv_heads, 1, 16, generator=g)
        ours = layer.update(nk.clone(), nv.clone())
        yield ours, ref.step(nk, nv)


# residual 8, group 4: prompts below, at, just above the residual and several groups / residuals;
# 13 decode steps cross at least one flush of the keys' residual from every start.
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("prompt", [3, 4, 7, 8, 9, 12, 16, 21, 35])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_storage_equals_the_original(kv_heads, prompt, bits):
    for step, ((k, v), (rk, rv)) in enumerate(drive(kv_heads, prompt, 13, group=4, bits=bits, residual=8)):
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-6, msg=f"keys at decode step {step}")
        torch.testing.assert_close(v, rv, rtol=0, atol=1e-6, msg=f"values at decode step {step}")


def test_kivi_quantizes_and_its_error_shrinks_with_bits():
    """The formulas are not the identity: 2-bit codes move keys and values more than 8-bit ones."""
    x = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    for quantize in (kivi_keys, kivi_values):
        err2, err8 = ((quantize(x, bits, 4) - x).abs().mean() for bits in (2, 8))
        assert err2 > 10 * err8 > 0


def test_kivi_after_snapkv_quantizes_the_kept_entries():
    """score_then_quantize: the same entries as SnapKV without quantization are kept (the prompt is
    scored at full precision), and they are stored as KIVI's formulas quantize them."""
    model, ids = tiny_model("llama"), random_ids(60)
    method = build_method("snapkv", budget=24, window=4)
    caches = {}
    for name, quant in (("plain", None), ("kivi", KVQuant(kind="kivi", bits=2, group_size=4, residual=8))):
        generate_ids(
            model,
            ids,
            method=method,
            max_new_tokens=1,
            kv_quant=quant,
            on_compressed=lambda c, name=name: caches.__setitem__(name, c),
        )
    for (_, plain), (_, quant) in zip(
        caches["plain"].compressible_layers(), caches["kivi"].compressible_layers()
    ):
        assert torch.equal(plain.positions, quant.positions)
        assert quant.compressed and quant.stored == 24
        quant.quantize_residual()  # what the next forward would read
        assert (quant.quant_keys, quant.quant_values) == (24, 16)
        torch.testing.assert_close(quant.keys[:, :, :24], naive_kcache(plain.keys[:, :, :24], 4, 2))
        torch.testing.assert_close(quant.values[:, :, :16], naive_vcache(plain.values[:, :, :16], 4, 2))
        torch.testing.assert_close(quant.values[:, :, 16:], plain.values[:, :, 16:], rtol=0, atol=0)
