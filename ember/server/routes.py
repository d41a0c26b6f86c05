"""The generation routes' prompts: what differs between chat completions, completions and
responses when a body becomes token ids and sampling parameters, and how the route will
read the replies (:class:`~ember.server.render.Shape`). The Anthropic and Ollama routes
build theirs from the same pieces (:mod:`ember.server.anthropic`, :mod:`ember.server.ollama`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ember.sampling.params import SamplingParams
from ember.sampling.reasoning import open_in_prompt
from ember.server import protocol as P
from ember.server import render as R
from ember.server import tools
from ember.server.backend import EngineView
from ember.server.errors import APIError, unsupported


class PromptServer(Protocol):
    """What building a prompt needs of the server."""

    @property
    def engine(self) -> EngineView: ...

    @property
    def tool_style(self) -> tools.ToolStyle: ...

    def chat_ids(self, messages: list[dict[str, Any]], param: str,
                 variables: dict[str, Any] | None = None) -> list[int]: ...

    def check_prompt_chars(self, chars: int, param: str) -> None: ...


@dataclass
class Route:
    """What differs between the generation routes."""

    body: type[P._Body]
    primary: str  # the field holding the prompt: messages, prompt or input
    grammar: str  # the field holding the output format
    build: Callable[[PromptServer, Any], Built]
    cap: Callable[[Any], str] = lambda req: "max_tokens"  # the request's output-cap name

    def names(self, req: Any, shape: R.Shape) -> dict[str, str]:
        """Engine parameter names -> the names this request used for them (the reply's
        grammar is its tools', where ``shape`` offers some)."""
        grammar = "tools" if shape.tools is not None else self.grammar
        return {"max_tokens": self.cap(req), "structured": grammar,
                "prompt": self.primary, "n": "n"}


@dataclass(frozen=True)
class Built:
    """A route's prompts (token ids and the choices' sampling parameters, per prompt)
    and how its replies are read (the tools offered, the reasoning split)."""

    prompts: list[tuple[list[int], list[SamplingParams]]]
    shape: R.Shape = R.Shape()


def _chat_prompts(server: PromptServer, req: P.ChatCompletionRequest) -> Built:
    style = server.tool_style
    plan = req.tool_plan(style)
    prompt_ids = server.chat_ids(req.template_messages(style, plan), "messages",
                                 req.template_variables(plan))
    grammar = req.output_grammar(plan)
    params = [req.sampling(req.max_output, req.n_logprobs, j, structured=grammar)
              for j in range(req.n)]
    budget, split = thinking(server, plan, prompt_ids, req.thinking_budget)
    if budget is not None:
        params = [dataclasses.replace(p, thinking_budget=budget) for p in params]
    return Built([(prompt_ids, params)], R.Shape(plan, split))


def thinking(server: PromptServer, plan: tools.ToolPlan | None, prompt_ids: list[int],
               asked: tuple[int, str] | None) -> tuple[int | None, R.Reasoning | None]:
    """The thinking budget of a chat request and how its reply splits (None, None: the
    model does not think, or a tool grammar leaves it no room to)."""
    tags = server.engine.thinking_tags
    if tags is None:
        if asked is not None:
            raise APIError(400, f"'{asked[1]}' needs a model whose chat template has "
                             "thinking tags", param=asked[1])
        return None, None
    if plan is not None and not plan.style.fmt.reasons:
        return None, None  # a tool grammar starts at the first token: no reasoning
    opened = open_in_prompt(server.engine.tokenizer.decode(prompt_ids[-16:]), tags)
    # 1 << 30 unasked: no budget of its own, though the answer's share still holds
    return (asked[0] if asked is not None else 1 << 30), (tags, opened)


def _completion_prompts(server: PromptServer, req: P.CompletionRequest) -> Built:
    prompts = req.prompts()
    if req.stream and len(prompts) > 1:
        raise unsupported("prompt", "as a batch is not supported with stream: true")
    for p in prompts:
        server.check_prompt_chars(len(p), "prompt")  # token ids: one each
    params = [req.sampling(req.max_tokens, req.logprobs, j, req.prompt_logprobs)
              for j in range(req.n)]
    return Built([(server.engine.loaded.encode_prompt(p), params) for p in prompts])


def _responses_prompts(server: PromptServer, req: P.ResponsesRequest) -> Built:
    plan = req.tool_plan()  # told in a system message, whatever the model's format
    prompt_ids = server.chat_ids(req.template_messages(plan), "input")
    params = req.sampling(req.output_grammar(plan))
    budget, split = thinking(server, plan, prompt_ids, req.thinking_budget)
    if budget is not None:
        params = dataclasses.replace(params, thinking_budget=budget)
    return Built([(prompt_ids, [params])], R.Shape(plan, split))


CHAT = Route(P.ChatCompletionRequest, "messages", "response_format", _chat_prompts,
             lambda req: "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
COMPLETIONS = Route(P.CompletionRequest, "prompt", "response_format", _completion_prompts)
RESPONSES = Route(P.ResponsesRequest, "input", "text.format", _responses_prompts,
                  lambda req: "max_output_tokens")
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                               "/v1/messages", "/api/chat", "/api/generate"})


