"""Ollama's chat messages as a template that takes tools natively sees them: a tool
result is paired with its call by ``tool_call_id``, or else answers the next unanswered
call of the assistant message before it; wrong types are 400s naming the field."""

from __future__ import annotations

import pytest

from ember.server.errors import APIError
from ember.server.ollama import ChatRequest
from ember.tool_formats import HERMES, ToolStyle

NATIVE = ToolStyle(HERMES, native=True)
CALL = {"function": {"name": "f", "arguments": {"x": 1}}}


def _messages(messages: list[dict]) -> list[dict]:
    req = ChatRequest.model_validate({"model": "m", "messages": messages})
    req.validate_request()
    return req.template_messages(NATIVE)


def test_results_answer_their_calls_by_id_or_in_order():
    out = _messages([{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
                     {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert len(set(ids)) == 2 and [m["tool_call_id"] for m in out[2:]] == ids
    named = _messages([{"role": "user", "content": "q"},
                       {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "call_a", **CALL}, {"id": "call_b", **CALL}]},
                       {"role": "tool", "content": "b", "tool_call_id": "call_b"},
                       {"role": "tool", "content": "a", "tool_call_id": "call_a"}])
    a, b = (c["id"] for c in named[1]["tool_calls"])
    assert [m["tool_call_id"] for m in named[2:]] == [b, a]


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "r", "tool_name": 5}, "messages[0].tool_name"),
    ({"role": "tool", "content": "r", "tool_call_id": 5}, "messages[0].tool_call_id"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": 5, **CALL}]},
     "messages[0].tool_calls[0]"),
    ({"role": "user", "content": ["x"]}, "messages[0].content"),
])
def test_wrong_types_are_400s_naming_the_field(message, param):
    with pytest.raises(APIError) as e:
        _messages([message])
    assert e.value.status == 400 and e.value.param == param
