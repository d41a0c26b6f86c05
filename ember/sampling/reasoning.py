"""Reasoning ("thinking") replies: where the reasoning ends, and a budget for it.

A model whose chat template has thinking tags writes ``<think>reasoning</think>answer``
(the template may open the tag itself at the end of the generation prompt); gpt-oss's
harmony format writes ``<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant
<|channel|>final<|message|>answer``, the same shape with longer tags. The reply splits
at the closing tag (:func:`split_reasoning`). :class:`ThinkingBudget` is
a logit processor that, once the reasoning has used its budget, forces the closing
tag through the sampler — only where the text so far ends on a whole UTF-8
character — so the answer always gets the rest of ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

CLOSING = "\n</think>\n\n"  # what a spent budget forces (<think> tags)


def answer_reserve(max_tokens: int) -> int:
    """Output tokens kept for the answer: a quarter of ``max_tokens``, 1 to 64."""
    return max(1, min(64, max_tokens // 4))


@dataclass(frozen=True)
class ThinkingTags:
    open: str = "<think>"
    close: str = "</think>"
    forced_close: str = CLOSING  # what a spent budget forces through the sampler
    answer_open: str = ""  # opens an answer written without reasoning (dropped)

    @classmethod
    def of_template(cls, source: str | None) -> ThinkingTags | None:
        """The tags a chat template uses, or None if it has none."""
        if not source:
            return None
        if HARMONY.open in source and HARMONY.answer_open in source:
            return HARMONY
        tags = cls()
        return tags if tags.open in source else None


# gpt-oss: the analysis channel is the reasoning; the message after it (a new
# assistant message) is the answer, opened by the final channel's header (dropped) — or
# a call, which the tool parser reads
_HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY = ThinkingTags(open="<|channel|>analysis<|message|>",
                       close="<|end|><|start|>assistant",
                       forced_close="<|end|><|start|>assistant" + _HARMONY_FINAL,
                       answer_open=_HARMONY_FINAL)


def split_reasoning(text: str, tags: ThinkingTags) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a reply; reasoning None if the reply has none. A reply
    whose reasoning never closed (cut by max_tokens) is all reasoning."""
    body = text.lstrip()
    opened = body.startswith(tags.open)
    if opened:
        body = body[len(tags.open):]
    head, sep, tail = body.partition(tags.close)
    if sep:
        tail = tail.lstrip()
        if tags.answer_open and tail.startswith(tags.answer_open):
            tail = tail[len(tags.answer_open):]
        return head.strip(), tail
    if opened:
        return body.strip(), ""
    if tags.answer_open and body.startswith(tags.answer_open):
        return None, body[len(tags.answer_open):]
    return None, text


def open_in_prompt(prompt_text: str, tags: ThinkingTags) -> bool:
    """Whether the rendered prompt already opened the reasoning (the template wrote
    the opening tag into the generation prompt)."""
    return prompt_text.rstrip().endswith(tags.open)


