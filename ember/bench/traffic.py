"""What a serving benchmark sends, and when: arrival processes and workloads.

Arrivals are a Poisson process (``burstiness=1``) or a gamma process (``burstiness
< 1`` is burstier, as in ``vllm bench serve``), drawn from a seed so that two
endpoints can be measured on the same trace. Workloads build OpenAI chat requests
from a seeded synthetic corpus (no data set to download):

- ``chat``: a shared system prompt, a first user turn of a few hundred tokens, then
  follow-up turns that resend the whole conversation with the server's own replies
  (what the OpenAI API asks of clients, and where a prefix cache pays);
- ``docqa``: a question about one of a few long documents;
- ``short-long``: a short prompt and a long answer;
- ``json``: extract fields from a paragraph into a JSON schema;
- ``mix``: the four, a quarter each;
- ``longdoc``: long-answer streams (as ``short-long``) while fresh documents of about
  2,000 tokens arrive, one in two requests: every document is new, so its whole
  prompt is prefilled beside the streams (where prefill/decode disaggregation pays).

Each conversation belongs to a tenant (an API key), assigned round robin.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("chat", "docqa", "short-long", "json", "mix", "longdoc")

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from "
    "at which but have an had they you were their one all we can her has there been if "
    "more when will would who so no system data model time river city market energy "
    "garden library engine signal harbor winter summer mountain forest letter doctor "
    "village music window teacher station bridge paper silver orange question answer "
    "history science number language memory travel weather island kitchen festival "
    "planet ocean theory method result value report season border journey council"
).split()

SYSTEM_PROMPT = (
    "You are a careful assistant for a regional library network. Answer questions about "
    "the documents users share, cite the paragraph you rely on, keep answers short and "
    "factual, say so when the text does not contain the answer, never invent dates or "
    "names, and write in plain English without lists unless the user asks for one. "
) * 3  # about 150 tokens, the same for every conversation

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "city": {"type": "string", "maxLength": 40},
                   "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
    "required": ["name", "city", "year"],
}


def text(rng: random.Random, words: int) -> str:
    """Seeded filler prose of about ``words`` words (≈ 1.3 tokens each)."""
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(_WORDS))
        if len(sentence) >= rng.randrange(8, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def arrivals(rate: float, count: int, burstiness: float = 1.0,
             seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``count`` requests at ``rate`` per second."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        # gamma with shape k and mean 1/rate; k = 1 is the exponential (Poisson)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@dataclass
class Conversation:
    """One chat's history; follow-up turns resend it with the server's replies."""

    cid: int
    tenant: int
    kind: str
    messages: list[dict[str, str]] = field(default_factory=list)
    turns_left: int = 1
    busy: bool = False


@dataclass
class Workload:
    """Builds the request bodies of one benchmark run (deterministic for a seed)."""

    kind: str = "chat"
    tenants: int = 1
    seed: int = 0
    max_turns: int = 4
    reply_tokens: int = 48
    follow_up: float = 0.5  # chance that an arrival continues an idle conversation
    model: str = "default"
    _rng: random.Random = field(init=False)
    _conversations: list[Conversation] = field(init=False, default_factory=list)
    _documents: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r} (choose from "
                             f"{', '.join(WORKLOADS)})")
        self._rng = random.Random(self.seed)
        docs = random.Random(self.seed + 1)
        self._documents = [text(docs, 1100) for _ in range(3)]  # ~1,500 tokens each

    def next(self) -> Conversation:
        """The conversation the next arrival belongs to: an idle one to continue, or new."""
        idle = [c for c in self._conversations if not c.busy and c.turns_left > 0]
        if idle and self._rng.random() < self.follow_up:
            conv = self._rng.choice(idle)
        else:
            conv = self._new()
        conv.busy = True
        return conv

    def _new(self) -> Conversation:
        cid = len(self._conversations)
        kind = {"mix": WORKLOADS[cid % 4],
                "longdoc": ("fresh-doc", "short-long")[cid % 2]}.get(self.kind, self.kind)
        conv = Conversation(cid, cid % self.tenants, kind,
                            turns_left=self.max_turns if kind == "chat" else 1)
        self._conversations.append(conv)
        return conv

    def body(self, conv: Conversation) -> dict[str, Any]:
        """The next request of ``conv`` (its new user turn is added to its history)."""
        rng = self._rng
        extra: dict[str, Any] = {}
        max_tokens = self.reply_tokens
        if conv.kind == "chat":
            if not conv.messages:
                conv.messages.append({"role": "system", "content": SYSTEM_PROMPT})
                words, ask = rng.randrange(120, 200), "What is this passage mostly about?"
            else:
                words, ask = rng.randrange(15, 35), "And what follows from that?"
            conv.messages.append({"role": "user", "content": f"{text(rng, words)} {ask}"})
        elif conv.kind == "docqa":
            doc = rng.choice(self._documents)
            conv.messages = [{"role": "user", "content": f"{doc}\n\nQuestion: what does the "
                              f"text say about the {rng.choice(_WORDS)}?"}]
            max_tokens = 64
        elif conv.kind == "fresh-doc":
            conv.messages = [{"role": "user", "content": f"{text(rng, 1800)}\n\nSummarise "
                              "the text above in two sentences."}]
            max_tokens = 64
        elif conv.kind == "short-long":
            conv.messages = [{"role": "user", "content": f"Write a long story about a "
                              f"{rng.choice(_WORDS)} and a {rng.choice(_WORDS)}."}]
            max_tokens = 256
        else:  # json
            conv.messages = [{"role": "user", "content": f"{text(rng, 100)} The author is "
                              f"Ada {rng.choice(_WORDS).title()} from "
                              f"{rng.choice(_WORDS).title()}, writing in "
                              f"{rng.randrange(1900, 2024)}. Extract name, city and year."}]
            extra["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "author", "schema": EXTRACTION_SCHEMA}}
            return {"model": self.model, "messages": list(conv.messages),
                    "max_tokens": 64, "stream": True,
                    "stream_options": {"include_usage": True}, **extra}
        # a fixed reply length (ignore_eos), as vllm bench serve does for synthetic data
        return {"model": self.model, "messages": list(conv.messages), "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                **extra}

    def finish(self, conv: Conversation, reply: str | None) -> None:
        """Record the server's reply (None: the turn failed) and free the conversation."""
        conv.busy = False
        conv.turns_left -= 1
        if reply is None:
            conv.turns_left = 0  # a failed turn ends the conversation
        elif conv.kind == "chat":
            conv.messages.append({"role": "assistant", "content": reply})

