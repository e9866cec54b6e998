"""Expected Attention: "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution" (https://arxiv.org/abs/2510.00636); the authors' code is kvpress's
`ExpectedAttentionPress` (NVIDIA/kvpress, `kvpress/presses/expected_attention_press.py`, read at
8bb29b9c3078452a86d692f29123fa6c793e2b05).

Query-agnostic: no observation window. At the end of prefill, per layer and query head:

1. The pre-RoPE queries of every prompt token after the first `n_sink` are fitted by a Gaussian:
   mean `mu` and biased covariance `Sigma` (divided by the number of queries).
2. RoPE of the next `n_future_positions` positions (`L, ..., L + n - 1`), averaged into one matrix
   `R` (`R x = mean_p RoPE_p(x)`), moves the fit to where future queries will be:
   `mu' = R mu`, `Sigma' = R Sigma R^T`.
3. For a Gaussian query, `E[exp(s q.k)] = exp(s mu'.k + s^2/2 k^T Sigma' k)` (`s`: the attention
   scaling, 1/sqrt(head_dim) on Llama-like models, as the original uses). Its softmax over the
   keys after the sinks is each key's expected attention; it is averaged over the GQA group.
4. `use_vnorm`: the expected attention becomes `(a + epsilon) * ||v||_2` (the value's norm).

The first `n_sink` entries are always kept; each KV head keeps `budget` entries (sinks included);
nothing is evicted while decoding. `use_covariance=False` drops the quadratic term.

Pre-RoPE queries come from the model's own post-RoPE queries (what the attention hook sees) with
the rotation undone (`snapkv.rope.unrotate`), so every projection / QK-norm the model applies
before RoPE is included without re-projecting hidden states. The statistics are accumulated over
prefill chunks (Chan's parallel update of mean and centred second moment), so chunked prefill
selects what a single pass does. Computed in fp32 (the original: in the model's dtype).

`adakv_expected_attention` is the same score with Ada-KV head budgets (kvpress's leaderboard entry
"expected_attention" = `AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`): a layer's
`kv_heads x (budget - n_sink)` selectable entries are split across heads (`alpha`, `allocation` as
in `snapkv.methods.adakv`; default `kvpress`, the entry's own rule) on per-head storage (`layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from snapkv.headwise import HeadwiseLayer
from snapkv.methods.adakv import HEAD_ALLOCATION_CHECKS, head_budgets, keep_top_per_head, protect
from snapkv.methods.base import Method, grouped
from snapkv.methods.checks import flag, integer, number
from snapkv.methods.registry import register
from snapkv.rope import Rotary, rotate_half, unrotate

# fp32 bytes of one block of the quadratic term `[batch, heads, keys, head_dim]`.
BLOCK_BYTES = 64 * 2**20
# Queries per block of the Gaussian fit.
QUERY_BLOCK = 512


@dataclass
class QueryStats:
    """Gaussian fit of a layer's pre-RoPE queries (`layer.method_state`): `count` queries, `mean`
    `[batch, heads, d]` and centred second moment `m2` `[batch, heads, d, d]` (fp32)."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def of(cls, queries: torch.Tensor) -> QueryStats:
        """Of queries `[batch, heads, n, d]` (fp32, n >= 1)."""
        mean = queries.mean(dim=2)
        centred = queries - mean[:, :, None]
        return cls(queries.shape[2], mean, centred.transpose(-1, -2) @ centred)

    def merged(self, other: QueryStats) -> QueryStats:
        """Both sets together (Chan et al.'s pairwise update: no cancellation of large means)."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        outer = delta[..., :, None] * delta[..., None, :] * (self.count * other.count / n)
        return QueryStats(n, mean, self.m2 + other.m2 + outer)


@register
@dataclass
class ExpectedAttention(Method):
    name = "expected_attention"

    budget: int | None = 1024  # entries kept per KV head per layer, sinks included
    n_future_positions: int = 512  # future positions whose RoPE is averaged
    n_sink: int = 4  # leading entries always kept, and left out of the query statistics
    use_covariance: bool = True  # the quadratic term s^2/2 k^T Sigma k
    use_vnorm: bool = True  # (expected attention + epsilon) x ||v||_2
    epsilon: float = 0.0  # added before the value-norm rescaling
    # kvpress compresses the context alone: the template's generation prompt is never evicted.
    protect: str = field(default="generation_prompt", kw_only=True)

    # The query statistics (`layer.method_state`) are the prompt's: dropped after its compression.
    prompt_state = True

    # The model's rotary embedding (not a field: taken from the model, `post_init_from_model`).
    _rotary = None

    checks = {
        "n_sink": integer(0, rule="a non-negative integer"),
        "n_future_positions": integer(),
        "epsilon": number(0),
        "use_covariance": flag(),
        "use_vnorm": flag(),
    }

    def validate(self) -> None:
        super().validate()
        if self.budget is not None and self.n_sink >= self.budget:
            raise ValueError(f"n_sink must be < budget, got n_sink={self.n_sink}, budget={self.budget}")

    def post_init_from_model(self, model) -> None:
        self._rotary = Rotary(model)

    def protected(self) -> tuple[int, int]:
        return self.n_sink, 0

    def observe(self, layer, query: torch.Tensor, key: torch.Tensor, module) -> None:
        if layer.state == "ready":
            return  # decoding: the statistics are those of the prompt
        q = query.shape[2]
        first = max(self.n_sink - (layer.seen - q), 0)  # this chunk's queries at positions >= n_sink
        state = layer.method_state if layer.state == "prefilling" else None
        # Blocks of queries, merged like prefill chunks: a block's unrotated copy stays in cache
        # (one pass over an 8K prompt's queries costs ~3x as much on CPU).
        for start in range(layer.seen - q + first, layer.seen, QUERY_BLOCK):
            end = min(start + QUERY_BLOCK, layer.seen)
            cos, sin = self._rotary(torch.arange(start, end, device=query.device))
            block = query[:, :, start - layer.seen + q : end - layer.seen + q].float()
            stats = QueryStats.of(unrotate(block, cos, sin))
            state = stats if state is None else state.merged(stats)
        layer.method_state = state

    def compress_decode(self, layer, query: torch.Tensor, module) -> bool:
        # A scheduled step (`decode_schedule`): the query statistics are those of the window's
        # queries (kvpress' DecodingPress: the buffered hidden states), not the prompt's. An
        # override of the base class's template: the fit precedes the step's scoring and is
        # dropped after it, whether or not the step prunes.
        w = query.shape[2]
        first = max(self.n_sink - (layer.seen - w), 0)
        if first >= w:
            return False  # every window query is a sink: no statistics
        cos, sin = self._rotary(torch.arange(layer.seen - w + first, layer.seen, device=query.device))
        layer.method_state = QueryStats.of(unrotate(query[:, :, first:].float(), cos, sin))
        try:
            return super().compress_decode(layer, query, module)
        finally:
            layer.method_state = None

    def future_rotation(self, start: int, device) -> torch.Tensor:
        """`R` `[d, d]`: RoPE averaged over positions `start, ..., start + n_future_positions - 1`."""
        cos, sin = self._rotary(torch.arange(start, start + self.n_future_positions, device=device))
        c, s = cos.mean(dim=0), sin.mean(dim=0)
        eye = torch.eye(c.shape[0], device=device)
        # RoPE_p(x) = cos_p * x + sin_p * (P x) with P x = rotate_half(x), i.e. P = rotate_half(I)^T.
        return torch.diag(c) + s[:, None] * rotate_half(eye).T

    def expected_attention(self, layer, key: torch.Tensor, module) -> torch.Tensor:
        """Expected attention of each key after the sinks `[batch, kv_heads, stored - n_sink]`
        (softmax over those keys per query head, mean over the GQA group)."""
        stats = layer.method_state
        if not isinstance(stats, QueryStats):
            raise ValueError(
                f"{self.name} has no query statistics for layer {layer.index}: no prompt token after "
                f"the n_sink={self.n_sink} sinks"
            )
        rot = self.future_rotation(layer.seen, key.device)
        mean = stats.mean @ rot.T  # [b, heads, d]
        keys = key[:, :, self.n_sink :].float()  # [b, kv, n, d]
        b, kv, n, d = keys.shape
        mean = grouped(mean[:, :, None], kv)[..., 0, :]  # [b, kv, g, d]
        scale = module.scaling
        logits = scale * torch.einsum("bhgd,bhnd->bhgn", mean, keys)
        if self.use_covariance:
            cov = grouped(rot @ (stats.m2 / stats.count) @ rot.T, kv)  # [b, kv, g, d, d]
            g = cov.shape[2]
            step = max(1, BLOCK_BYTES // (4 * b * kv * g * d))
            for s in range(0, n, step):
                k = keys[:, :, s : s + step]
                quad = torch.einsum("bhnd,bhgde,bhne->bhgn", k, cov, k)
                logits[..., s : s + step] += scale * scale / 2 * quad
        return logits.softmax(dim=-1).mean(dim=2)

    def score(self, layer, query, key, module) -> torch.Tensor:
        scores = self.expected_attention(layer, key, module)
        if self.use_vnorm:
            norms = layer.values[:, :, self.n_sink :].float().norm(dim=-1)
            scores = (scores + self.epsilon) * norms
        return F.pad(scores, (self.n_sink, 0))  # the sinks are protected


@register
@dataclass
class AdaKVExpectedAttention(ExpectedAttention):
    name = "adakv_expected_attention"

    budget: int | None = (
        1024  # MEAN entries per KV head per layer (x kv_heads = the layer's total), sinks included
    )
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 1e-2  # kvpress's leaderboard entry
    alpha: float = 0.2  # floor share of each head (see snapkv.methods.adakv)
    allocation: str = "kvpress"  # kvpress (AdaKVPress, the leaderboard entry) | adakv | exact
    layout: str = "varlen"  # varlen | padded

    checks = HEAD_ALLOCATION_CHECKS

    def cache_layer(self, index: int, num_layers: int) -> HeadwiseLayer:
        return HeadwiseLayer(index=index, num_layers=num_layers, layout=self.layout)

    def prune(self, layer, scores: torch.Tensor, budget: int) -> None:
        sinks = self.n_sink
        counts = head_budgets(scores[..., sinks:], budget - sinks, self.alpha, False, self.allocation, sinks)
        keep_top_per_head(layer, protect(scores, sinks, 0), counts + sinks)
