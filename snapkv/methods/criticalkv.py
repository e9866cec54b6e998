"""CriticalKV: "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
(https://arxiv.org/abs/2502.03805), by the Ada-KV authors. Their code: `CriticalKVPress` and
`CriticalAdaKVPress` in FFY0/AdaKV-in-NVIDIA-kvpress, branch `criticalkv`,
`kvpress/presses/criticalkv_press.py`, read at 88f5b1fb245d356c4a37cc734dd47dcd817779f1 (merged
into NVIDIA/kvpress unchanged in substance).

An entry's contribution to the attention output is its attention weight times its projected value
`v W_o^h` (the head's slice of the output projection); the paper bounds the output perturbation of
an eviction by the L1 norm of that product. Selection runs in two stages per KV head, on top of a
base method's scores and budgets (`base`):

1. Stage 1 keeps the top `int(first_stage_ratio x n)` entries of the head's budget `n` by the base
   score (window included: the window's entries always rank first, as in the original where the
   window gets the maximum score).
2. Stage 2 fills the rest of the budget by `(score + epsilon) x ||v W_o^h||_1`, the L1 norm averaged
   over the query heads h of the GQA group.

`base` (one switch): `snapkv` (uniform budgets: CriticalKV over SnapKV), `pyramidkv` (PyramidKV's
layer budgets, `beta`, `schedule`, `short_prompt`), `adakv` (Ada-KV head budgets over SnapKV
scores, `alpha`, `allocation`, `normalize`, `layout` as in `snapkv.methods.adakv`: CriticalAdaKV).
The base score is SnapKV's window vote as a MEAN over the window queries (the original's scale:
`epsilon` is added to a mean attention weight; SnapKV's sum ranks the same but would shift epsilon).
Its defaults are SnapKV's here (window 32, max-pool 7, `gqa_order` reduce_first: Ada-KV's
`gqa_support` votes), so that CriticalKV differs from `snapkv` / `adakv` by its second stage alone.
The authors' `criti_snapkv` / `criti_adasnapkv` (`evaluation/evaluate.py`) wrap kvpress'
`SnapKVPress` (window 64, kernel 5, average pooling per query head, then the group mean): with
`window=64 kernel_size=5 pooling=avg gqa_order=pool_first` the base votes are those.
The original's `CriticalAdaKVPress` splits budgets with kvpress's rule (`allocation="kvpress"`,
whose safeguard also makes each head's top `int(alpha x budget)` entries part of stage 1); the
default here is Ada-KV's own (`allocation="adakv"`, as `adakv`).

`W_o` comes from the model (`post_init_from_model`: each attention layer's `o_proj`). The norm is
computed in fp32 in blocks of entries (the original: in the model's dtype, one head at a time).
Head budgets are per batch row (the original's `CriticalAdaKVPress` sums the heads' counts over
the batch). Nothing is evicted while decoding.

A selection rule around any scorer (`snapkv.methods.compose`, kvpress' `CriticalKVPress(press)`):
`scorer` (default `snapkv`) names the method whose scores are the base score, e.g.
`scorer="tova"`; its protected entries (`protected()`; SnapKV's window) rank first in stage 1 and
stay, and a scorer other than SnapKV keeps its own scale (epsilon is added to its score as it is).
`base` then only chooses the budgets (uniform, PyramidKV's layer pyramid, Ada-KV's head split).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from snapkv.cache import CompressibleLayer
from snapkv.headwise import HeadwiseLayer
from snapkv.methods.adakv import (
    HEAD_ALLOCATION_CHECKS,
    NORMALIZE,
    head_budgets,
    keep_top_per_head,
    protect,
)
from snapkv.methods.checks import number, one_of
from snapkv.methods.pyramidkv import LayerBudgets
from snapkv.methods.registry import register
from snapkv.methods.snapkv import SnapKV

CRITICAL_BASES = ("snapkv", "pyramidkv", "adakv")
# fp32 bytes of one block of projected values `[batch, heads, entries, hidden]`: on CPU a block
# that stays in cache, elsewhere one large enough to keep the device busy.
CPU_BLOCK_BYTES = 2**20
BLOCK_BYTES = 64 * 2**20
MIN_BLOCK_ENTRIES = 16


def output_projections(model, method: str = "criticalkv") -> dict[int, torch.Tensor]:
    """Each attention layer's output projection weight `[hidden, heads * head_dim]` by layer index
    (the modules with a `layer_idx` and an `o_proj` linear layer). ValueError (naming `method`) if
    there are none."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        idx, proj = getattr(module, "layer_idx", None), getattr(module, "o_proj", None)
        if isinstance(idx, int) and isinstance(proj, torch.nn.Linear):
            if idx in found and found[idx] is not proj.weight:
                raise ValueError(f"two attention modules with layer_idx={idx} have an o_proj")
            found[idx] = proj.weight
    if not found:
        raise ValueError(
            f"{method} needs each attention layer's output projection (`o_proj`); "
            f"{type(model).__name__} has none"
        )
    return found