class ThinkingBudget:
    """Closes the reasoning after ``budget`` tokens of it by forcing ``close_ids``.

    Reasoning starts at the first output token when ``opened`` (the prompt opened it),
    else when the reply begins with the opening tag; a reply that does not start with
    it is not reasoning and is never touched. Supports speculation (``lookahead`` /
    ``rollback``). ``forced`` counts the tokens it forced.
    """

    def __init__(self, tokenizer: Any, tags: ThinkingTags, budget: int, opened: bool) -> None:
        self.tokenizer, self.tags, self.budget = tokenizer, tags, max(0, budget)
        self.close_ids = tokenizer.encode(tags.forced_close, add_bos=False,
                                          parse_special=True)
        # state: bytes of the reply, reasoning tokens, position in close_ids (None:
        # not forcing), finished (closed or never reasoning)
        self._state: tuple[bytes, int, int | None, bool] = (
            tags.open.encode() if opened else b"", 0, None, False)
        self._stack: list[tuple[tuple[bytes, int, int | None, bool], int]] = []
        self.forced = 0

    def _reasoning(self, text: bytes) -> bool:
        """Still inside the reasoning: the reply opened it and has not closed it."""
        opening = self.tags.open.encode()
        if not text.lstrip().startswith(opening):
            return opening.startswith(text.lstrip())  # undecided while it could still open
        return self.tags.close.encode() not in text

    def _at_boundary(self, text: bytes) -> bool:
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def _forcing(self) -> int | None:
        """The token to force next, or None."""
        text, count, pos, done = self._state
        if done:
            return None
        if pos is not None:
            return self.close_ids[pos]
        if count >= self.budget and self._reasoning(text) and text.lstrip().startswith(
                self.tags.open.encode()) and self._at_boundary(text):
            return self.close_ids[0]
        return None

    def process(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        token = self._forcing()
        if token is None:
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced

    def _advance(self, token: int) -> None:
        text, count, pos, done = self._state
        if done:
            return
        forcing = self._forcing()
        text += self.tokenizer.token_bytes(token)
        if forcing is not None and token == forcing:
            pos = 1 if pos is None else pos + 1
            self.forced += 1
            done = pos >= len(self.close_ids)
        else:
            pos = None
            count += 1
            done = not self._reasoning(text)
        self._state = (text, count, pos, done)

    def commit(self, token: int) -> None:
        self._stack.clear()
        self._advance(token)

    def lookahead(self, token: int) -> None:
        self._stack.append((self._state, self.forced))
        self._advance(token)

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self._state, self.forced = self._stack.pop()


class ReasoningStream:
    """Splits a streamed reply into reasoning and answer deltas as it arrives, holding
    back only text that may be the start of a tag. Whitespace around the reasoning is
    dropped as :func:`split_reasoning` drops it (a trailing newline may still show)."""

    def __init__(self, tags: ThinkingTags, opened: bool) -> None:
        self.tags = tags
        self._held = tags.open if opened else ""
        self._state = "start"  # start (undecided) → reasoning → answer
        self._reasoned = False  # reasoning text emitted yet
        self._strip_answer = False  # the answer follows a closing tag: drop its indent

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning delta, answer delta)``; ``final`` flushes what was held."""
        self._held += delta
        reasoning = answer = ""
        if self._state == "start":
            body = self._held.lstrip()
            answer_open = self.tags.answer_open
            if body.startswith(self.tags.open):
                self._state, self._held = "reasoning", body[len(self.tags.open):]
            elif answer_open and body.startswith(answer_open):
                self._state, self._held = "answer", body[len(answer_open):]
            elif final or not (self.tags.open.startswith(body)
                               or answer_open.startswith(body)):
                self._state = "answer"
        if self._state == "reasoning":
            head, sep, tail = self._held.partition(self.tags.close)
            if sep:
                reasoning, self._held = head.rstrip(), tail
                self._state, self._strip_answer = "answer", True
            else:
                keep = 0 if final else _partial_suffix(head, self.tags.close)
                reasoning, self._held = head[:len(head) - keep], head[len(head) - keep:]
            if not self._reasoned:
                reasoning = reasoning.lstrip()
                self._reasoned = bool(reasoning)
        if self._state == "answer":
            answer, self._held = self._held, ""
            if self._strip_answer:
                answer, self._held = self._answer_start(answer, final)
        return reasoning, answer

    def _answer_start(self, text: str, final: bool) -> tuple[str, str]:
        """``(answer, held)`` of the text after the closing tag: its indent dropped,
        and the answer's opening tag, once whole (held while it may still be one)."""
        text, opener = text.lstrip(), self.tags.answer_open
        if opener and text.startswith(opener):
            self._strip_answer = False
            return text[len(opener):], ""
        if opener and text and opener.startswith(text) and not final:
            return "", text
        self._strip_answer = not text
        return text, ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
