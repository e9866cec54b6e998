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
  authors' needle / passkey generation): True re-prunes after every decoding step (the authors'
  language-modelling loops, which call `l2_compress` after every forward).
- `keep_ratio` (default None: keep `budget` entries, an entry count like every method's): r in
  (0, 1] keeps `ceil(r * n)` of the n entries a pruned layer holds, each time it is pruned:
  `l2_compress`'s own rule, `budget` then unused.

With a prompt of L tokens pruned once, `budget = ceil(r * L)` (authors) or `floor(r * L)`
(kvpress' `int`) gives the originals' ratio r. The authors' loop (`evict_during_decode`,
`prune_after = P`) prunes to `ceil(r * n)` after every forward that leaves n >= P entries. A fixed
`budget = ceil(r * P)` reproduces it only for prompts of at most P tokens, and only when that
budget is below P (the cache grows to P and drops back to it). A longer prompt is pruned to
`ceil(r * L)` and then shrinks step by step, and may settle above `ceil(r * P)` for good (r = 0.9,
P = 10: 13 entries are pruned to 12 at every step), keeping other entries than a fixed budget
would: `keep_ratio = r` is the authors' rule itself, on every prompt.

Ties (equal norms) go to the earlier position, as the base class's stable top-k does for every
method; the originals' `argsort` (authors) and `topk` (kvpress) leave the choice unspecified. They
arise at layer 0, where the keys of a token that occurs more than once differ only by their RoPE
rotation, which keeps the norm: equal up to rounding, and exactly equal where the rounding agrees,
so which copy is kept can differ from the originals' by such entries. Norms are fp32 (the authors'
`torch.norm` in the model's dtype); kept entries are stored in position order (the authors' in norm
order, kvpress' in top-k order; attention does not depend on the order).
"""

from __future__ import annotations

import math
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
    keep_ratio: float | None = None  # r: keep ceil(r x entries) instead of `budget` (l2_compress)
    # kvpress compresses the context alone: the template's generation prompt is never evicted.
    protect: str = field(default="generation_prompt", kw_only=True)

    left_out_at_default = ("keep_ratio",)  # off: configs from before the switch keep their hashes

    checks = {
        "budget": integer(needed=True),
        "skip_layers": Check("a list of layer indices >= 0", types=(int,), low=0, each=True),
        "prune_after": integer(0),
        "evict_during_decode": flag(),
        "keep_ratio": Check(
            "null or a number in (0, 1]", types=(int, float), low=0, high=1, low_open=True, none=True
        ),
    }

    def validate(self) -> None:
        super().validate()
        self.skip_layers = list(self.skip_layers)  # one type in params() and result rows

    def post_init_from_model(self, model) -> None:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        bad = [i for i in self.skip_layers if i >= n]
        if bad:
            raise ValueError(f"skip_layers names layers the model does not have (it has {n}), got {bad}")

    def layer_budget(self, layer) -> int | None:
        if layer.index in self.skip_layers or layer.stored < self.prune_after:
            return None
        if self.keep_ratio is not None:
            # l2_compress's `ceil(keep_ratio * keys.size(2))`, on what the layer holds now.
            return math.ceil(self.keep_ratio * layer.stored)
        return self.budget

    def score(self, layer, query, key, module) -> torch.Tensor:
        return -key.float().norm(dim=-1)  # [b, kv, n]: the smallest norms score highest

    def decode_score(self, layer) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)
