"""Choosing the draft length γ for the next step from what the last steps measured.

With per-token acceptance rate α, a step that drafts γ tokens commits on average
(1 − α^(γ+1)) / (1 − α) tokens (Leviathan et al. 2023, eq. 1), and costs γ draft
steps plus one verification of γ+1 tokens. Relative to a plain decoding step (cost 1):

    speedup(γ) = (1 − α^(γ+1)) / (1 − α)  /  (γ·c + v(γ)),   v(γ) = 1 + b·γ

where c is one draft step's cost and b the extra cost of each verified token, both as
fractions of a plain step. γ = 0 (plain decoding) has speedup 1, so the controller falls
back to plain decoding whenever no γ is predicted to beat it.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost_per_token: float) -> float:
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + 1.0 + verify_cost_per_token * gamma)


@dataclass
class DraftLengthController:
    max_gamma: int = 8
    adaptive: bool = True
    alpha: float = 0.6  # prior, then an exponential moving average of observed acceptance
    draft_cost: float = 0.0  # c: one draft step / one plain step (0 for model-free drafters)
    verify_cost_per_token: float = 0.04  # b: measured on the bundled target, 8 tokens cost 1.3×
    smoothing: float = 0.3
    probe_every: int = 8  # plain steps between probes while the guard holds γ at 0
    _plain_steps: int = 0

    def next_gamma(self, limit: int) -> int:
        """γ for the next step, at most `limit` (tokens left before max_new_tokens, minus one)."""
        top = max(0, min(self.max_gamma, limit))
        if not self.adaptive or top == 0:
            return top
        best = max(range(top + 1), key=lambda g: predicted_speedup(
            self.alpha, g, self.draft_cost, self.verify_cost_per_token))
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                return 1  # keep measuring α, or the guard could never lift
        return best

    def observe(self, drafted: int, accepted: int, draft_cost: float | None = None) -> None:
        if drafted:
            rate = accepted / drafted
            self.alpha += self.smoothing * (rate - self.alpha)
        if draft_cost is not None:
            self.draft_cost += self.smoothing * (draft_cost - self.draft_cost)

    def predicted_speedup(self, gamma: int) -> float:
        return predicted_speedup(self.alpha, gamma, self.draft_cost, self.verify_cost_per_token)
