"""How much of a TPOT objective the scheduler may plan a step to fill: corrected by the
time per output token that finished requests actually got.

The scheduler keeps decoding streams within their TPOT objectives by predicting each
step's duration (:class:`~ember.engine.costs.StepCostModel`). What a stream gets is
more than the predicted forward passes: the scheduling, sampling and output handling
around each step, and on a small machine every other thread on its cores — the HTTP
server, request preparation, a load generator beside it. Under overload these grow
exactly when the batch is fullest, and a batch planned to 90% of the objective then
delivers 105% of it: every request admitted misses, and goodput collapses while
throughput stays up.

So the plan is scaled: ``scale`` multiplies the step-time limits (the stall limit for
steps carrying prompt tokens, the seat limit for admitting one more stream). Each
finished request with a TPOT objective reports what it got; past ``TARGET`` of its
objective the scale drops at once in proportion, below it the scale creeps back up.
Fewer streams then share the steps, each meets its objective, and the requests that
do not fit wait or are refused (429) before they cost anything.
"""

from __future__ import annotations

TARGET = 0.9  # share of the objective a finished request's TPOT should stay under
MIN_SCALE = 0.3
RECOVERY = 0.02  # per request under target: the scale regains this share of its gap
MIN_TOKENS = 4  # a request with fewer output tokens says little about its TPOT


class Pace:
    def __init__(self) -> None:
        self.scale = 1.0
        self.observed = 0

    def observe(self, tpot: float, objective: float) -> None:
        """A finished request got ``tpot`` seconds per output token against
        ``objective``."""
        self.observed += 1
        ratio = tpot / (TARGET * objective)
        if ratio > 1.0:
            self.scale = max(MIN_SCALE, self.scale / ratio)
        else:
            self.scale = min(1.0, self.scale + RECOVERY * (1.0 - self.scale))

    def observe_finished(self, first_token_time: float | None, finished: float,
                         num_output: int, objective: float | None) -> None:
        """The request's TPOT from its first token to ``finished``, when it has an
        objective and enough tokens to tell."""
        if objective is None or first_token_time is None or num_output < MIN_TOKENS:
            return
        self.observe((finished - first_token_time) / (num_output - 1), objective)