def head_projections(values: torch.Tensor, out_proj: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """`v W_o^h` for every entry and query head, in blocks of entries: yields `(start, proj)` with
    proj `[batch, kv_heads, m, group, hidden]` (fp32) for entries `start .. start + m - 1`.

    values `[batch, kv_heads, n, head_dim]`; out_proj the layer's `o_proj` weight
    `[hidden, heads * head_dim]` (the output is `o_proj(concat_h out_h)`, so head h's slice is
    `W_o^h = out_proj[:, h*d:(h+1)*d]^T`; query head h belongs to KV head `h // group`). On CPU the
    blocks are small enough to stay in cache while the caller reduces them (a 64 MiB block costs
    ~3x the time: the reduction then reads it back from memory)."""
    b, kv, n, d = values.shape
    hidden, heads = out_proj.shape[0], out_proj.shape[1] // d
    g = heads // kv
    # [kv, d, group * hidden]: one matmul per block gives every head of the group side by side.
    w = out_proj.to(values.device, torch.float32).view(hidden, kv, g, d).permute(1, 3, 2, 0)
    w = w.reshape(kv, d, g * hidden)
    block = CPU_BLOCK_BYTES if values.device.type == "cpu" else BLOCK_BYTES
    step = max(MIN_BLOCK_ENTRIES, block // (4 * b * heads * hidden))
    for s in range(0, n, step):
        proj = torch.matmul(values[:, :, s : s + step].float(), w)  # [b, kv, m, g * hidden]
        yield s, proj.view(b, kv, proj.shape[2], g, hidden)


def projected_value_norms(values: torch.Tensor, out_proj: torch.Tensor) -> torch.Tensor:
    """`||v W_o^h||_1` per entry, averaged over the query heads h of each GQA group.

    values `[batch, kv_heads, n, head_dim]`; out_proj the layer's `o_proj` weight
    `[hidden, heads * head_dim]` (`head_projections`). Returns `[batch, kv_heads, n]` (fp32)."""
    b, kv, n, _ = values.shape
    out = torch.empty(b, kv, n, dtype=torch.float32, device=values.device)
    for s, proj in head_projections(values, out_proj):
        out[..., s : s + proj.shape[2]] = torch.linalg.vector_norm(proj, ord=1, dim=-1).mean(dim=-1)
    return out


@register
@dataclass
class CriticalKV(LayerBudgets):
    name = "criticalkv"

    budget: int | None = 1024  # entries per KV head per layer, window included (pyramidkv / adakv: the mean)
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    gqa_order: str = "reduce_first"  # reduce_first | pool_first
    beta: float = 20  # base=pyramidkv only
    schedule: str = "exact"  # base=pyramidkv only: exact | floor
    short_prompt: str = "uniform"  # base=pyramidkv only: uniform (KVCache-Factory) | clip
    base: str = "snapkv"  # snapkv | pyramidkv | adakv: the budgets the two stages fill (layers, heads)
    alpha: float = 0.2  # base=adakv only: floor share of each head
    allocation: str = "adakv"  # base=adakv only: adakv | exact | kvpress (CriticalAdaKVPress's)
    normalize: bool | str = False  # base=adakv only: False | True | "sum"
    layout: str = "varlen"  # base=adakv only: varlen | padded
    first_stage_ratio: float = 0.5  # share of each head's budget chosen by the base score alone
    epsilon: float = 1e-4  # stage 2 ranks by (score + epsilon) x ||v W_o||_1

    # Each layer's output projection weight (not a field: taken from the model).
    _out_proj = None

    checks = {
        "base": one_of(CRITICAL_BASES),
        **HEAD_ALLOCATION_CHECKS,
        "normalize": one_of(NORMALIZE),
        "first_stage_ratio": number(0, 1),
        "epsilon": number(0),
    }

    @property
    def pyramid(self) -> bool:
        return self.base == "pyramidkv"

    def post_init_from_model(self, model) -> None:
        super().post_init_from_model(model)
        self._out_proj = output_projections(model)

    def cache_layer(self, index: int, num_layers: int) -> CompressibleLayer:
        if self.base == "adakv":
            return HeadwiseLayer(index=index, num_layers=num_layers, layout=self.layout)
        return CompressibleLayer(index=index, num_layers=num_layers)

    def prune(self, layer, scores: torch.Tensor, budget: int) -> None:
        if self._out_proj is None or layer.index not in self._out_proj:
            raise ValueError(
                f"criticalkv has no output projection for layer {layer.index}: it runs inside "
                "snapkv.generate / snapkv.apply (post_init_from_model)"
            )
        length = scores.shape[-1]
        b, kv = scores.shape[:2]
        first_kept, last_kept = self.protected()
        kept = first_kept + last_kept
        if isinstance(self.scorer_method, SnapKV):
            base = scores / self.window  # SnapKV's summed votes -> the window mean (the original's scale)
        else:
            base = scores  # the scorer's own scale: epsilon is added to it
        if self.base == "adakv":
            selectable = base[..., first_kept : length - last_kept]
            counts = head_budgets(
                selectable, budget - kept, self.alpha, self.normalize, self.allocation, kept
            )
            counts = counts + kept
        else:
            counts = torch.full((b, kv), budget, dtype=torch.long, device=scores.device)
        # Stage 1: per head, its top int(ratio x n) entries by the base score (the protected first).
        first = (counts.double() * self.first_stage_ratio).floor().long()
        if self.base == "adakv" and self.allocation == "kvpress":
            # The original's safeguard: each head's top int(alpha x budget) entries are in already.
            first = first.clamp(min=int(budget * self.alpha))
        ranked = protect(base, first_kept, last_kept).sort(dim=-1, descending=True, stable=True).indices
        stage1 = torch.arange(length, device=scores.device) < first[..., None]  # [b, kv, L] by rank
        chosen = torch.zeros_like(stage1).scatter_(-1, ranked, stage1)
        # Stage 2: the rest by (score + epsilon) x ||v W_o||_1; stage 1's entries and the protected stay.
        norms = projected_value_norms(layer.values, self._out_proj[layer.index])
        final = ((base.float() + self.epsilon) * norms).masked_fill(chosen, math.inf)
        final = protect(final, first_kept, last_kept)
        if self.base == "adakv":
            keep_top_per_head(layer, final, counts)
        else:
            layer.keep(self.select(final, budget))
