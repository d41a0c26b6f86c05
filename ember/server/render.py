"""OpenAI response bodies and SSE events, rendered from engine outputs.

Chat completions, legacy completions and the Responses API each get a whole-body
renderer and a streaming one. The streams receive ``(choice index, output)``
pairs from the server and never see a failed output: the server turns those into
errors first.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ember.engine.output import RequestOutput
from ember.sampling.reasoning import ReasoningStream, ThinkingTags, split_reasoning
from ember.sampling.sampler import TokenLogprobs
from ember.server import protocol as P
from ember.server.errors import APIError
from ember.server.tools import ToolPlan
from ember.server.transport import dumps


def sse_data(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


# how a reply splits into reasoning and answer: the model's tags, and whether the prompt
# already opened the reasoning
Reasoning = tuple[ThinkingTags, bool]


@dataclass(frozen=True)
class Shape:
    """How a route reads its replies, decided when it built the prompt: the tools it
    offered, in the served model's call format (None: none), and how a reply splits
    into reasoning and answer (None: it does not)."""

    tools: ToolPlan | None = None
    reasoning: Reasoning | None = None


class Ids:
    def __init__(self, prefix: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())


def chunk_writer(ids: Ids, req: Any, object_name: str) -> Callable[..., str]:
    """SSE ``data:`` events of one streamed response; usage only if the client asked."""

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
        body = {"id": ids.id, "object": object_name, "created": ids.created,
                "model": req.model, "system_fingerprint": None, "choices": choices}
        if req.include_usage:
            body["usage"] = usage
        return sse_data(body)

    return chunk


def usage_of(outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage object. Where speculation ran, ``completion_tokens_details`` says
    how many draft tokens the model accepted and rejected (OpenAI's fields for
    predicted outputs, the same idea: tokens proposed ahead and verified)."""
    prompt = outs[0].prompt_tokens if outs else 0
    completion = sum(o.completion_tokens for o in outs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens if outs else 0}}
    drafted = sum(o.spec.drafted for o in outs if o.spec is not None)
    if drafted:
        accepted = sum(o.spec.accepted for o in outs if o.spec is not None)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}
    return usage


