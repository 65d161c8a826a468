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

The model above chooses γ; `DraftGuard` decides whether drafting runs at all, from what it
costs as measured: a draft step's seconds (the drafter's, a draft model's catch-up over
tokens it missed included, plus the verification pass) per token it committed, against a
plain step's seconds per token. It serves one request stream (the single path, per
drafter) or one batch (`pipeline/llm/batch.py`), whose plain cost is its own pass at width 1.
A model drafter's c is measured on its one- and two-token passes only (`DraftCost`) and kept
across requests, so that a request does not start from an optimistic prior and a catch-up
over many tokens is not mistaken for the price of a draft token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.llm.prefix_cache import common_prefix

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

    def seconds(self, tokens: int) -> float | None:
        """The fitted time of a pass over `tokens` tokens (None before any pass)."""
        if self._w <= 0:
            return None
        b = self.per_token
        t0 = self._y / (self._w + b * self._x)  # the mean pass, with the fitted (or prior) slope b = t1 / t0
        return t0 * (1.0 + b * (tokens - 1))

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
class BranchWorth:
    """A model-free token tree's shape from what its branches won: the tokens the r-th branch
    added beyond what the chain (and the branches before it) got accepted, per step it was
    offered, kept per rank across requests; a branch joins the tree only while that gain
    exceeds the rows it adds times b, the cost of a verified row as a share of a plain step.

    The prior is an optimistic half token a step, worth two steps, so that every rank is tried
    before it is judged; a rank dropped keeps being offered one step in `probe_every`, so that
    its figure can recover where rows get cheap (a GPU, a quiet machine)."""

    ranks: int = 8
    prior_gain: float = 0.5
    prior_steps: float = 2.0
    probe_every: int = 16
    gains: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)
    _steps: int = 0

    def __post_init__(self) -> None:
        self.gains, self.offered = [0.0] * self.ranks, [0.0] * self.ranks

    def gain(self, rank: int) -> float:
        """Expected tokens the rank-th branch (0: the first after the chain) adds a step it is offered."""
        return (self.gains[rank] + self.prior_gain * self.prior_steps) / (self.offered[rank] + self.prior_steps)

    def keep(self, chain: Sequence[int], branches: Sequence[Sequence[int]],
             verify_cost_per_token: float) -> tuple[tuple[int, ...], ...]:
        """The branches worth their rows (each branch's rows: its tokens past its common prefix with the chain)."""
        self._steps += 1
        probe = self._steps % self.probe_every == 0
        kept = []
        for rank, branch in enumerate(branches[: self.ranks]):
            rows = len(branch) - common_prefix(branch, chain)
            if probe or self.gain(rank) > verify_cost_per_token * rows:
                kept.append(tuple(branch))
        return tuple(kept)

    def observe(self, chain: Sequence[int], branches: Sequence[Sequence[int]], accepted: Sequence[int]) -> None:
        """After a tree step: `accepted`, the draft tokens the walk kept, root to leaf."""
        best = common_prefix(accepted, chain)
        for rank, branch in enumerate(branches[: self.ranks]):
            reach = common_prefix(accepted, branch)
            self.gains[rank] += max(0, reach - best)
            self.offered[rank] += 1.0
            best = max(best, reach)


@dataclass
class DraftCost:
    """c for one model drafter, kept across requests: an exponential moving average of its
    steady draft passes (one or two new tokens) over a plain target step. Catch-ups over more
    tokens (a request's prompt, the tokens decoded while the guard held drafting off) are
    left out: they are paid once per catch-up, not per draft token, and `DraftGuard` counts
    them where they are paid."""

    value: float = 0.0  # before anything is measured: free, so the first step measures it
    smoothing: float = 0.3
    alpha: float = 0.6  # the drafter's acceptance as the last request left it: the next one starts there
    measured: int = 0
    _plain_steps: int = 0  # the model's probes (DraftLengthController.next_gamma) back off across requests
    _probe_wait: int = 0

    def observe(self, ratio: float) -> None:
        self.value = ratio if not self.measured else self.value + self.smoothing * (ratio - self.value)
        self.measured += 1


