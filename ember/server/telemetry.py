"""What an operator can follow of each request: an OpenTelemetry trace and a log line.

``--otlp-traces-endpoint URL`` exports one trace per generation request over OTLP/HTTP
(the OpenTelemetry SDK from PyPI: ``pip install 'ember[otel]'``). The spans are built
when the request ends, from times the server and the engine recorded anyway (the
engine's :class:`~ember.engine.request.Timeline`), so tracing adds no work to a step and
nothing at all when it is off::

    chat <model>                 the HTTP request, arrival to the last byte
    ├─ ember.prepare             decoding, validation, chat template, tokenization
    ├─ ember.queue               waiting for admission
    ├─ ember.admission           the admission decision (cached prompt tokens)
    ├─ ember.prefill             admission to the first token
    │  └─ ember.prefill.chunk    each step that computed prompt positions
    ├─ ember.decode              first token to the last (steps, speculation)
    └─ ember.respond             the last token to the end of the response

Names and attributes follow the GenAI semantic conventions (``gen_ai.*``) where they
have one. An incoming ``traceparent`` header makes the request's trace a child of
the caller's. Prompt and completion text are exported only with ``--trace-content``;
the tenant only as :func:`~ember.server.metrics.tenant_hash`.

``--request-log FILE`` writes one JSON line per finished request. The file is reopened
when it is moved or deleted, so logrotate (without copytruncate) may rotate it.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.engine.output import RequestOutput
from ember.engine.request import Timeline
from ember.server.metrics import tenant_hash

log = logging.getLogger("ember.server")

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/responses": "chat"}


@dataclass
class RequestRecord:
    """What the server knows of one generation request, for its trace and log line."""

    path: str
    tenant: str
    arrival: float  # time.monotonic() when its headers were read
    carrier: dict[str, str] = field(default_factory=dict)  # traceparent / tracestate
    prepared: float | None = None  # decoded, validated and tokenized
    model: str = ""
    adapter: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # gen_ai.request.* values
    prompt: str | None = None  # with --trace-content only

    @property
    def operation(self) -> str:
        return OPERATIONS.get(self.path, "chat")


class Telemetry:
    """The server's tracer and request log (either may be off)."""

    def __init__(self, endpoint: str | None = None, content: bool = False,
                 request_log: str | Path | None = None) -> None:
        self.content = content
        self._tracer = self._provider = None
        if endpoint:
            self._tracer = self._start_tracing(endpoint)
        self._log: logging.Logger | None = None
        if request_log:
            self._log = logging.getLogger(f"ember.request_log.{id(self)}")
            self._log.propagate = False
            self._log.setLevel(logging.INFO)
            handler = logging.handlers.WatchedFileHandler(str(request_log), encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(message)s"))
            self._log.addHandler(handler)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None or self._log is not None

    def _start_tracing(self, endpoint: str) -> Any:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise RuntimeError("--otlp-traces-endpoint needs the OpenTelemetry SDK: "
                               "pip install 'ember[otel]'") from e
        self._provider = TracerProvider(resource=Resource.create({"service.name": "ember"}))
        # a queue for a burst of long requests' spans (the default 2,048 drops them)
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=500,
            max_queue_size=65536))
        log.info("exporting traces to %s (OTLP/HTTP)%s", endpoint,
                 ", with prompt and completion text" if self.content else "")
        return self._provider.get_tracer("ember")

    def close(self) -> None:
        """Export what is pending (at shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()

    # ------------------------------------------------------------ a finished request
    def finished(self, rec: RequestRecord, outs: list[RequestOutput | None], status: int,
                 error_type: str | None, end: float) -> None:
        """``outs``: each choice's last output (None: it produced none)."""
        trace_id = None
        try:  # a trace or a log line is never worth a request
            if self._tracer is not None:
                trace_id = self._trace(rec, outs, status, error_type, end)
            if self._log is not None:
                self._log.info(json.dumps(_log_line(rec, outs, status, error_type, end,
                                                    trace_id)))
        except Exception:
            log.exception("the trace or log line of a request failed")

    def _trace(self, rec: RequestRecord, outs: list[RequestOutput | None], status: int,
               error_type: str | None, end: float) -> str:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ns = _clock()
        parent = TraceContextTextMapPropagator().extract(carrier=rec.carrier)
        done = [o for o in outs if o is not None]
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": rec.operation, "gen_ai.provider.name": "ember",
            "gen_ai.request.model": rec.model, "gen_ai.response.model": rec.model,
            "gen_ai.usage.input_tokens": done[0].prompt_tokens if done else 0,
            "gen_ai.usage.output_tokens": sum(o.completion_tokens for o in done),
            "gen_ai.response.finish_reasons": [o.finish_reason or "abort" for o in done],
            "ember.usage.cached_tokens": done[0].cached_tokens if done else 0,
            "ember.tenant.hash": tenant_hash(rec.tenant),
            "http.request.method": "POST", "url.path": rec.path,
            "http.response.status_code": status,
        }
        if done:
            attrs["gen_ai.response.id"] = done[0].request_id
        if rec.adapter:
            attrs["ember.lora.adapter"] = rec.adapter
        attrs.update({f"gen_ai.request.{k}": v for k, v in rec.params.items() if v is not None})
        if error_type:
            attrs["error.type"] = error_type
        if self.content:
            if rec.prompt is not None:
                attrs["gen_ai.input.messages"] = rec.prompt
            attrs["gen_ai.output.messages"] = json.dumps([o.text for o in done])
        root = self._tracer.start_span(f"{rec.operation} {rec.model}".strip(), context=parent,
                                       kind=SpanKind.SERVER, start_time=ns(rec.arrival),
                                       attributes=attrs)
        if status >= 500 or error_type:
            root.set_status(Status(StatusCode.ERROR, error_type))
        inside = trace.set_span_in_context(root)

        def span(name: str, start: float, stop: float, under: Any = None,
                 **attributes: Any) -> Any:
            """A finished child span of the root (or of the span ``under``)."""
            context = inside if under is None else trace.set_span_in_context(under)
            s = self._tracer.start_span(name, context=context, start_time=ns(start),
                                        attributes={k: v for k, v in attributes.items()
                                                    if v is not None})
            s.end(end_time=ns(max(start, stop)))
            return s

        prepared = rec.prepared or rec.arrival
        span("ember.prepare", rec.arrival, prepared)
        for i, out in enumerate(outs):
            t = out.timeline if out is not None else None
            self._engine_spans(span, i if len(outs) > 1 else None, out, t, prepared, end)
        root.end(end_time=ns(end))
        return format(root.get_span_context().trace_id, "032x")

    def _engine_spans(self, span: Any, choice: int | None, out: RequestOutput | None,
                      t: Timeline | None, prepared: float, end: float) -> None:
        """One choice's spans; a choice that never finished in the engine (the client
        left, a failure) gets what is known: its wait, up to the end."""
        if out is not None and (t is None or t.admitted_time is None):
            # it ran (it streamed) but never finished here: the client left, and the
            # engine's timeline of it stayed behind
            span("ember.engine", prepared, end,
                 **{"ember.choice": choice, "ember.incomplete": True,
                    "gen_ai.usage.output_tokens": out.completion_tokens})
            return
        if t is None or t.admitted_time is None:
            span("ember.queue", prepared, end, **{"ember.choice": choice})
            return
        finished = t.finished_time or end
        first = t.first_token_time or finished
        span("ember.queue", prepared, t.admitted_time, **{"ember.choice": choice})
        span("ember.admission", t.admitted_time, t.admitted_time,
             **{"ember.choice": choice,
                "ember.prompt.cached_tokens": out.cached_tokens if out else None,
                "ember.kv_disk.restored_bytes": t.restored_bytes})
        prefill = span("ember.prefill", t.admitted_time, first,
                       **{"ember.choice": choice, "ember.prefill.chunks": len(t.chunks),
                          "ember.prefill.tokens": sum(c[3] for c in t.chunks)})
        for began, ended, position, tokens in t.chunks:
            span("ember.prefill.chunk", began, ended, under=prefill,
                 **{"ember.chunk.start": position, "ember.chunk.tokens": tokens})
        spec = out.spec if out is not None else None
        span("ember.decode", first, finished,
             **{"ember.choice": choice, "ember.decode.steps": t.decode_steps,
                "gen_ai.usage.output_tokens": out.completion_tokens if out else None,
                "ember.spec.drafted": spec.drafted if spec else None,
                "ember.spec.accepted": spec.accepted if spec else None,
                "ember.grammar.mask_seconds": t.grammar_seconds or None})
        span("ember.respond", finished, end,
             **{"ember.choice": choice,
                "gen_ai.response.finish_reasons": [out.finish_reason or "abort"] if out else None})


