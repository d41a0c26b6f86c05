"""SamplingParams: what a caller asks of one generation, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.sampling.constraints import StructuredOutput


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it and its value."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """How to turn logits into tokens, and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k=0`` and ``top_p=1`` disable those
    filters; ``min_p=0`` disables min-p. ``repetition_penalty`` (1 = off) divides
    positive and multiplies negative logits of every token already in the prompt or
    output; ``presence_penalty``/``frequency_penalty`` follow OpenAI and apply to
    output tokens only. ``seed`` makes sampled output reproducible: a request's
    tokens depend only on its own seed, never on what else is batched with it.
    ``structured`` constrains the output to a JSON schema, any JSON object, a regex or
    a Lark grammar (see ``ember.sampling.constraints.StructuredOutput``).
    ``speculation`` lets the engine draft and verify several tokens per step where its
    cost gate says it pays; the committed tokens are the same either way.
    """

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured: StructuredOutput | None = None  # constrain the output (JSON, regex, Lark)
    speculation: bool = True  # let the engine verify draft tokens (never changes the output)
    # reasoning tokens allowed before the closing tag is forced (thinking templates only)
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
               "max_tokens", self.max_tokens, "must be an integer >= 0")
        _check(_is_num(self.temperature) and 0 <= self.temperature <= 100,
               "temperature", self.temperature, "must be a number in [0, 100]")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
               "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "must be an integer >= 0 (0 disables)")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
               "must be in [0, 1]")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               "repetition_penalty", self.repetition_penalty, "must be in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed,
               "must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "must be an integer in [0, 20]")
        _check(self.thinking_budget is None or (_is_int(self.thinking_budget)
                                                and self.thinking_budget >= 0),
               "thinking_budget", self.thinking_budget, "must be an integer >= 0")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", self.prompt_logprobs, "must be an integer in [0, 20]")
        _check(isinstance(self.speculation, bool), "speculation", self.speculation,
               "must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN fails


def _check(ok: bool, param: str, value: object, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(param, f"{message}, got {value!r}")
