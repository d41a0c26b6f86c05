"""How long a step takes, learned from the steps the engine runs.

The scheduler needs two predictions: how many prompt tokens it can add to a step
without making the running streams miss their time per output token (stall-free
chunked prefill), and when a new request would see its first token (admission); the
speculation gate needs a third, what one more draft token adds to a step. All come
from one model of a step's wall time::

    seconds ≈ base + per_token · tokens + per_excess · max(0, tokens - knee)
              + per_logit · logits + per_draft · drafts + per_row · rows
              + per_attended · attended
              + verify_call · [decode rows and draft-verify rows both present]

where ``tokens`` are all query tokens of the step, ``logits`` the rows whose next
token is wanted (a decode row's one, every token of a draft-verify row, a prompt
chunk's last when it ends the prompt: each costs the output head and sampling),
``drafts`` the draft tokens verified (what verifying one costs beyond its compute:
what the other terms, fit mostly to plain decode and prefill steps, miss of it),
``rows`` the requests in it, and ``attended`` the sum over rows of query tokens ×
context length (attention's work). The knee is where the step stops being a stream
over the weights and becomes arithmetic: below it one more token nearly rides along
with the weights already read, above it every token costs its compute (on 2 cores,
SmolLM2 q4 at one stream a draft token adds ~0.25 ms, at sixteen ~0.6 ms). The knee
is chosen among :data:`KNEES` by the fit, the coefficients by least squares.
Draft-verify rows are attended in a call of their own beside the decode rows' in the
op-by-op path (see ember.models.layers.attention); ``verify_call`` is that call's fixed price.
The model starts from a table measured on the machine (``ember bench spec-cost``;
ember ships one, and ``calibrate_costs`` measures a short one at startup) or, without
one, from pessimistic priors. The coefficients are then refit by least squares on the
last :data:`WINDOW` steps, with a ridge pull toward the current estimate so that a
window of similar steps (all decode, say) cannot send a coefficient it says nothing
about to zero or infinity, and clamped to a quarter to four times the starting table
(:data:`CLAMP`): a live rescale, robust to a few odd steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ember.models.layers.attention import SHORT_QUERY

WINDOW = 256
REFIT_EVERY = 16
MIN_SAMPLES = 8
# A step this many times slower than predicted refits at once (at most every
# MIN_REFIT_GAP steps): a table measured with more threads, or a context longer than
# it saw, would otherwise price steps too cheaply for REFIT_EVERY steps — steps the
# scheduler sized to keep waiting requests' first tokens near.
MISJUDGED = 1.5
# Between refits every prediction is scaled by a running ratio of what steps took to
# what the fit said (this weight for the latest step, within this range). The scheduler
# sizes prefill chunks to one predicted duration, so the steps a fit learns from say
# little about other chunk sizes, and a refit can be off for the chunks it then
# chooses (measured: 0.5 s predicted, 0.62-0.76 s taken for 13 steps until the next
# refit); the ratio corrects that within a few steps.
RECENT_WEIGHT = 0.3
RECENT_RANGE = (0.5, 2.0)
RECENT_STEPS = 8  # the steps a new fit is held to, as above
MIN_REFIT_GAP = 4
CLAMP = (0.25, 4.0)
NUM_FEATURES = 8
KNEES = (1, 2, 4, 8, 16, 32, 64, 128)  # candidate token counts of the compute knee
_TOKENS, _EXCESS = 1, 6  # feature columns: query tokens, tokens past the knee


@dataclass(frozen=True)
class StepShape:
    """What a step is made of, as far as its cost goes."""

    tokens: int
    rows: int
    attended: int  # Σ rows: query tokens × context length
    decode_rows: int = 0  # rows of one query token
    verify_rows: int = 0  # rows of 2..SHORT_QUERY query tokens (verifying a draft)
    logits: int = 0  # rows of logits computed and sampled
    drafts: int = 0  # draft tokens verified

    @property
    def split(self) -> bool:
        """Whether decode rows and verify rows need separate attention calls."""
        return self.decode_rows > 0 and self.verify_rows > 0

    def plus(self, tokens: int, context: int, logits: int | None = None,
             drafts: int = 0) -> StepShape:
        """This step with one more row of ``tokens`` query tokens ending at ``context``,
        ``logits`` of them wanted (default: all of a decode or verify row's, one of a
        longer chunk's), ``drafts`` of them draft tokens."""
        if logits is None:
            logits = tokens if tokens <= SHORT_QUERY else 1
        return StepShape(self.tokens + tokens, self.rows + 1, self.attended + tokens * context,
                         self.decode_rows + (tokens == 1),
                         self.verify_rows + (1 < tokens <= SHORT_QUERY), self.logits + logits,
                         self.drafts + drafts)

    def with_draft_token(self, context: int) -> StepShape:
        """This step with one more draft token, at ``context``, in a row it has."""
        return replace(self, tokens=self.tokens + 1, attended=self.attended + context,
                       logits=self.logits + 1, drafts=self.drafts + 1)

    def features(self, knee: float) -> tuple[float, ...]:
        """The model's regressors, in :class:`Coefficients` order."""
        return (1.0, self.tokens, self.rows, self.attended, float(self.split), self.logits,
                max(0.0, self.tokens - knee), self.drafts)


@dataclass
class Coefficients:
    base: float = 0.010
    per_token: float = 0.002
    per_row: float = 0.001
    per_attended: float = 2e-8
    verify_call: float = 0.002
    per_logit: float = 0.0
    per_excess: float = 0.0
    per_draft: float = 0.0
    knee: float = 0.0  # tokens from which per_excess applies (not a regression coefficient)

    def as_array(self) -> np.ndarray:
        return np.array([self.base, self.per_token, self.per_row, self.per_attended,
                         self.verify_call, self.per_logit, self.per_excess, self.per_draft])

    @classmethod
    def of(cls, values: np.ndarray, knee: float) -> Coefficients:
        return cls(*map(float, values), knee=float(knee))


class StepCostModel:
    """Predicts step seconds from a :class:`StepShape`; learns from observed steps.

    ``learn=False`` keeps the given coefficients fixed (tests use it for a
    deterministic step-time model).
    """

    def __init__(self, coefficients: Coefficients | None = None, learn: bool = True) -> None:
        self.coef = coefficients or Coefficients()
        # What the live refit may not stray beyond: a quarter to four times a measured
        # table, so a burst of odd steps (a stall, another process) cannot reprice
        # everything. The priors are only a guess: no clamp around them.
        self.anchor = self.coef.as_array() if coefficients is not None else None
        self.start = self.coef  # the table (or the priors) before any live refit
        self.learn = learn
        self._recent = 1.0  # what the last steps took over what the fit predicted
        self._last: deque[tuple[StepShape, float]] = deque(maxlen=RECENT_STEPS)
        self._x = np.zeros((WINDOW, NUM_FEATURES))  # features at knee 0
        self._y = np.zeros(WINDOW)
        self._n = 0
        self._refit_at = 0  # self._n at the last refit

    def predict(self, shape: StepShape) -> float:
        if shape.rows == 0:
            return 0.0
        return self._fitted(shape) * self._recent

    def _fitted(self, shape: StepShape) -> float:
        return float(np.dot(self.coef.as_array(), shape.features(self.coef.knee)))

    def fastest(self, shape: StepShape) -> float:
        """The lower of the live fit's and the starting table's prediction: what a
        refusal may rest on. A fit can be skewed by the steps it saw (a replica that only
        prefills has never timed a decode step) and refusing stops the steps that
        would correct it."""
        if shape.rows == 0:
            return 0.0
        features = shape.features(self.start.knee)
        return min(self.predict(shape), float(np.dot(self.start.as_array(), features)))

    @property
    def verify_call(self) -> float:
        """Seconds a step's separate attention call for verify rows adds."""
        return self.coef.verify_call

    def token_cost(self, shape: StepShape, context: int) -> float:
        """Seconds one more query token at ``context``, with its logits, adds to a step of
        ``shape`` (a draft token verified in a row the step already has)."""
        c = self.coef
        return (c.per_token + c.per_logit + c.per_draft + c.per_attended * context
                + c.per_excess * (shape.tokens >= c.knee))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not self.learn or shape.rows == 0:
            return
        misjudged = seconds > MISJUDGED * self.predict(shape)
        fitted = self._fitted(shape)
        self._last.append((shape, seconds))
        if fitted > 0:  # between refits, predictions follow what the last steps took
            ratio = min(RECENT_RANGE[1], max(RECENT_RANGE[0], seconds / fitted))
            self._recent += RECENT_WEIGHT * (ratio - self._recent)
        i = self._n % WINDOW
        self._x[i] = shape.features(0.0)
        self._y[i] = seconds
        self._n += 1
        if self._n >= MIN_SAMPLES and (self._n - self._refit_at >= REFIT_EVERY or (
                misjudged and self._n - self._refit_at >= MIN_REFIT_GAP)):
            self._refit()

    def _refit(self) -> None:
        self._refit_at = self._n
        n = min(self._n, WINDOW)
        prior = self.coef.as_array()
        self.coef = fit_at_best_knee(self._x[:n], self._y[:n],
                                     lambda x, y: self._ridge(x, y, prior))
        # the new fit, held to what the last steps took (their median ratio)
        ratios = sorted(sec / f for shape, sec in self._last
                        if (f := self._fitted(shape)) > 0)
        self._recent = (min(RECENT_RANGE[1], max(RECENT_RANGE[0], ratios[len(ratios) // 2]))
                        if ratios else 1.0)

    def _ridge(self, x: np.ndarray, y: np.ndarray, prior: np.ndarray) -> np.ndarray:
        # Columns differ by orders of magnitude: scale them, then ridge toward the prior.
        n = len(y)
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        xs = x / scale
        lam = 1e-3 * n
        a = xs.T @ xs + lam * np.eye(NUM_FEATURES)
        b = xs.T @ y + lam * (prior * scale)
        fit = np.clip(np.linalg.solve(a, b) / scale, 0.0, None)
        if self.anchor is not None:  # a coefficient the table found zero stays free
            upper = np.where(self.anchor > 0, CLAMP[1] * self.anchor, np.inf)
            fit = np.clip(fit, CLAMP[0] * self.anchor, upper)
        return fit

    def prefill_rate(self, decode_rows: int = 0) -> float:
        """Prompt tokens per second the engine computes when its steps carry mostly
        prefill (one 256-token chunk alongside ``decode_rows`` decoding streams)."""
        shape = StepShape(decode_rows + 256, decode_rows + 1, 256 * 256 + decode_rows * 512,
                          decode_rows=decode_rows, logits=decode_rows + 1)
        return 256 / max(self.predict(shape), 1e-6)


def fit_at_best_knee(x: np.ndarray, y: np.ndarray,
                     solve: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Coefficients:
    """The coefficients ``solve(x, y)`` finds at the knee among :data:`KNEES` whose fit
    has the least squared *relative* error; ``x`` holds :meth:`StepShape.features` at
    knee 0 (its tokens-past-the-knee column is rewritten for each candidate)."""
    x = x.copy()
    best: tuple[float, np.ndarray, float] | None = None
    for knee in KNEES:
        x[:, _EXCESS] = np.maximum(0.0, x[:, _TOKENS] - knee)
        fit = solve(x, y)
        err = float(np.sum(((x @ fit - y) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, fit, knee)
    assert best is not None
    return Coefficients.of(best[1], best[2])
