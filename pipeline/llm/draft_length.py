"""Choosing the draft length γ for the next step from what the last steps measured.

With per-token acceptance rate α, a step that drafts γ tokens commits on average
(1 − α^(γ+1)) / (1 − α) tokens (Leviathan et al. 2023, eq. 1), and costs γ draft
steps plus one verification of γ+1 tokens. Relative to a plain decoding step (cost 1):

    speedup(γ) = (1 − α^(γ+1)) / (1 − α)  /  (γ·c + v(γ)),   v(γ) = 1 + b·γ

where c is one draft step's cost and b the extra cost of each verified token, both as
fractions of a plain step. γ = 0 (plain decoding) has speedup 1, so the controller falls
back to plain decoding whenever no γ is predicted to beat it.

b is measured on the running model (`VerifyCost`): on a memory-bound machine it is a
few percent, on a compute-bound or contended one it is several times larger, and the
best γ follows it.

Model-free drafters (n-gram lookup, suffix memory) cost nothing to draft (c = 0) and
their acceptance is not geometric: a continuation copied from an earlier match is
usually right or wrong as a whole, and a longer match is more often right. For them
`MatchAcceptance` keeps, per matched-suffix length, the conditional acceptance of each
draft position, and the step verifies the prefix of the proposal that maximises
expected tokens over cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MATCH_BUCKETS = 4  # matched-suffix lengths 1, 2, 3 and 4 or more are told apart


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost_per_token: float) -> float:
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + 1.0 + verify_cost_per_token * gamma)


@dataclass
class VerifyCost:
    """b: the extra cost of each verified token beyond the first, as a fraction of one plain step.

    A least-squares line t = t0 + t1·(n − 1) through (tokens in the pass, seconds), with
    exponential forgetting so it follows the machine's load; b = t1 / t0.
    """

    prior: float = 0.04  # measured on the bundled target on a quiet 2-core CPU: 8 tokens cost 1.3×
    forget: float = 0.98
    frozen: bool = False  # keep the prior: γ must not depend on timing (seeded sampling)
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if self.frozen:
            return
        x = tokens - 1.0
        f = self.forget
        self._w = f * self._w + 1.0
        self._x = f * self._x + x
        self._y = f * self._y + seconds
        self._xx = f * self._xx + x * x
        self._xy = f * self._xy + x * seconds

    @property
    def per_token(self) -> float:
        spread = self._w * self._xx - self._x * self._x
        if self._w < 8 or spread <= 1e-9 * max(1.0, self._w * self._xx):
            return self.prior  # too few passes, or all of one size: the slope is unknown
        t1 = (self._w * self._xy - self._x * self._y) / spread
        t0 = (self._y - t1 * self._x) / self._w
        if t0 <= 0:
            return self.prior
        return min(1.0, max(0.0, t1 / t0))


@dataclass
class MatchAcceptance:
    """Conditional acceptance of draft position j given positions < j passed, per matched-suffix length.

    Counts start from a prior: an even chance for the first token, and a continuation that
    usually holds once it has started (copied text is right or wrong as a whole).
    """

    max_gamma: int = 8
    first_prior: tuple[float, float] = (1.0, 1.0)  # (passed, failed) pseudo-counts at position 1
    later_prior: tuple[float, float] = (4.0, 1.0)  # and at later positions
    tried: list[list[float]] = field(default_factory=list)
    passed: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tried = [[0.0] * self.max_gamma for _ in range(MATCH_BUCKETS)]
        self.passed = [[0.0] * self.max_gamma for _ in range(MATCH_BUCKETS)]

    def best_gamma(self, match: int, proposed: int, verify_cost_per_token: float) -> tuple[int, float]:
        """(γ, predicted speedup) over the proposal's prefixes; γ = 0 when verifying none pays best."""
        bucket = _bucket(match)
        best, best_speedup, expected, survive = 0, 1.0, 1.0, 1.0
        for j in range(min(proposed, self.max_gamma)):
            survive *= self._conditional(bucket, j)
            expected += survive
            speedup = expected / (1.0 + verify_cost_per_token * (j + 1))
            if speedup > best_speedup:
                best, best_speedup = j + 1, speedup
        return best, best_speedup

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        """Positions 1..accepted passed and position accepted+1 (if drafted) failed."""
        bucket = _bucket(match)
        for j in range(min(drafted, accepted + 1, self.max_gamma)):
            self.tried[bucket][j] += 1.0
            self.passed[bucket][j] += j < accepted

    def _conditional(self, bucket: int, j: int) -> float:
        a, f = self.first_prior if j == 0 else self.later_prior
        return (self.passed[bucket][j] + a) / (self.tried[bucket][j] + a + f)


def _bucket(match: int) -> int:
    return min(max(match, 1), MATCH_BUCKETS) - 1


@dataclass
class DraftLengthController:
    max_gamma: int = 8
    adaptive: bool = True
    alpha: float = 0.6  # prior, then an exponential moving average of observed acceptance
    draft_cost: float = 0.0  # c: one draft step / one plain step (0 for model-free drafters)
    verify: VerifyCost = field(default_factory=VerifyCost)  # b, measured on the running model
    matches: MatchAcceptance | None = None  # model-free drafters: acceptance by match length
    measure_draft_cost: bool = True  # False: keep draft_cost as given (seeded sampling)
    smoothing: float = 0.3
    probe_every: int = 8  # plain steps between probes while the guard holds γ at 0
    _plain_steps: int = 0
    _last_speedup: float = 1.0

    @property
    def verify_cost_per_token(self) -> float:
        return self.verify.per_token

    def next_gamma(self, limit: int) -> int:
        """γ for the next step of a model drafter, at most `limit` (tokens left before max_new_tokens, minus one)."""
        top = max(0, min(self.max_gamma, limit))
        if not self.adaptive or top == 0:
            return top
        b = self.verify_cost_per_token
        best = max(range(top + 1), key=lambda g: predicted_speedup(self.alpha, g, self.draft_cost, b))
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                return 1  # keep measuring α, or the guard could never lift
        return best

    def gamma_for_match(self, match: int, proposed: int, limit: int) -> int:
        """γ for a model-free drafter's proposal of `proposed` tokens from a match of length `match`."""
        top = max(0, min(self.max_gamma, proposed, limit))
        if not self.adaptive or top == 0:
            return top
        if self.matches is None:
            self.matches = MatchAcceptance(self.max_gamma)
        best, self._last_speedup = self.matches.best_gamma(match, top, self.verify_cost_per_token)
        if best == 0:
            self._plain_steps += 1
            if self._plain_steps % self.probe_every == 0:
                return 1
        return best

    def observe(self, drafted: int, accepted: int, draft_cost: float | None = None, match: int = 0) -> None:
        if drafted and match and self.matches is not None:
            self.matches.observe(match, drafted, accepted)
        if drafted:
            rate = accepted / drafted
            self.alpha += self.smoothing * (rate - self.alpha)
        if draft_cost is not None and self.measure_draft_cost:
            self.draft_cost += self.smoothing * (draft_cost - self.draft_cost)

    def predicted_speedup(self, gamma: int, model_free: bool = False) -> float:
        """The model's prediction for the step just chosen (model-free: from the match statistics)."""
        if model_free and self.adaptive and self.matches is not None:
            return self._last_speedup if gamma else 1.0
        return predicted_speedup(self.alpha, gamma, self.draft_cost, self.verify_cost_per_token)