def _clock() -> Any:
    """monotonic seconds -> epoch nanoseconds (this process's offset, taken now)."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset


def _log_line(rec: RequestRecord, outs: list[RequestOutput | None], status: int,
              error_type: str | None, end: float, trace_id: str | None) -> dict[str, Any]:
    done = [o for o in outs if o is not None]
    first = done[0] if done else None
    t = first.timeline if first is not None else None
    ttft = tpot = queue = None
    if t is not None and t.first_token_time is not None:
        ttft = round(t.first_token_time - rec.arrival, 6)
        if first.completion_tokens > 1 and t.finished_time is not None:
            tpot = round((t.finished_time - t.first_token_time) / (first.completion_tokens - 1), 6)
    if first is not None and first.queued_seconds is not None:
        queue = round(first.queued_seconds, 6)
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "id": first.request_id if first else None,
        "trace_id": trace_id or _incoming_trace_id(rec.carrier), "route": rec.path,
        "tenant": tenant_hash(rec.tenant), "model": rec.model, "adapter": rec.adapter,
        "status": status, "prompt_tokens": first.prompt_tokens if first else 0,
        "completion_tokens": sum(o.completion_tokens for o in done),
        "cached_tokens": first.cached_tokens if first else 0,
        "ttft_s": ttft, "tpot_s": tpot, "queue_s": queue,
        "duration_s": round(end - rec.arrival, 6),
        "finish_reason": [o.finish_reason or "abort" for o in done] or None,
        "error_type": error_type,
    }


def _incoming_trace_id(carrier: dict[str, str]) -> str | None:
    parts = carrier.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
