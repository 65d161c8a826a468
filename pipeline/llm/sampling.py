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

Where the random numbers come from. A draw from a distribution is the inverse transform
of one uniform (`sample`). Seeded sampling gives every output position its own generator
(`PositionalRandom`): token n of a reply takes its uniforms from a generator seeded with
a mix of (seed, n), whatever steps, drafts or restarts came before it, so the draw at
position n depends on the seed, n and the context only. For a point-mass draft the
acceptance test and the residual draw share that position's one uniform u: the target's
own draw y = F⁻¹_p(u) is taken, and the draft x is accepted exactly when y = x, which
happens with probability p(x) = min(1, p(x)/q(x)), and a rejection leaves y distributed
as p conditioned on y ≠ x, the residual. It is the same rule, and the committed token is
y whichever point-mass drafter (or none) proposed: a seeded reply is the same with the
none, n-gram and suffix drafters. (With a drafter that has a distribution the rule keeps
its usual form, a uniform r against p/q, then a residual draw; the token still depends on
the drafter's q and x, as it must for the acceptance rate to stay optimal.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.llm.options import SamplingOptions

MASK64 = (1 << 64) - 1
TARGET_STREAM, DRAFT_STREAM = 0, 1  # a position's draws by the verifier, and by a model drafter


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


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea & Flood 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int, stream: int = TARGET_STREAM) -> int:
    """The seed of output position `position`'s generator in `stream`: a counter-based
    derivation, so position n's state needs nothing but (seed, n), not the draws before it."""
    return _splitmix64(_splitmix64(_splitmix64(seed & MASK64) ^ (position & MASK64)) ^ stream)


class PositionalRandom:
    """Seeded sampling's random state: one generator per output position and stream.

    Position n counts the reply's tokens from 0 (tokens resumed from a log included), so the
    uniforms that decide token n (its acceptance test and its residual or plain draw, and a
    model drafter's draw of the draft token at n) are the same however many verification
    passes came before, whatever drafter ran, and wherever a resume happened.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self._streams = {stream: torch.Generator(device=device) for stream in (TARGET_STREAM, DRAFT_STREAM)}

    def at(self, position: int, stream: int = TARGET_STREAM) -> torch.Generator:
        """Position `position`'s generator, freshly seeded: use it before asking for another
        position of the same stream (the generator object is reused)."""
        return self._streams[stream].manual_seed(position_seed(self.seed, position, stream))


# A generator for every draft position i (0..γ), or one generator (or None: torch's global one) for all.
RandomSource = torch.Generator | Callable[[int], torch.Generator | None] | None


def generator_at(source: RandomSource, i: int) -> torch.Generator | None:
    return source if source is None or isinstance(source, torch.Generator) else source(i)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from `probs` [V] by inverse transform of one uniform u from `generator`: the first
    token whose cumulative probability exceeds u · Σp (a zero-probability token is never drawn)."""
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(0)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token >= probs.shape[0]:  # u · Σp rounded up to Σp: the last token that can be drawn
        token = int(torch.nonzero(probs).max())
    return token


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, the first index of the maximum as torch.argmax gives it (NaN
    first too), through torch.max, which is 3× faster on a CPU: a row of 49,152 logits took 67 µs with
    argmax and 21 µs with max (torch 2.13, 2026-12-05), which had been 0.66 ms of a ~7 ms verification."""
    return logits.max(dim=-1).indices


def greedy_verify(draft: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): accept while x_i = argmax p_i. target_logits [k+1, V]."""
    choices = greedy_tokens(target_logits).tolist()
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n, int(choices[n])


def speculative_verify(
    draft: Sequence[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: RandomSource,
) -> tuple[int, int]:
    """(accepted count, next token) by the speculative sampling rule.

    p [k+1, V]: target probabilities at each draft position and one past it.
    q [len(draft), V] the drafter's, or None for a point-mass drafter (q(x_i) = 1).
    `draft` holds k tokens, or k + 1: then the last one is a draft for the position past the
    verified ones, tested against p there like any other (accepted, it is the next token)
    instead of a plain draw from p; seeded sampling with a model drafter drafts every
    position so, which keeps a position's token independent of where a step ended.
    `generator`: one per position (a callable of the draft index i), or one for all.
    """
    if len(draft) > p.shape[0]:
        raise ValueError(f"{len(draft)} draft tokens for {p.shape[0]} target positions")
    for i, x in enumerate(draft):
        g = generator_at(generator, i)
        if q is None:  # one uniform: the target's own draw, which is x with probability p(x)
            token = sample(p[i], g)
            if token != x:
                return i, token
        else:
            q_x = float(q[i, x])
            r = torch.rand((), generator=g, dtype=torch.float64, device=p.device)
            # Accept with probability min(1, p/q); q_x > 0 always holds for a token the drafter drew.
            if float(r) * q_x >= float(p[i, x]):
                return i, sample(_residual(p[i], q[i], x), g)
        if i == p.shape[0] - 1:  # the draft for the position past the verified ones passed
            return i, x
    return len(draft), sample(p[len(draft)], generator_at(generator, len(draft)))


def _residual(p_i: torch.Tensor, q_i: torch.Tensor, x: int) -> torch.Tensor:
    """norm(max(0, p − q)) (a point mass needs none: see `speculative_verify`)."""
    residual = torch.clamp(p_i - q_i, min=0.0)
    total = residual.sum()
    # p ≤ q everywhere only if p = q (both sum to 1); then any draw from p is exact.
    return residual / total if total > 0 else p_i
