"""The call formats of the chat templates ember takes tools natively for.

Two oracles that are not ember's own output:

- the templates themselves: llama.cpp's corpus renders a past call (written by each
  model's vendor), and the format ember reads off that template must parse the
  rendering back into the same call;
- JSON Schema: replies generated under each format's grammar (by SmolLM2, sampled,
  so the grammar is exercised well off the likeliest path) must parse into calls
  whose arguments validate against their tool's schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from llamacpp_source import llamacpp_source

from ember.chat_template import ChatTemplate
from ember.sampling.constraints import StructuredOutput
from ember.sampling.params import SamplingParams
from ember.server import tools
from ember.tool_formats import FORMATS, HERMES

NATIVE = []
for _path in sorted((llamacpp_source() / "models" / "templates").glob("*.jinja")):
    _t = ChatTemplate(_path.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>")
    if tools.tool_style(_t).native:
        NATIVE.append((_path.stem, _t))

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city"]},
    "convert": {"type": "object", "properties": {
        "amount": {"type": "number"}, "to": {"type": "string", "enum": ["EUR", "USD"]}},
        "required": ["amount", "to"]},
}


def test_templates_of_every_format_are_in_the_corpus() -> None:
    found = {tools.tool_style(t).fmt.name for _, t in NATIVE}
    assert found == set(FORMATS), found


@pytest.mark.parametrize(("stem", "template"), NATIVE, ids=[s for s, _ in NATIVE])
def test_the_templates_own_rendering_of_a_call_parses_back(stem: str, template) -> None:
    fmt = tools.tool_style(template).fmt
    name, arguments = template.PROBE_CALL
    rendered = template.past_call_text()
    # the call itself: the format's opener last seen before the call's name (the tools'
    # instructions before it may show the opener too)
    start = rendered.rindex(fmt.lead, 0, rendered.rindex(name))
    schema = {"type": "object", "properties": {"probe_arg": {"type": "string"}}}
    assert fmt.parse(rendered[start:], {name: schema}) == [(name, arguments)]


@pytest.mark.parametrize("fmt", sorted(FORMATS), ids=str)
def test_replies_under_each_grammar_parse_into_valid_calls(smollm2_served_llm, fmt: str
                                                           ) -> None:
    """Sampled replies until one finishes, at most four (each grammar step is a mask
    over 49k tokens; a reply still inside a call at ``max_tokens`` proves nothing).
    One call each: with parallel calls allowed SmolLM2 goes on calling until the cap
    (the parallel grammars are checked on written replies below). SmolLM2 as served
    (q4): the replies' validity is what is checked, not the model's exact numbers."""
    llm = smollm2_served_llm
    f, parallel = FORMATS[fmt], False
    grammar = StructuredOutput.lark(f.grammar(SCHEMAS, parallel=parallel, auto=False))
    prompt = llm.encode_chat([{"role": "user", "content": "Weather in Paris for 3 "
                               "days, and 20 dollars in euros?"}])
    for seed in range(4):
        (out,) = llm.generate([prompt], SamplingParams(
            temperature=0.7, seed=seed, max_tokens=160, structured=grammar))
        if out.finish_reason == "stop":
            break
    else:
        pytest.fail("no reply finished within max_tokens: nothing was checked")
    calls = f.parse(out.text, SCHEMAS)
    assert calls, out.text
    assert parallel or len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


TWO_CALLS = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
              '<tool_call>{"name": "convert", "arguments": {"amount": 2, "to": "EUR"}}'
              '</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
               '{"name": "convert", "arguments": {"amount": 2, "to": "EUR"}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
                    '[TOOL_CALLS]convert[ARGS]{"amount": 2, "to": "EUR"}',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                 "</function>\n</tool_call>\n<tool_call>\n<function=convert>\n"
                 "<parameter=amount>\n2\n</parameter>\n<parameter=to>\nEUR\n</parameter>\n"
                 "</function>\n</tool_call>",
    "glm_xml": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
               "</tool_call><tool_call>convert\n<arg_key>amount</arg_key>\n<arg_value>2"
               "</arg_value>\n<arg_key>to</arg_key>\n<arg_value>EUR</arg_value>\n</tool_call>",
    "apriel": '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
              '{"name": "convert", "arguments": {"amount": 2, "to": "EUR"}}]</tool_calls>',
    "nemotron": '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "convert", "arguments": {"amount": 2, "to": "EUR"}}]</TOOLCALL>',
    "functionary_v3_1": '<function=get_weather>{"city": "Rome"}</function>'
                        '<function=convert>{"amount": 2, "to": "EUR"}</function>',
    "functionary_v3_2": '>>>get_weather\n{"city": "Rome"}>>>convert\n{"amount": 2, "to": "EUR"}',
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>\n'
                   "<｜tool▁call▁begin｜>function<｜tool▁sep｜>convert\n"
                   '```json\n{"amount": 2, "to": "EUR"}\n```<｜tool▁call▁end｜>'
                   "<｜tool▁calls▁end｜>",
}

@pytest.mark.parametrize("fmt", sorted(TWO_CALLS), ids=str)
def test_two_calls_are_what_the_parallel_grammar_accepts_and_the_parser_reads(
        smollm2_llm, fmt: str) -> None:
    """A reply of two calls, written as the model would: llguidance accepts every token
    of it under the parallel grammar, refuses it under the single-call one, and the
    parser reads both calls."""
    from ember.sampling.constraints import GrammarCompiler

    f, text = FORMATS[fmt], TWO_CALLS[fmt]
    tokenizer = smollm2_llm.tokenizer
    ids = tokenizer.encode(text, add_bos=False)
    compiler = GrammarCompiler(tokenizer)
    for parallel in (True, False):
        spec = StructuredOutput.lark(f.grammar(SCHEMAS, parallel=parallel, auto=True))
        accepted = compiler.processor(spec).valid_prefix_len(ids)
        assert (accepted == len(ids)) == parallel, (parallel, accepted, len(ids))
    assert f.parse(text, SCHEMAS) == [("get_weather", {"city": "Rome"}),
                                      ("convert", {"amount": 2, "to": "EUR"})]


@pytest.mark.parametrize("fmt", sorted(FORMATS), ids=str)
def test_auto_lets_text_through_and_text_is_not_calls(smollm2_llm, fmt: str) -> None:
    """A text reply (harmony's: on the final channel) is whole under ``auto``, refused
    under ``required``, and parses as no calls."""
    from ember.sampling.constraints import GrammarCompiler

    f = FORMATS[fmt]
    text = ("<|channel|>final<|message|>" if fmt == "harmony" else "") + "The weather is fine."
    assert f.parse(text, SCHEMAS) is None
    ids = smollm2_llm.tokenizer.encode(text, add_bos=False)
    compiler = GrammarCompiler(smollm2_llm.tokenizer)
    for auto in (True, False):
        spec = StructuredOutput.lark(f.grammar(SCHEMAS, parallel=False, auto=auto))
        assert (compiler.processor(spec).valid_prefix_len(ids) == len(ids)) == auto


def test_a_hermes_call_the_way_qwen_writes_it() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert HERMES.parse(text, SCHEMAS) == [("get_weather", {"city": "Oslo"})]


def test_qwen3_xml_keeps_string_values_raw_and_reads_the_rest_as_json() -> None:
    text = ("<tool_call>\n<function=convert>\n<parameter=amount>\n20.5\n</parameter>\n"
            "<parameter=to>\nEUR\n</parameter>\n</function>\n</tool_call>")
    assert FORMATS["qwen3_xml"].parse(text, SCHEMAS) == [("convert", {"amount": 20.5,
                                                                     "to": "EUR"})]
    text = text.replace("EUR", "123")  # a string of digits stays a string
    assert FORMATS["qwen3_xml"].parse(text, SCHEMAS)[0][1]["to"] == "123"


def test_mistral_calls_with_and_without_ids() -> None:
    f = FORMATS["mistral_args"]
    assert f.parse('[TOOL_CALLS]convert[CALL_ID]a1b2c3d4e[ARGS]{"amount": 1, "to": "USD"}',
                   SCHEMAS) == [("convert", {"amount": 1, "to": "USD"})]
    assert f.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]convert[ARGS]'
                   '{"amount": 2, "to": "EUR"}', SCHEMAS) == [
        ("get_weather", {"city": "Rome"}), ("convert", {"amount": 2, "to": "EUR"})]
    assert FORMATS["mistral"].parse(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
        SCHEMAS) == [("get_weather", {"city": "Rome"})]
    assert json.loads(json.dumps(SCHEMAS))  # schemas stay plain JSON


def test_control_tokens_of_a_call_format_are_written_as_tokens(smollm2_file) -> None:
    """In Mistral's own vocabularies [TOOL_CALLS] and [ARGS] are control tokens: a
    grammar that spelled them as text would force the model to write look-alikes from
    ordinary tokens. Bound to the served tokenizer (SmolLM2's, with the two added as
    control tokens) the grammar admits the tokens themselves and refuses the spelling,
    and the reply, rendered with the tokens' text, parses."""
    from ember.sampling.constraints import GrammarCompiler
    from ember.tokenizer import CONTROL, Tokenizer
    from ember.tool_formats import with_control_tokens

    meta = dict(smollm2_file.metadata)
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "[TOOL_CALLS]", "[ARGS]"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], CONTROL, CONTROL]
    tokenizer = Tokenizer(meta)
    calls, args = n, n + 1
    fmt = with_control_tokens(FORMATS["mistral_args"], tokenizer)
    assert dict(fmt.control_tokens) == {"[TOOL_CALLS]": calls, "[ARGS]": args}
    assert with_control_tokens(HERMES, tokenizer) == HERMES  # none in its texts
    as_tokens = [calls, *tokenizer.encode("get_weather", add_bos=False), args,
                 *tokenizer.encode('{"city": "Rome"}', add_bos=False)]
    spelled = tokenizer.encode('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', add_bos=False)
    assert calls not in spelled  # plain text never makes the control token
    compiler = GrammarCompiler(tokenizer)
    for auto in (False, True):
        spec = StructuredOutput.lark(fmt.grammar(SCHEMAS, parallel=False, auto=auto))
        assert compiler.processor(spec).valid_prefix_len(as_tokens) == len(as_tokens)
        assert compiler.processor(spec).valid_prefix_len(spelled) < len(spelled)
    text = tokenizer.decode(as_tokens)
    assert fmt.parse(text, SCHEMAS) == [("get_weather", {"city": "Rome"})]


HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|call|>", "<|return|>")


def test_harmony_reasons_then_calls_in_gpt_oss_tokens(smollm2_file) -> None:
    """gpt-oss's harmony format in a vocabulary with its control tokens (SmolLM2's,
    with them added): an analysis message then a call, written with the tokens, is whole
    under both grammars — the recipient in the channel header, as the model writes it,
    or in the role header, as the template writes past calls; an answer on the final
    channel only under ``auto``; the same text spelled in ordinary tokens is refused.
    The reply parses into the call, its analysis is the reasoning, and the call is
    ``<|call|>``-terminated (which ends gpt-oss's turn)."""
    from ember.sampling.constraints import GrammarCompiler
    from ember.sampling.reasoning import HARMONY, split_reasoning
    from ember.tokenizer import CONTROL, Tokenizer
    from ember.tool_formats import with_control_tokens

    meta = dict(smollm2_file.metadata)
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *HARMONY_TOKENS]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"],
                                         *[CONTROL] * len(HARMONY_TOKENS)]
    tokenizer = Tokenizer(meta)
    fmt = with_control_tokens(FORMATS["harmony"], tokenizer)
    # "<|end|>" closes a message, not the reply: user-defined, as llama.cpp makes it
    assert {t for t, _ in fmt.control_tokens} == set(HARMONY_TOKENS) - {"<|return|>",
                                                                         "<|end|>"}
    assert all(i >= n for _, i in fmt.control_tokens)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False, parse_special=True)

    thought = ("<|channel|>analysis<|message|>Rome <b>weather</b> <|end> |end|, 2 days.<|end|>"
               "<|start|>assistant")
    in_channel = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
    in_role = " to=functions.get_weather<|channel|>commentary json<|message|>"
    arguments = '{"city": "Rome", "days": 2}<|call|>'
    final = "<|channel|>final<|message|>It is sunny <|in Rome."
    compiler = GrammarCompiler(tokenizer)
    for auto in (False, True):
        spec = StructuredOutput.lark(fmt.grammar(SCHEMAS, parallel=True, auto=auto))
        for reply in (thought + in_channel + arguments, in_role + arguments,
                      thought + final):
            tokens = ids(reply)
            whole = auto or not reply.endswith(final)
            assert (compiler.processor(spec).valid_prefix_len(tokens) == len(tokens)) == whole
        spelled = tokenizer.encode(in_channel + arguments, add_bos=False)
        assert compiler.processor(spec).valid_prefix_len(spelled) < len(spelled)
        # a message ends at its first "<|end|>": a new message must follow
        going_on = ids("<|channel|>analysis<|message|>Rome<|end|> and on")
        assert compiler.processor(spec).valid_prefix_len(going_on) == len(going_on) - 2
    # in a vocabulary without them (a harmony template over another model) the same
    # reply is written in ordinary tokens, and still whole
    plain = Tokenizer(smollm2_file.metadata)
    spelled = plain.encode(thought + in_channel + arguments, add_bos=False)
    spec = StructuredOutput.lark(FORMATS["harmony"].grammar(SCHEMAS, parallel=False,
                                                              auto=False))
    assert GrammarCompiler(plain).processor(spec).valid_prefix_len(spelled) == len(spelled)
    text = tokenizer.decode(ids(thought + in_channel + arguments))
    assert fmt.parse(text, SCHEMAS) == [("get_weather", {"city": "Rome", "days": 2})]
    assert fmt.parse(tokenizer.decode(ids(thought + final)), SCHEMAS) is None
    reasoning, rest = split_reasoning(text, HARMONY)
    assert reasoning == "Rome <b>weather</b> <|end> |end|, 2 days."
    assert rest.startswith(in_channel)
    assert split_reasoning(thought + final, HARMONY)[1] == "It is sunny <|in Rome."
