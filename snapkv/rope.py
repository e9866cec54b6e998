"""RoPE helpers for StreamingLLM's compacted positions: re-rotating cached (post-RoPE) keys."""

from __future__ import annotations

import torch

from snapkv.cache import CompressibleLayer


def rope_inv_freq(model) -> torch.Tensor:
    """The inverse frequencies `[head_dim / 2]` of the model's one rotary embedding."""
    found = [m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if len(found) != 1:
        raise ValueError(
            f"positions='compacted' needs a model with one rotary embedding, found {len(found)} "
            "(use positions='original')"
        )
    return found[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE keys `[batch, kv_heads, n, d]` by `delta` `[batch, kv_heads, n]` positions.

    RoPE rotations compose: R(p + δ) k = R(δ) R(p) k. Rotate-half convention (Llama, Qwen, Mistral).
    """
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    k = keys.float()
    return (k * emb.cos() + _rotate_half(k) * emb.sin()).to(keys.dtype)


def compact(layer: CompressibleLayer, inv_freq: torch.Tensor) -> None:
    """StreamingLLM's compacted positions: after a `keep`, the key at stored slot i must be rotated
    at position i. Before the keep, slot j was rotated at j (compacted) or at its original position
    (first compression), so the delta is i - (old rotation position)."""
    kept_old = layer.last_kept  # [b, kv, S] indices into the pre-keep slots
    old_rot = kept_old if layer.compacted else layer.positions
    new_rot = torch.arange(layer.stored, device=kept_old.device).expand_as(kept_old)
    layer.keys = rerotate(layer.keys, new_rot - old_rot, inv_freq)
    layer.compacted = True
