"""RoPE helpers: re-rotating cached (post-RoPE) keys (StreamingLLM's compacted positions), and the
model's own rotary embedding at any positions (Expected Attention: pre-RoPE queries, future RoPE)."""

from __future__ import annotations

import inspect

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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> `(-x2, x1)` (the second half negated, first): RoPE's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move post-RoPE keys `[batch, kv_heads, n, d]` by `delta` `[batch, kv_heads, n]` positions.

    RoPE rotations compose: R(p + δ) k = R(δ) R(p) k. Rotate-half convention (Llama, Qwen, Mistral).
    """
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    k = keys.float()
    return (k * emb.cos() + rotate_half(k) * emb.sin()).to(keys.dtype)


def compact(layer: CompressibleLayer, inv_freq: torch.Tensor) -> None:
    """StreamingLLM's compacted positions: after a `keep`, the key at stored slot i must be rotated
    at position i. Before the keep, slot j was rotated at j (compacted) or at its original position
    (first compression), so the delta is i - (old rotation position)."""
    kept_old = layer.last_kept  # [b, kv, S] indices into the pre-keep slots
    old_rot = kept_old if layer.compacted else layer.positions
    new_rot = torch.arange(layer.stored, device=kept_old.device).expand_as(kept_old)
    layer.keys = rerotate(layer.keys, new_rot - old_rot, inv_freq)
    layer.compacted = True


class Rotary:
    """The model's rotary embedding (`rotary_emb`, the module that makes the `cos`, `sin` every
    attention layer applies) for its full-attention layers, callable at any positions.

    `Rotary(model)(positions)` -> `cos`, `sin` `[n, head_dim]` (fp32) at `positions` `[n]`, with the
    model's RoPE scaling (`attention_scaling` included). Models whose rotary embedding depends on
    the layer type (Gemma 3) get the full-attention one: only those layers are compressed.
    ValueError for a model without exactly one rotary embedding.
    """

    def __init__(self, model):
        found: dict[int, torch.nn.Module] = {}
        for module in model.modules():
            rotary = getattr(module, "rotary_emb", None)
            if isinstance(rotary, torch.nn.Module):
                found[id(rotary)] = rotary
        if len(found) != 1:
            raise ValueError(
                f"this method needs the model's rotary embedding (one `rotary_emb` module), found {len(found)}"
            )
        (self.module,) = found.values()
        params = inspect.signature(self.module.forward).parameters
        self.kwargs = {"layer_type": "full_attention"} if "layer_type" in params else {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, dtype=torch.float32, device=positions.device)  # only its dtype / device are read
        cos, sin = self.module(x, positions[None], **self.kwargs)
        return cos[0].float(), sin[0].float()


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE on `x` `[..., n, d]` (fp32) rotated with `cos`, `sin` `[n, d]` (rotate-half convention):
    `x = x_0 cos + rotate_half(x_0) sin` gives `x cos - rotate_half(x) sin = x_0 (cos^2 + sin^2)`,
    and `cos^2 + sin^2` is the square of the RoPE's `attention_scaling` (1 without scaling)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