def token_text(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(lps: list[TokenLogprobs] | None, tokenizer: Any) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        text, raw = token_text(tokenizer, lp.token)
        top = []
        for t, v in lp.top:
            ttext, traw = token_text(tokenizer, t)
            top.append({"token": ttext, "logprob": v, "bytes": traw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _joined(a: dict[str, list[Any]] | None, b: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return b if a is None else {k: a[k] + b[k] for k in b}


def completion_logprobs(lps: list[TokenLogprobs | None] | None, tokenizer: Any,
                         offset: int = 0, first_token: int | None = None
                         ) -> dict[str, Any] | None:
    """The completions ``logprobs`` object. A None entry (a prompt's first token, which
    has no context) is reported with null logprobs as vLLM does."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        token = first_token if lp is None else lp.token
        text = token_text(tokenizer, token)[0] if token is not None else ""
        tokens.append(text)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {token_text(tokenizer, t)[0]: v
                                             for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def tool_calls_of(req: Any, plan: ToolPlan | None, out: RequestOutput,
                  cap: str | None = None) -> list[Any] | None:
    """The calls in a finished reply to a request offering ``plan``'s tools (None: a
    text reply). Under ``required`` or a named tool a reply without them was cut short:
    an error naming the output cap (``cap``, else the OpenAI body's)."""
    if plan is None:
        return None
    calls = plan.parse(out.text)
    if calls is None and plan.choice != "auto":
        param = cap or ("max_output_tokens" if isinstance(req, P.ResponsesRequest) else
                        "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        raise APIError(400, f"the tool call did not fit in '{param}' "
                         f"({out.completion_tokens} tokens)", param=param)
    return calls


def split_reply(text: str, reasoning: Reasoning) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a reply whose prompt may have opened the reasoning."""
    tags, opened = reasoning
    return split_reasoning((tags.open if opened else "") + text, tags)


def chat_body(outs: list[RequestOutput], req: P.ChatCompletionRequest, ids: Ids,
               tokenizer: Any, shape: Shape = Shape()) -> dict[str, Any]:
    reasoning = shape.reasoning
    choices = []
    for i, o in enumerate(outs):
        message: dict[str, Any] = {"role": "assistant", "content": o.text, "refusal": None}
        if reasoning is not None:
            message["reasoning_content"], message["content"] = split_reply(o.text, reasoning)
        finish = o.finish_reason
        calls = tool_calls_of(req, shape.tools, o)
        if calls:
            message.update(content=None, tool_calls=[c.as_api() for c in calls])
            finish = "tool_calls"
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(o.logprobs, tokenizer),
                        "finish_reason": finish})
    return {"id": ids.id, "object": "chat.completion", "created": ids.created,
            "model": req.model, "choices": choices, "usage": usage_of(outs),
            "system_fingerprint": None}


async def chat_chunks(stream: AsyncIterator[tuple[int, RequestOutput]],
                       req: P.ChatCompletionRequest, ids: Ids, tokenizer: Any,
                       shape: Shape = Shape()) -> AsyncIterator[str]:
    chunk = chunk_writer(ids, req, "chat.completion.chunk")
    plan, reasoning = shape.tools, shape.reasoning

    started: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    texting: set[int] = set()  # choices known to answer in text (not tool calls)
    splitters: dict[int, ReasoningStream] = {}  # choices' reasoning/answer splits
    async for i, out in stream:
        if i not in started:
            started.add(i)
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        if plan is not None and i not in texting:
            # a reply that may be tool calls is held back until it is known to be text
            if plan.may_be_calls(out.text):
                if not out.finished:
                    continue
            else:
                texting.add(i)
                out = dataclasses.replace(out, delta_text=out.text, delta_logprobs=out.logprobs
                                          if out.finished else None)
        finish = out.finish_reason
        if out.finished and i not in texting and plan is not None:
            calls = tool_calls_of(req, plan, out)
            if calls:
                thought = None if reasoning is None else split_reply(out.text, reasoning)[0]
                if thought:  # the reasoning before the calls (harmony), sent whole
                    yield chunk([{"index": i, "delta": {"reasoning_content": thought},
                                  "logprobs": None, "finish_reason": None}])
                for k, c in enumerate(calls):
                    yield chunk([{"index": i, "delta": {"tool_calls": [{
                        "index": k, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": ""}}]},
                        "logprobs": None, "finish_reason": None}])
                    yield chunk([{"index": i, "delta": {"tool_calls": [{
                        "index": k, "function": {"arguments": c.arguments}}]},
                        "logprobs": None, "finish_reason": None}])
                finish, out = "tool_calls", dataclasses.replace(out, delta_text="")
            else:
                out = dataclasses.replace(out, delta_text=out.text)
        if reasoning is not None:
            splitter = splitters.setdefault(i, ReasoningStream(*reasoning))
            thought, said = splitter.feed(out.delta_text, final=out.finished)
            delta = {k: v for k, v in (("reasoning_content", thought), ("content", said)) if v}
            if delta:
                yield chunk([{"index": i, "delta": delta,
                              "logprobs": chat_logprobs(out.delta_logprobs, tokenizer),
                              "finish_reason": None}])
        elif out.delta_text or (out.delta_token_ids and finish != "tool_calls"):
            yield chunk([{"index": i, "delta": {"content": out.delta_text},
                          "logprobs": chat_logprobs(out.delta_logprobs, tokenizer),
                          "finish_reason": None}])
        if out.finished:
            finals[i] = out
            yield chunk([{"index": i, "delta": {}, "logprobs": None,
                          "finish_reason": finish}])
    if req.include_usage:
        yield chunk([], usage_of([finals[i] for i in sorted(finals)]))
    yield "data: [DONE]\n\n"


def completion_body(all_outs: list[list[RequestOutput]], req: P.CompletionRequest, ids: Ids,
                     tokenizer: Any, echoed: list[str] | None = None) -> dict[str, Any]:
    """``echoed``: with ``echo``, each prompt's text, which starts its choices' text (and
    its tokens their logprobs, the first one null)."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    for p, outs in enumerate(all_outs):
        for j, o in enumerate(outs):
            prefix = echoed[p] if echoed else ""
            logprobs = completion_logprobs(o.logprobs, tokenizer, len(prefix))
            if echoed and logprobs is not None:
                first = o.prompt_token_ids[0] if o.prompt_token_ids else None
                logprobs = _joined(completion_logprobs(o.prompt_logprobs or [], tokenizer,
                                                       first_token=first), logprobs)
            choices.append({"index": p * req.n + j, "text": prefix + o.text,
                            "logprobs": logprobs, "finish_reason": o.finish_reason})
        u = usage_of(outs)
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[k] += u[k]
        usage["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"][
            "cached_tokens"]
    return {"id": ids.id, "object": "text_completion", "created": ids.created,
            "model": req.model, "choices": choices, "usage": usage, "system_fingerprint": None}


async def completion_chunks(stream: AsyncIterator[tuple[int, RequestOutput]],
                             req: P.CompletionRequest, ids: Ids, tokenizer: Any
                             ) -> AsyncIterator[str]:
    chunk = chunk_writer(ids, req, "text_completion")

    finals: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}
    async for i, out in stream:
        if out.delta_text or out.delta_token_ids:
            lp = completion_logprobs(out.delta_logprobs, tokenizer, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + len(out.delta_text)
            yield chunk([{"index": i, "text": out.delta_text, "logprobs": lp,
                          "finish_reason": None}])
        if out.finished:
            finals[i] = out
            yield chunk([{"index": i, "text": "", "logprobs": None,
                          "finish_reason": out.finish_reason}])
    if req.include_usage:
        yield chunk([], usage_of([finals[i] for i in sorted(finals)]))
    yield "data: [DONE]\n\n"


def response_body(req: P.ResponsesRequest, ids: Ids, out: RequestOutput | None,
                   status: str, msg_id: str | None = None,
                   shape: Shape = Shape()) -> dict[str, Any]:
    text, split = (out.text if out else ""), shape.reasoning
    done = out is not None and out.finished
    if done and out.finish_reason == "length":
        status = "incomplete"
    reasoning = None
    if split is not None:
        reasoning, text = split_reply(text, split)
    item = {"id": msg_id or f"msg_{ids.id[5:]}", "type": "message", "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if done else []}
    output = [item] if done else []
    calls = tool_calls_of(req, shape.tools, out) if done else None
    if calls:
        output = [function_call_item(c) for c in calls]
    if done and reasoning is not None:
        output.insert(0, {"id": f"rs_{ids.id[5:]}", "type": "reasoning", "summary": [],
                          "status": "completed",
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
    usage = None
    if done:
        usage = {"input_tokens": out.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": out.cached_tokens},
                 "output_tokens": out.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": out.prompt_tokens + out.completion_tokens}
    return {
        "id": ids.id.replace("resp-", "resp_"), "object": "response",
        "created_at": ids.created, "status": status, "model": req.model,
        "output": output,
        "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "parallel_tool_calls": shape.tools.parallel if shape.tools else False,
        "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "metadata": req.metadata or {},
        "store": False, "truncation": "disabled", "user": req.user,
    }


async def _empty() -> AsyncIterator[tuple[int, RequestOutput]]:
    return
    yield


def function_call_item(call: Any, arguments: str | None = None) -> dict[str, Any]:
    return {"id": f"fc_{call.id[5:]}", "type": "function_call", "status": "completed",
            "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments}


async def response_events(stream: AsyncIterator[tuple[int, RequestOutput]],
                           req: P.ResponsesRequest, ids: Ids,
                           shape: Shape = Shape()) -> AsyncIterator[str]:
    seq = iter(range(1 << 30))
    msg_id = f"msg_{ids.id[5:]}"

    def event(kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": next(seq), **payload}
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    first = await stream.__anext__()  # admission errors surface before any event
    in_progress = response_body(req, ids, None, "in_progress", msg_id, shape)
    yield event("response.created", response=in_progress)
    yield event("response.in_progress", response=in_progress)
    if shape.reasoning is not None:  # reasoning, then the answer: sent once whole
        final_out = first[1]
        async for _, out in stream:
            final_out = out
        done = response_body(req, ids, final_out, "completed", msg_id, shape)
        for k, item in enumerate(done["output"]):
            yield event("response.output_item.added", output_index=k, item={
                **item, "status": "in_progress", "content": []})
            for j, part in enumerate(item.get("content", [])):
                ref = {"item_id": item["id"], "output_index": k, "content_index": j}
                if part["type"] == "output_text":
                    yield event("response.content_part.added", **ref,
                                part={**part, "text": ""})
                    yield event("response.output_text.delta", **ref, delta=part["text"],
                                logprobs=[])
                    yield event("response.output_text.done", **ref, text=part["text"],
                                logprobs=[])
                    yield event("response.content_part.done", **ref, part=part)
                else:
                    yield event("response.reasoning_text.delta", **ref, delta=part["text"])
                    yield event("response.reasoning_text.done", **ref, text=part["text"])
            yield event("response.output_item.done", output_index=k, item=item)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield event(kind, response=done)
        return
    if shape.tools is not None:  # calls or text: known once the reply is whole
        final_out = first[1]
        async for _, out in stream:
            final_out = out
        done = response_body(req, ids, final_out, "completed", msg_id, shape)
        if done["output"] and done["output"][0]["type"] == "function_call":
            for k, item in enumerate(done["output"]):
                yield event("response.output_item.added", output_index=k,
                            item={**item, "status": "in_progress", "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=k, delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=k, arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            yield event("response.completed", response=done)
            return
        first = (first[0], dataclasses.replace(final_out, delta_text=final_out.text))
        stream = _empty()
    part_ref = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", output_index=0,
                item={"id": msg_id, "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []})
    yield event("response.content_part.added", **part_ref,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    final = None

    async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield first
        async for item in stream:
            yield item

    async for _, out in outputs():
        if out.delta_text:
            yield event("response.output_text.delta", **part_ref, delta=out.delta_text,
                        logprobs=[])
        if out.finished:
            final = out
    assert final is not None
    done = response_body(req, ids, final, "completed", msg_id, shape)
    part = done["output"][0]["content"][0]
    yield event("response.output_text.done", **part_ref, text=final.text, logprobs=[])
    yield event("response.content_part.done", **part_ref, part=part)
    yield event("response.output_item.done", output_index=0, item=done["output"][0])
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield event(kind, response=done)
