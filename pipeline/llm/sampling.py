"""Sampling and the speculative acceptance rule, as pure tensor functions.

Notation follows Leviathan, Kalman & Matias, "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023, arXiv 2211.17192) and Chen et al., "Accelerating
Large Language Model Decoding with Speculative Sampling" (arXiv 2302.01318):
p is the target's distribution, q the drafter's, x_i the i-th drafted token.

- accepted tokens: the longest prefix of the draft that passes the test;
- recovered token: drawn from the residual norm(max(0, p − q)) where a draft token
  is rejected (Leviathan et al. Algorithm 1; Chen et al. eq. 1);
- bonus token: drawn from p after the last position when every draft token passed.

A drafter without a distribution (n-gram, suffix) is a point mass: q(x_i) = 1, so x_i
is accepted with probability p(x_i) and the residual is p with x_i removed. One verifier
serves every drafter. Greedy decoding is the temperature → 0 limit: accept while
x_i = argmax p, then take argmax p as the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (CTRL, Keskar et al. 2019)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> SamplingOptions:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid sampling options: {self}")
        return self


def apply_repetition_penalty(
    logits: torch.Tensor, context: Sequence[int], draft: Sequence[int], penalty: float
) -> torch.Tensor:
    """Penalise tokens already present; row i of logits [k+1, V] also sees draft[:i]."""
    if penalty == 1.0:
        return logits
    out = logits.clone()
    seen = list(context)
    for i in range(out.shape[0]):
        ids = torch.tensor(sorted(set(seen)), device=out.device, dtype=torch.long)
        if ids.numel():
            row = out[i, ids]
            out[i, ids] = torch.where(row > 0, row / penalty, row * penalty)
        if i < len(draft):
            seen.append(draft[i])
    return out


def logits_to_probs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax; rows are positions [.., V]."""
    logits = logits / options.temperature
    if options.top_k:
        kth = torch.topk(logits, min(options.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= options.top_p  # keep the first over p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits.float() if logits.dtype == torch.float16 else logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_verify(draft: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): accept while x_i = argmax p_i. target_logits [k+1, V]."""
    choices = torch.argmax(target_logits, dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n, int(choices[n])


def speculative_verify(
    draft: Sequence[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted count, next token) by the speculative sampling rule.

    p [k+1, V]: target probabilities at each draft position and one past it.
    q [k, V] the drafter's, or None for a point-mass drafter (q(x_i) = 1).
    """
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        r = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        # Accept with probability min(1, p/q); q_x > 0 always holds for a token the drafter drew.
        if float(r) * q_x < float(p[i, x]):
            continue
        return i, sample(_residual(p[i], q[i] if q is not None else None, x), generator)
    return len(draft), sample(p[len(draft)], generator)


def _residual(p_i: torch.Tensor, q_i: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(0, p − q)); for a point mass q = one-hot(x)."""
    if q_i is None:
        residual = p_i.clone()
        residual[x] = 0.0
    else:
        residual = torch.clamp(p_i - q_i, min=0.0)
    total = residual.sum()
    # p ≤ q everywhere only if p = q (both sum to 1); then any draw from p is exact.
    return residual / total if total > 0 else p_i
