"""Reasoning budgets on the real SmolLM2 (f32) with a chat template that opens a
``<think>`` block: the budget closes the reasoning by forcing the closing tag, the
answer always keeps its share of ``max_tokens``, nothing before the budget changes,
and speculation does not change the result."""

from __future__ import annotations

import re

import pytest

from ember.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.intake import InvalidRequest
from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import (
    CLOSING,
    HARMONY,
    ThinkingTags,
    answer_reserve,
    split_reasoning,
)

pytestmark = pytest.mark.slow

THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")
QUESTION = [{"role": "user", "content": "Is 17 a prime number? Think, then answer."}]
TAGS = ThinkingTags()


@pytest.fixture(scope="module")
def make(smollm2_llm):
    loaded = smollm2_llm.engine.loaded

    def build(**options) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(loaded.path), num_kv_blocks=256,
                                      chat_template=THINKING, **options), loaded=loaded)

    return build


def generate(engine: LLMEngine, params: SamplingParams):
    req = engine.add_request(engine.loaded.encode_chat(QUESTION), params)
    while engine.has_unfinished():
        engine.step()
    return req


def test_the_budget_forces_the_closing_tag_and_the_answer_follows(make, smollm2_llm):
    engine = make()
    free = generate(engine, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    req = generate(engine, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                          thinking_budget=10))
    close = engine.tokenizer.encode(CLOSING, add_bos=False)
    out = req.output_ids
    k = out.index(close[0], 10)  # where the forced tag starts
    assert 10 <= k <= 12  # the budget, plus at most the tokens to end a character
    assert out[:k] == free.output_ids[:k]  # untouched until the budget was spent
    assert out[k:k + len(close)] == close
    reasoning, answer = split_reasoning("<think>" + req.text, TAGS)
    assert reasoning and answer  # the rest of max_tokens went to the answer
    assert len(out) == 48
    # the shared model's own template was not replaced
    assert smollm2_llm.engine.loaded.chat_template.source != THINKING


def test_max_tokens_always_leaves_the_answer_its_share(make):
    engine = make()
    req = generate(engine, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                          thinking_budget=10_000))
    close = engine.tokenizer.encode(CLOSING, add_bos=False)
    k = req.output_ids.index(close[0])
    answer_tokens = len(req.output_ids) - k - len(close)
    assert answer_tokens >= answer_reserve(32)
    assert split_reasoning("<think>" + req.text, TAGS)[1]


def test_under_a_grammar_the_budget_forces_only_the_closing_tag(make):
    """What follows the reasoning is the grammar's (harmony's call or answer): a spent
    budget forces the closing tag alone, not the newlines CLOSING adds around it,
    which this grammar's answer refuses."""
    from ember.sampling.constraints import StructuredOutput

    grammar = StructuredOutput.lark('start: THINK "</think>" ANSWER\n'
                                    "THINK: /[^<]*/\nANSWER: /[A-Za-z ]*/\n")
    req = generate(make(), SamplingParams(temperature=0, max_tokens=24, thinking_budget=5,
                                          structured=grammar))
    reasoning, sep, answer = req.text.partition("</think>")
    assert sep and re.fullmatch(r"[A-Za-z ]*", answer), req.text
    assert len(req.output_ids) <= 24 and req.finish_reason in ("stop", "length")


def test_speculation_does_not_change_a_budgeted_reply(make):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, thinking_budget=8)
    on = generate(make(), params)
    off = generate(make(speculation="off"), params)
    assert on.output_ids == off.output_ids


def test_a_budget_needs_a_thinking_template(smollm2_llm):
    loaded = smollm2_llm.engine.loaded
    engine = LLMEngine(EngineConfig(model=str(loaded.path), num_kv_blocks=64), loaded=loaded)
    with pytest.raises(InvalidRequest, match="thinking tags"):
        engine.add_request([1, 2, 3], SamplingParams(thinking_budget=5))


def test_split_reasoning():
    assert split_reasoning("<think>a b</think>\n\nanswer", TAGS) == ("a b", "answer")
    assert split_reasoning("plain answer", TAGS) == (None, "plain answer")
    assert split_reasoning("<think>cut short", TAGS) == ("cut short", "")


def test_harmony_channels_split_as_reasoning_and_answer():
    """gpt-oss's harmony reply (control tokens rendered as their text): the analysis
    channel is the reasoning, the final channel the answer; a reply straight to the
    final channel has no reasoning and loses its channel header."""
    final = "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert split_reasoning(f"<|channel|>analysis<|message|>17 has no divisors.{final}Yes.",
                           HARMONY) == ("17 has no divisors.", "Yes.")
    assert split_reasoning("<|channel|>final<|message|>Yes.", HARMONY) == (None, "Yes.")
    assert split_reasoning("<|channel|>analysis<|message|>cut", HARMONY) == ("cut", "")


def test_templates_say_which_tags_they_use():
    from llamacpp_source import llamacpp_source

    templates = llamacpp_source() / "models" / "templates"
    gpt_oss = (templates / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    assert ThinkingTags.of_template(gpt_oss) == HARMONY
    assert ThinkingTags.of_template(THINKING) == TAGS
    assert ThinkingTags.of_template("{{ messages[0]['content'] }}") is None


HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("text,opened,tags", [
    ("<think>\nweigh it up</think>\n\nYes, it is.", False, TAGS),
    ("\nweigh it up\n</think>\n\nYes.", True, TAGS),
    ("just an answer <think> in the middle", False, TAGS),
    ("<think>never closed", False, TAGS),
    ("<", False, TAGS),
    (f"<|channel|>analysis<|message|>weigh it{HARMONY_FINAL}Yes.", False, HARMONY),
    ("<|channel|>final<|message|>Straight to it.", False, HARMONY),
    ("<|channel|>analysis<|message|>call it<|end|><|start|>assistant<|channel|>commentary"
     ' to=functions.f <|constrain|>json<|message|>{"a": 1}', False, HARMONY),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", False, HARMONY),
    ("<|channel|>fin", False, HARMONY),
    ("<|chan", False, HARMONY),
])
def test_streamed_splits_join_to_the_whole_split(text, opened, tags):
    from ember.sampling.reasoning import ReasoningStream

    whole = split_reasoning((tags.open if opened else "") + text, tags)
    for size in (1, 2, 5, 100):
        stream = ReasoningStream(tags, opened)
        parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
        parts.append(stream.feed("", final=True))
        reasoning = "".join(r for r, _ in parts)
        answer = "".join(a for _, a in parts)
        assert (reasoning.strip() or None, answer) == (whole[0] or None, whole[1]), size
