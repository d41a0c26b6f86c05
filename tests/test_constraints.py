"""Constrained decoding on SmolLM2: outputs are what the grammar says, and nothing else changes.

Oracles are independent of llguidance: ``jsonschema`` validates JSON outputs, ``re``
checks regex outputs, and the ``lark`` package parses Lark outputs with the same grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import numpy as np
import pytest
import torch

from ember.engine.intake import InvalidRequest
from ember.sampling.constraints import GrammarProcessor, NoLegalToken, StructuredOutput
from ember.sampling.params import SamplingParams

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 16},
                                    "population": {"type": "integer", "minimum": 0,
                                                   "maximum": 50_000_000}},
                     "required": ["name", "population"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                     "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "tags"], "additionalProperties": False,
    },
    "enum_and_numbers": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "ok": {"type": "boolean"}},
        "required": ["colour", "score", "ok"], "additionalProperties": False,
    },
}
PROMPTS = ["Give me a JSON example.", "Describe a city in JSON.", "Answer in JSON: how was it?"]
LARK_GRAMMAR = r"""
start: sentence
sentence: subject " " verb " " object "."
subject: "the cat" | "a dog" | "my friend"
verb: "likes" | "sees" | "eats"
object: "fish" | "the ball" | "a book"
"""


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm


def chat(llm, prompt: str, spec: StructuredOutput, temperature: float = 0, seed: int = 0,
         max_tokens: int = 96):
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                            structured=spec)
    return llm.chat([{"role": "user", "content": prompt}], params)[0]


@pytest.mark.slow
@pytest.mark.parametrize("temperature,seed", [(0, 0), (0.9, 1), (0.9, 2)])
def test_every_output_validates_against_its_schema(llm, temperature, seed):
    cases = [(schema, prompt) for schema in SCHEMAS.values() for prompt in PROMPTS]
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=80,
                             structured=StructuredOutput.json_schema(schema))
              for i, (schema, _) in enumerate(cases)]
    outs = llm.chat([[{"role": "user", "content": p}] for _, p in cases], params)
    for (schema, _), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)


def _whitespace_outside_strings(text: str) -> list[int]:
    """Offsets of whitespace characters that are not inside a JSON string literal."""
    found, in_string, escaped = [], False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in " \t\r\n":
            found.append(i)
    return found


def test_whitespace_scanner_sees_only_whitespace_between_tokens():
    assert _whitespace_outside_strings('{"a b":"c\\" d","e":[1,2]}') == []
    assert _whitespace_outside_strings('{ "a" : 1}') == [1, 5, 7]


def test_json_object_mode_gives_a_compact_json_object(llm):
    out = chat(llm, "List two fruits.", StructuredOutput.json_object())
    assert isinstance(json.loads(out.text), dict)
    assert _whitespace_outside_strings(out.text) == [], out.text  # compact by default


def test_compact_json_grammar_allows_no_whitespace_between_tokens(llm):
    tok = llm.tokenizer
    spaced = [i for i in range(tok.vocab_size)
              if tok.token_bytes(i)[:1] in (b" ", b"\n", b"\t", b"\r")]
    proc = llm.engine.intake.grammars.processor(StructuredOutput.json_object())
    for prefix in ('{', '"a"', ':', '1', ','):
        for t in tok.encode(prefix):
            proc.commit(t)
        allowed = proc.allowed()
        assert not any(bool(allowed[i]) for i in spaced), prefix


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\.",
                                     r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"])
def test_regex_outputs_fullmatch(llm, pattern):
    for temperature, seed in [(0, 0), (1.0, 7)]:
        out = chat(llm, "Answer briefly.", StructuredOutput.regex(pattern), temperature, seed)
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


def test_lark_outputs_parse_with_the_same_grammar(llm):
    parser = lark.Lark(LARK_GRAMMAR)
    for temperature, seed in [(0, 0), (1.0, 3), (1.0, 4)]:
        out = chat(llm, "Write a short sentence.", StructuredOutput.lark(LARK_GRAMMAR),
                   temperature, seed)
        parser.parse(out.text)


@pytest.mark.slow
def test_batched_requests_with_different_grammars_each_respect_their_own(llm):
    specs = [StructuredOutput.json_schema(SCHEMAS["enum_and_numbers"]),
             StructuredOutput.regex(r"\d{3}-\d{4}"), StructuredOutput.lark(LARK_GRAMMAR),
             None]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=60, structured=s)
              for i, s in enumerate(specs)]
    ids = llm.encode_chat([{"role": "user", "content": "Say something."}])
    outs = llm.generate([ids] * 4, params)
    jsonschema.validate(json.loads(outs[0].text), SCHEMAS["enum_and_numbers"])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text)
    lark.Lark(LARK_GRAMMAR).parse(outs[2].text)
    alone = [llm.generate([ids], p)[0].token_ids for p in params]
    assert [o.token_ids for o in outs] == alone  # batching changed nothing


def test_mask_never_removes_the_models_choice_when_it_is_legal(llm):
    spec = StructuredOutput.json_schema(SCHEMAS["person"])
    ids = llm.encode_chat([{"role": "user", "content": "A person as JSON."}])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=60, structured=spec))[0]
    logits = llm.engine.loaded.model.score(ids + out.token_ids)[len(ids) - 1:]
    proc = llm.engine.intake.grammars.processor(spec)
    legal_steps = 0
    for k, token in enumerate(out.token_ids):
        allowed = proc.allowed()
        unmasked = int(logits[k].argmax())
        if bool(allowed[unmasked]):
            legal_steps += 1
            assert token == unmasked, f"step {k}: mask changed a legal greedy choice"
        assert bool(allowed[token])
        proc.commit(token)
    assert legal_steps > len(out.token_ids) // 2  # the check ran on most steps


def test_control_tokens_cannot_appear_inside_a_json_string(llm):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]})
    proc = llm.engine.intake.grammars.processor(spec)
    tok = llm.tokenizer
    for t in tok.encode('{"text":"hello'):
        assert bool(proc.allowed()[t])
        proc.commit(t)
    allowed = proc.allowed()
    controls = [i for i in range(tok.vocab_size) if tok.is_control(i)]
    assert controls and not any(bool(allowed[i]) for i in controls)
    # ...while the text "<|im_end|>" itself can still be written as ordinary tokens
    assert proc.valid_prefix_len(tok.encode("<|im_end|>")) == len(tok.encode("<|im_end|>"))


def test_completed_grammar_forces_the_end_of_the_turn(llm):
    proc = llm.engine.intake.grammars.processor(StructuredOutput.regex("ok"))
    for t in llm.tokenizer.encode("ok"):
        proc.commit(t)
    allowed = proc.allowed().nonzero().flatten().tolist()
    assert allowed == [llm.tokenizer.eos_id]


def test_lookaheads_for_speculation(llm):
    tok = llm.tokenizer
    proc = llm.engine.intake.grammars.processor(StructuredOutput.regex(r"The answer is (yes|no)\."))
    forced = proc.forced_tokens()
    assert tok.decode(forced) == "The answer is"
    assert proc.valid_prefix_len(tok.encode("The answer is yes.")) == len(
        tok.encode("The answer is yes."))
    bad = tok.encode("The answer is maybe.")
    assert proc.valid_prefix_len(bad) < len(bad)


def test_repeated_grammar_is_compiled_once(llm):
    grammars = llm.engine.intake.grammars
    spec = StructuredOutput.regex(r"[0-9]{2,4} apples")
    before = grammars.compiles
    for _ in range(3):
        grammars.processor(spec)
    assert grammars.compiles == before + 1


@pytest.mark.parametrize("spec", [
    StructuredOutput.regex("[a-"),
    StructuredOutput.json_schema({"type": "nonsense"}),
    StructuredOutput.lark("start: undefined_rule"),
])
def test_invalid_grammar_is_rejected_before_generation(llm, spec):
    with pytest.raises(InvalidRequest) as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    assert e.value.param == "structured"
    assert not llm.engine.has_unfinished()


class _NothingAllowed:
    """A matcher stand-in whose mask is empty: the processor must fail the request."""

    def compute_bitmask(self) -> bytes:
        return bytes(49152 // 8)

    def is_error(self) -> bool:
        return False


def test_a_mask_that_allows_nothing_fails_only_that_request(llm):
    proc = GrammarProcessor(_NothingAllowed(), llm.tokenizer.vocab_size, "test grammar")
    with pytest.raises(NoLegalToken):
        proc.process(torch.zeros(llm.tokenizer.vocab_size), [])
    engine = llm.engine
    bad = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3),
                             processors=[GrammarProcessor(_NothingAllowed(),
                                                          llm.tokenizer.vocab_size, "test")])
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert bad.finish_reason.value == "error" and "allows no token" in bad.error
    assert bad.error_param == "structured"  # the server answers 400, naming the format
    assert good.finish_reason.value == "length"


def test_bitmask_decoding_matches_llguidance(llm):
    """Our bit unpacking agrees with llguidance's own numpy helper."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    proc = llm.engine.intake.grammars.processor(StructuredOutput.json_object())
    vocab = llm.tokenizer.vocab_size
    ref = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(proc.matcher, ref)
    bits = ((ref[0][:, None] >> np.arange(32)) & 1).astype(bool).reshape(-1)[:vocab]
    assert np.array_equal(bits, proc.allowed().numpy())


def test_a_grammar_too_complex_mid_generation_fails_its_request_with_a_short_error(llm):
    """Compiles and gives a first mask, then exceeds llguidance's lexer limits: the
    request fails (blamed on its grammar), the message is one line, the engine lives."""
    engine = llm.engine
    spec = StructuredOutput.regex("(a{1000}){1000}")
    bad = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                       structured=spec))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert bad.finish_reason.value == "error" and bad.error_param == "structured"
    assert "\n" not in bad.error and "<state>" not in bad.error and len(bad.error) < 400
    assert good.finish_reason.value == "length"
    engine.kv.check_no_leaks()


def test_a_schema_with_a_thousand_optional_keys_fails_once_a_key_starts(llm):
    """It compiles and allows '{', then exceeds llguidance's row limit at the key: a
    GrammarError blamed on the request's grammar, with a one-line message."""
    from ember.sampling.constraints import GrammarError

    spec = StructuredOutput.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(1000)}})
    proc = llm.engine.intake.grammars.processor(spec)
    with pytest.raises(GrammarError) as e:
        for t in llm.tokenizer.encode('{"p'):
            proc.allowed()
            proc.commit(t)
        proc.allowed()
    assert e.value.param == "structured" and "\n" not in str(e.value)
