"""How long a step takes, learned from the steps the engine runs.

The scheduler needs two predictions: how many prompt tokens it can add to a step
without making the running streams miss their time per output token (stall-free
chunked prefill), and when a new request would see its first token (admission).
Both come from one linear model of a step's wall time::

    seconds ≈ base + per_token · tokens + per_row · rows + per_attended · attended
              + verify_call · [decode rows and draft-verify rows both present]

where ``tokens`` are all query tokens of the step, ``rows`` the requests in it, and
``attended`` the sum over rows of query tokens × context length (attention's work).
Draft-verify rows are attended in a call of their own beside the decode rows' (see
ember.models.attention); ``verify_call`` is that call's fixed price (~3 ms for
SmolLM2 q4 on 2 cores, 30 layers of small ops), which the gate must weigh against
what the drafts commit.
The model starts from a table measured on the machine (``ember bench spec-cost``;
ember ships one, and ``calibrate_costs`` measures a short one at startup) or, without
one, from pessimistic priors. The coefficients are then refit by least squares on the
last :data:`WINDOW` steps, with a ridge pull toward the current estimate so that a
window of similar steps (all decode, say) cannot send a coefficient it says nothing
about to zero or infinity, and clamped to a quarter to four times the starting table
(:data:`CLAMP`): a live rescale, robust to a few odd steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.models.attention import SHORT_QUERY

WINDOW = 256
REFIT_EVERY = 16
MIN_SAMPLES = 8
CLAMP = (0.25, 4.0)
NUM_FEATURES = 5


@dataclass(frozen=True)
class StepShape:
    """What a step is made of, as far as its cost goes."""

    tokens: int
    rows: int
    attended: int  # Σ rows: query tokens × context length
    decode_rows: int = 0  # rows of one query token
    verify_rows: int = 0  # rows of 2..SHORT_QUERY query tokens (verifying a draft)

    @property
    def split(self) -> bool:
        """Whether decode rows and verify rows need separate attention calls."""
        return self.decode_rows > 0 and self.verify_rows > 0

    def plus(self, tokens: int, context: int) -> StepShape:
        """This step with one more row of ``tokens`` query tokens ending at ``context``."""
        return StepShape(self.tokens + tokens, self.rows + 1, self.attended + tokens * context,
                         self.decode_rows + (tokens == 1),
                         self.verify_rows + (1 < tokens <= SHORT_QUERY))

    def features(self) -> tuple[float, ...]:
        """The model's regressors, in :class:`Coefficients` order."""
        return (1.0, self.tokens, self.rows, self.attended, float(self.split))


@dataclass
class Coefficients:
    base: float = 0.010
    per_token: float = 0.002
    per_row: float = 0.001
    per_attended: float = 2e-8
    verify_call: float = 0.002

    def as_array(self) -> np.ndarray:
        return np.array([self.base, self.per_token, self.per_row, self.per_attended,
                         self.verify_call])


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
        self.learn = learn
        self._x = np.zeros((WINDOW, NUM_FEATURES))
        self._y = np.zeros(WINDOW)
        self._n = 0

    def predict(self, shape: StepShape) -> float:
        c = self.coef
        if shape.rows == 0:
            return 0.0
        return (c.base + c.per_token * shape.tokens + c.per_row * shape.rows
                + c.per_attended * shape.attended + c.verify_call * shape.split)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not self.learn or shape.rows == 0:
            return
        i = self._n % WINDOW
        self._x[i] = shape.features()
        self._y[i] = seconds
        self._n += 1
        if self._n >= MIN_SAMPLES and self._n % REFIT_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        n = min(self._n, WINDOW)
        x, y = self._x[:n], self._y[:n]
        prior = self.coef.as_array()
        # Columns differ by orders of magnitude: scale them, then ridge toward the prior.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        xs = x / scale
        lam = 1e-3 * n
        a = xs.T @ xs + lam * np.eye(NUM_FEATURES)
        b = xs.T @ y + lam * (prior * scale)
        fit = np.clip(np.linalg.solve(a, b) / scale, 0.0, None)
        if self.anchor is not None:  # a coefficient the table found zero stays free
            upper = np.where(self.anchor > 0, CLAMP[1] * self.anchor, np.inf)
            fit = np.clip(fit, CLAMP[0] * self.anchor, upper)
        self.coef = Coefficients(*map(float, fit))

    def prefill_rate(self, decode_rows: int = 0) -> float:
        """Prompt tokens per second the engine computes when its steps carry mostly
        prefill (one 256-token chunk alongside ``decode_rows`` decoding streams)."""
        shape = StepShape(decode_rows + 256, decode_rows + 1, 256 * 256 + decode_rows * 512)
        return 256 / max(self.predict(shape), 1e-6)
