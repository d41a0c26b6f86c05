"""What arrives over the wire, checked before any real work: bodies, JSON, slow and
vanished clients.

- :func:`read_body` accepts only JSON content types (a web page cannot POST JSON to
  a key-less local server cross-origin without a CORS preflight, which ember never
  answers), refuses a body over the size limit (413) — keeping none of it, but
  reading and dropping the rest first, so that an uploading client can read the 413
  instead of a connection reset — and gives the whole body a deadline (408), so a
  slow sender cannot hold a request open.
- :func:`decode_json` turns the bytes into Python values and refuses, naming the
  field, what would break later layers: nesting deeper than :data:`MAX_JSON_DEPTH`
  (recursive code downstream) and lone UTF-16 surrogates (they cannot be encoded
  as UTF-8, so they could be neither tokenized nor echoed back).
- :func:`disconnected` resolves when the client goes away, so a request whose
  client left is aborted at the next engine step, streamed or not.
- :func:`guarded_protocol` closes connections whose request headers do not
  arrive within a deadline (uvicorn has none: 1,000 clients sending a header byte
  now and then would otherwise stay connected for ever).
- :func:`dumps` / :class:`JSONBody` render JSON that always encodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ember.server.errors import APIError

log = logging.getLogger("ember.server")

MAX_JSON_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The request body, or an APIError: 415 (not JSON), 413 (too large), 408 (too slow)."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                       f"got {content_type or 'no Content-Type'!r}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    stream = request.stream()
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if int(declared) <= MAX_DRAINED_BYTES and not _expects_continue(request):
            await _drain(stream)
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes:
                    break
                chunks.append(chunk)
            else:
                return b"".join(chunks)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone() from None
    await _drain(stream)
    raise _too_large(size, max_bytes)


# An oversized body is read and dropped before the 413 (up to this much, while it keeps
# arriving): a server that answers and closes while the client is still uploading
# resets the connection, and most clients then report the reset, not the 413. A client
# that sent "Expect: 100-continue" has not sent the body: it gets the 413 at once.
# Draining has its own bounds, as nginx's lingering close does, not --body-timeout: a
# tight body deadline meant for bodies the server keeps would cut an upload that is
# still arriving steadily, and its client would read a reset instead of the 413.
MAX_DRAINED_BYTES = 64 * 1024 * 1024
DRAIN_SECONDS = 10.0
DRAIN_FIRST_BYTE_SECONDS = 1.0  # a sender that declared a body but sends none is waiting
DRAIN_IDLE_SECONDS = 5.0  # an uploading sender silent this long has stalled: stop waiting


def replay_body(raw: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the body already read over once, then waits as the
    original does (for the client's disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def drain_request(scope: dict[str, Any], receive: Any) -> None:
    """Read and drop a raw ASGI request's body before answering it without reading it
    (see MAX_DRAINED_BYTES), unless it expects a 100 Continue."""
    headers = dict(scope.get("headers", []))
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return

    async def chunks() -> Any:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    await _drain(chunks())


def _expects_continue(request: Request) -> bool:
    return request.headers.get("expect", "").lower() == "100-continue"


async def _drain(stream: Any) -> None:
    """Read and drop the rest of a body, until it ends, MAX_DRAINED_BYTES have come,
    DRAIN_SECONDS pass, or the sender pauses (DRAIN_FIRST_BYTE_SECONDS before its first
    byte, DRAIN_IDLE_SECONDS once it is uploading)."""
    loop = asyncio.get_running_loop()
    deadline, drained = loop.time() + DRAIN_SECONDS, 0
    while drained <= MAX_DRAINED_BYTES:
        left = deadline - loop.time()
        if left <= 0:
            return
        idle = DRAIN_IDLE_SECONDS if drained else DRAIN_FIRST_BYTE_SECONDS
        try:
            async with asyncio.timeout(min(left, idle)):
                drained += len(await anext(stream))
        except (TimeoutError, StopAsyncIteration, ClientDisconnect):
            return


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {'at least ' if size > limit else ''}{size} "
                    f"bytes; this server accepts at most {limit} (--max-request-bytes)",
                    code="request_too_large", headers={"Connection": "close"})


def decode_json(raw: bytes) -> Any:
    """Parse a request body; errors are 400s that say what and where."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep("the body") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    # Both walks below are skipped by a byte scan when they cannot find anything.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(body)
    if _SURROGATE_ESCAPE.search(raw):
        _check_strings(body, "")
    return body


def _too_deep(where: str) -> APIError:
    return APIError(400, f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels",
                    param=None if where == "the body" else where)


def _check_depth(body: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH, naming the top-level field it is in."""
    stack = [(body, 1, "")]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(field or "the body")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, field or str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, field) for v in value)


def _check_strings(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"'{path or 'body'}' contains a lone UTF-16 surrogate "
                           "(invalid Unicode)", param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, _join(path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def disconnected(request: Request) -> asyncio.Future[None]:
    """A task that finishes when the client disconnects (call after the body is read).

    ASGI servers answer ``receive()`` with ``http.disconnect`` once the client is gone
    (or the response is complete); cancel the task when the request is over.
    """
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


# what a logprob of minus infinity (a token no processor allows) is written as: the
# number OpenAI's API and vLLM answer with, as RFC 8259 JSON has no infinities
LOGPROB_FLOOR = -9999.0


def dumps(obj: Any) -> str:
    """JSON text that always encodes as UTF-8 (lone surrogates, if any, are escaped) and
    is always valid JSON: a non-finite number is never written (``-inf`` becomes
    ``LOGPROB_FLOOR``, ``inf`` its opposite, ``NaN`` null)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: the rare path
        obj = _finite(obj)
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else math.copysign(-LOGPROB_FLOOR, obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class JSONBody(JSONResponse):
    """A JSON response rendered with :func:`dumps`."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def guarded_protocol(header_timeout: float,
                     on_slow_close: Callable[[], None] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, plus a deadline for each request's headers.

    The C parser (httptools) when it is installed: in a burst of 200 requests, h11's
    pure-Python parsing is most of what the last one in line waits for. The deadline
    starts when a connection opens and when a request's first byte arrives, and is
    cleared once its headers are complete, so a long response is never cut; idle
    kept-alive connections are closed by uvicorn's keep-alive timeout.
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is a dependency
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # httptools' parser callbacks
        def on_message_begin(self) -> None:
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        # h11: a new cycle means a request's headers arrived; re-arm for the next one
        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:
                self._disarm()

        def on_response_complete(self) -> None:
            if not hasattr(self, "parser"):  # h11 (httptools re-arms at the next byte)
                self._arm()
            super().on_response_complete()  # h11 may start a pipelined request at once

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _too_slow(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                log.debug("closed a connection from %s: no complete request headers "
                          "within %g s", self.client, header_timeout)
                self.transport.close()
                if on_slow_close is not None:
                    on_slow_close()

    return GuardedProtocol