@dataclass
class DraftGuard:
    """Never slower than plain decoding: drafting runs only while it measures cheaper per token,
    and what it may lose while finding that out is bounded.

    Rule. Over draft steps the guard keeps exponentially forgotten sums of seconds S and
    committed tokens N (a step's seconds: the drafter's time, catch-up included, plus the
    verification pass; its tokens: accepted + 1). Once N holds `min_tokens`, drafting goes
    off when S / N exceeds `plain_s`, a plain step's seconds per token as the caller measures
    it. While off, every step is plain; after `wait` plain steps a probe drafts again until
    it has committed `min_tokens`, judged on its own sums: cheaper, drafting stays on;
    dearer, off again and the wait doubles (from `probe_every` up to `probe_max`), so a
    drafter that keeps losing costs ever less to re-check. A probe pays its catch-up, which
    is what turning drafting back on costs.

    `judges_rate` False (a model-free drafter's guard): the rule above is left out, the loss
    budget below alone turns drafting off. Such a drafter's steps are each chosen from measured
    costs already (γ from the acceptance measured for its match length against the measured b,
    none where it does not pay: `MatchAcceptance`), and its gains come in bursts (a copied
    span), so a rate judged over `min_tokens` tokens turned it off on the noise of a few missed
    one-token drafts and held it off for hundreds of steps, copied spans included (the 16 dialogue
    prompts twice, int4-q8, 2026-12-05: suffix 1.24x -> 1.26x plain, ngram 1.17x -> 1.29x with the
    budget alone). The budget still bounds what mispredicted statistics may lose.

    Loss budget. Each draft step's loss is its seconds minus what plain decoding would have
    taken for its tokens (negative: a gain). The running loss L, gains included but credit
    capped at `allowance` plain steps, may not pass `budget` times the decoding time the guard
    has seen plus `allowance` plain steps: past it, drafting goes off at once, however few
    tokens it has committed, and a probe waits until the budget has the whole allowance free
    again (a probe that started at the edge would be stopped by its first unlucky step). Both L and the
    time are forgotten over `horizon` steps, so that the bound holds for any stretch of that
    length, not only over the guard's life (whose early gains could pay for a later losing
    streak). So however the drafter does, decoding under the guard loses at most `budget` of its time, plus
    `allowance` plain steps and the one step that crossed the line (a catch-up included): the
    ski-rental bound of exploring a drafter that may not pay. The sums above decide whether
    a drafter that stays inside the budget is winning; the budget caps what finding out costs.
    """

    probe_every: int = 32
    probe_max: int = 1024
    min_tokens: int = 16
    forget: float = 0.9
    budget: float = 0.03  # the share of decoding time drafting may lose, over the last `horizon` steps
    allowance: float = 4.0  # plus this many plain steps: the first measurements' price
    horizon: int = 4096  # steps over which L and the time seen are remembered (exponentially)
    judges_rate: bool = True  # False: the loss budget alone turns drafting off (model-free drafters)
    on: bool = True
    switches: int = 0  # times drafting went off
    _seconds: float = 0.0
    _tokens: float = 0.0
    _committed: int = 0  # tokens since drafting (re)started: decisions wait for min_tokens
    _probing: bool = False
    _wait: int = 0
    _backoff: int = 0
    _loss: float = 0.0  # seconds drafting took beyond plain decoding's for its tokens (L)
    _elapsed: float = 0.0  # decoding seconds seen: draft steps timed, plain steps at plain_s
    _plain_s: float | None = None  # the last plain cost per token given to `observe`

    def drafting(self) -> bool:
        """Whether the next step drafts. A plain step while off counts toward the next probe."""
        keep = 1.0 - 1.0 / self.horizon
        self._loss, self._elapsed = keep * self._loss, keep * self._elapsed
        if self.on:  # `observe` turned it off if the last step broke the budget
            return True
        if self._plain_s is not None:
            self._elapsed += self._plain_s
        if self._wait > 0:
            self._wait -= 1
            return False
        if self._plain_s is not None and self.room() < self.allowance * self._plain_s:
            return False  # the wait is over, but a probe needs the whole allowance: plain steps earn it back
        self.on, self._probing = True, True
        self._seconds = self._tokens = 0.0
        self._committed = 0
        return True

    def room(self) -> float:
        """Seconds drafting may still lose before the budget stops it (negative: over it)."""
        if self._plain_s is None:
            return float("inf")
        return self.budget * self._elapsed + self.allowance * self._plain_s - self._loss

    def within_budget(self) -> bool:
        """Whether drafting's running loss leaves room for another draft step."""
        return self.room() >= 0.0

    @property
    def cost_per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens else None

    @property
    def loss(self) -> float:
        """Seconds drafting has cost beyond plain decoding (negative: saved), credit capped."""
        return self._loss

    def observe(self, seconds: float, tokens: int, plain_s: float | None) -> None:
        """A draft step took `seconds` and committed `tokens`; a plain step costs `plain_s` a token."""
        f = self.forget
        self._seconds = f * self._seconds + seconds
        self._tokens = f * self._tokens + tokens
        self._committed += tokens
        if plain_s is None:
            return
        self._plain_s = plain_s
        self._elapsed += seconds
        self._loss = max(-self.allowance * plain_s, self._loss + seconds - tokens * plain_s)
        over_budget = not self.within_budget()  # decides at once; the sums wait for min_tokens
        if not over_budget and self._committed < self.min_tokens:
            return
        losing = over_budget or (self.judges_rate and self._seconds / self._tokens > plain_s)
        if self._probing:
            self._probing = False
            self._backoff = min(self.probe_max, 2 * self._backoff) if losing else 0
        if losing:
            self.turn_off()

    def turn_off(self, wait: int | None = None) -> None:
        """Drafting off for `wait` plain steps (None: the current backoff), then a probe."""
        self.on = False
        self._backoff = self._backoff or self.probe_every
        self._wait = self._backoff if wait is None else wait
        self.switches += 1


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
    probe_every: int = 8  # plain steps between probes while the model holds γ at 0
    probe_max: int = 256  # a model drafter's probe (a catch-up over the tokens it missed) backs off to this
    shared: DraftCost | None = None  # a model drafter's c and α, measured across requests
    _plain_steps: int = 0
    _probe_wait: int = 0
    _last_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.shared is not None and self.measure_draft_cost:
            self.draft_cost, self.alpha = self.shared.value, self.shared.alpha

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
        state: DraftLengthController | DraftCost = self.shared or self
        if best:
            state._plain_steps, state._probe_wait = 0, 0
            return best
        if self.draft_cost + b >= 1.0:
            return 0  # dearer than a target step whatever it accepts: no α could pay, nothing to probe
        # Probe to keep measuring α, or drafting could never come back. A model drafter's probe
        # first catches up over every token decoded since it last ran, so the probes back off
        # (across requests, where the drafter's record is shared).
        state = self.shared or self
        state._plain_steps += 1
        state._probe_wait = state._probe_wait or self.probe_every
        if state._plain_steps < state._probe_wait:
            return 0
        state._plain_steps, state._probe_wait = 0, min(self.probe_max, 2 * state._probe_wait)
        return 1

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
            if self.shared is not None:
                self.shared.observe(draft_cost)
                self.draft_cost = self.shared.value
            else:
                self.draft_cost += self.smoothing * (draft_cost - self.draft_cost)
        if self.shared is not None and self.measure_draft_cost:
            self.shared.alpha = self.alpha

    def predicted_speedup(self, gamma: int, model_free: bool = False) -> float:
        """The model's prediction for the step just chosen (model-free: from the match statistics)."""
        if model_free and self.adaptive and self.matches is not None:
            return self._last_speedup if gamma else 1.0
        return predicted_speedup(self.alpha, gamma, self.draft_cost, self.verify_cost_per_token)
