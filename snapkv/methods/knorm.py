"""K-norm: "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(https://arxiv.org/abs/2406.11430).

Keys with a LOW L2 norm draw high attention, so each KV head keeps the `budget` entries whose keys
have the smallest norm (fp32 norms of the cached, post-RoPE keys). Attention-free: no query, no
attention weight is needed, so it runs beside any attention implementation (sdpa, flash, eager)
without materialising a score. Models that normalise their keys (QK-norm: Gemma 3, Qwen3, OLMo 2)
give every key the norm its `k_norm` weights allow for its direction; at init weights (random test
models) every key's norm is sqrt(head_dim) up to rounding, and the ranking is noise.

Ported from the authors' code (alessiodevoto/l2compress @ f93d6ca2702d85a2db97d2ef350b44d955609761,
`cache.py`, `l2_compress`: per layer and head, argsort of the key norms, keep the first
`ceil(keep_ratio * length)`; layers in `skip_layers` and caches shorter than `prune_after` are left
alone) and kvpress' `KnormPress` (NVIDIA/kvpress @ 8bb29b9c3078452a86d692f29123fa6c793e2b05:
`-keys.norm()`, every layer, once after the prompt). Where they differ, a switch:

- `skip_layers` (default `[]`, kvpress: every layer compressed, so the budget means what it means
  for the other methods): model layer indices left uncompressed; the authors' scripts use `[0]`
  (`eval_needle.py`, `eval_passkey.py`, `eval_lm.py`) or `[0, 1]` (`eval_lm_quick.py`, README).
- `prune_after` (default 0): a layer holding fewer entries is not pruned (`l2_compress` default
  2048; the scripts 0, 10 or 1000).
- `evict_during_decode` (default False: prune once at the end of prefill, as kvpress and the
  authors' needle / passkey generation): True re-prunes after every decoding step back to the
  budget (the authors' language-modelling loop, which calls `l2_compress` after every token).

The budget is an entry count, so the originals' rounding of a keep ratio (`ceil` in the authors'
code, `int` = floor in kvpress) does not arise: their ratio r on a prompt of L tokens is
`budget = ceil(r * L)` (authors) or `floor(r * L)` (kvpress). With `evict_during_decode` and
`prune_after = P`, a budget of `ceil(r * P)` reproduces the authors' loop once the cache reaches P.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from snapkv.methods.base import Method
from snapkv.methods.checks import Check, flag, integer
from snapkv.methods.registry import register


@register
@dataclass
class KNorm(Method):
    name = "knorm"

    budget: int | None = 1024  # entries kept per KV head per layer
    skip_layers: list[int] = field(default_factory=list)  # model layers never pruned (authors: [0] or [0, 1])
    prune_after: int = 0  # layers holding fewer entries are not pruned (l2_compress: 2048)
    evict_during_decode: bool = False  # True: re-prune after every decoding step (authors' LM loop)
    # kvpress compresses the context alone: the template's generation prompt is never evicted.
    protect: str = field(default="generation_prompt", kw_only=True)

    checks = {
        "budget": integer(needed=True),
        "skip_layers": Check("a list of layer indices >= 0", types=(int,), low=0, each=True),
        "prune_after": integer(0),
        "evict_during_decode": flag(),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        self.skip_layers = list(self.skip_layers)  # one type in params() and result rows

    def post_init_from_model(self, model) -> None:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        bad = [i for i in self.skip_layers if i >= n]
        if bad:
            raise ValueError(f"skip_layers names layers the model does not have (it has {n}), got {bad}")

    def layer_budget(self, layer) -> int | None:
        if layer.index in self.skip_layers or layer.stored < self.prune_after:
            return None
        return self.budget

    def score(self, layer, query, key, module) -> torch.Tensor:
        return -key.float().norm(dim=-1)  # [b, kv, n]: the smallest norms score highest

    def decode_score(self, layer) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)
