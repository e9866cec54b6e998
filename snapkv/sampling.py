"""Picking the next token: greedily (argmax, the default) or sampled (`Sampling`: transformers'
temperature and top-p warpers, then a draw from a generator seeded for that sample alone, never the
global RNG), so a seed gives the same tokens under every method wherever the logits agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True)
class Sampling:
    """Random sampling instead of greedy decoding: the logits `[batch, vocab]` (fp32) go through
    transformers' `TemperatureLogitsWarper(temperature)` then `TopPLogitsWarper(top_p)` (nucleus
    sampling, Holtzman et al. 2020, https://arxiv.org/abs/1904.09751; the tokens kept are those
    `model.generate(do_sample=True, temperature=..., top_p=...)` keeps), and one token per row is
    drawn by `torch.multinomial` from the sample's own `torch.Generator`.

    temperature: > 0 (1.0: the model's distribution); top_p: in (0, 1] (1.0: no nucleus cut).
    """

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise ValueError(f"temperature must be a number > 0, got temperature={t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got top_p={p!r}")

    def processors(self) -> LogitsProcessorList:
        """The warpers in transformers' order (temperature first); neutral values are left out, as
        `model.generate` leaves them out."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(float(self.top_p)))
        return procs


class TokenPicker:
    """Picks the next token from last-position logits `[batch, vocab]` -> `[batch]`: argmax without
    `sampling`; else the `Sampling` warpers and a draw from a `torch.Generator` on `device` seeded
    with `seed` (every sample its own generator: the global RNG is never touched, so other code
    drawing random numbers cannot shift a sample's tokens)."""

    def __init__(self, sampling: Sampling | None, seed: int | None, device: torch.device):
        self.check(sampling, seed)
        self.sampling = sampling
        self.processors = sampling.processors() if sampling is not None else None
        self.generator = None
        if sampling is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(int(seed))

    @staticmethod
    def check(sampling: Sampling | None, seed: int | None) -> None:
        """ValueError where a picker could not be built: sampling without a seed (a caller checks
        its seeds with it before the prompt's forwards)."""
        if sampling is not None and seed is None:
            raise ValueError("sampling needs a seed per sample, got seed=None")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sampling is None:
            return logits.argmax(-1)
        # The warpers ignore input_ids (temperature and top-p read only the scores).
        no_ids = torch.empty((logits.shape[0], 0), dtype=torch.long, device=logits.device)
        scores = self.processors(no_ids, logits.float())
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
