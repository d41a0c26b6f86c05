"""Send a workload to an OpenAI-compatible endpoint and time every request.

Each request is streamed; its record holds when it was sent, when the first token
arrived (the first chunk with content), when each later chunk arrived and when the
stream ended, how many tokens were generated (``usage`` when the server sends it,
else the number of content chunks) and how it ended: ``ok``, ``rejected`` (429),
``failed`` (any other status, a broken stream, a connection error) or ``timeout``.

Arrivals are open loop (sent at their scheduled times whatever the server does, so
an overloaded server builds a queue, as real users do) or, with ``concurrency``,
closed loop (N clients, each sending its next request when the last one ended).

While a run is open loop it watches for over-saturation: when the requests still
waiting for a first token have been waiting more than ``saturation_factor`` times
the TTFT objective, and are more than a fifth of those sent, it stops sending (the
rest of the step could only measure an ever-growing queue) and says so.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from ember.bench.traffic import Workload


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (``/v1`` is added)
    model: str = "default"
    api_keys: list[str] = field(default_factory=list)  # one per tenant; none: no auth
    label: str = ""

    def headers(self, tenant: int) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_keys:
            h["Authorization"] = f"Bearer {self.api_keys[tenant % len(self.api_keys)]}"
        return h


@dataclass
class RequestRecord:
    scheduled: float  # seconds from the run's start
    sent: float
    tenant: int
    kind: str
    status: str = "failed"  # ok | rejected | failed | timeout
    http_status: int | None = None
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # content chunks after the first
    retry_after: str | None = None
    error: str = ""
    turn: int = 0  # 0: a conversation's first request; n: its n-th follow-up
    prompt_tokens: int = 0  # from the final usage chunk, when the server sends one
    cached_tokens: int = 0  # of those, served from the prefix cache

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None for one-token replies)."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = [self.first_token, *self.chunk_times] if self.first_token else []
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.sent

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("chunk_times")
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


@dataclass
class RunResult:
    records: list[RequestRecord]
    started: float  # monotonic clock at the run's start
    duration: float  # from the start until the last request ended
    saturated: bool = False
    planned: int = 0  # requests the trace held (more than were sent if saturated)


async def _send(client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any],
                record: RequestRecord, t0: float, timeout: float) -> str | None:
    """Stream one request into ``record``; returns the reply text when it succeeded."""
    parts: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{endpoint.url}/v1/chat/completions", json=body,
                                     headers=endpoint.headers(record.tenant)) as r:
                record.http_status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    record.status = "rejected" if r.status_code == 429 else "failed"
                    record.retry_after = r.headers.get("retry-after")
                    record.error = r.text[:200]
                    record.end = time.monotonic() - t0
                    return None
                usage_tokens = await _read_stream(r, record, parts, t0)
        record.end = time.monotonic() - t0
        record.output_tokens = usage_tokens or (len(record.chunk_times)
                                                + (record.first_token is not None))
        record.status = "ok" if record.first_token is not None else "failed"
        return "".join(parts) if record.status == "ok" else None
    except TimeoutError:
        record.status, record.error = "timeout", f"no complete reply within {timeout:g} s"
    except (httpx.HTTPError, ValueError) as e:
        record.status, record.error = "failed", f"{type(e).__name__}: {e}"[:200]
    record.end = time.monotonic() - t0
    return None


async def _read_stream(r: httpx.Response, record: RequestRecord, parts: list[str],
                       t0: float) -> int | None:
    usage = None
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"].get("completion_tokens")
            record.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
            details = chunk["usage"].get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.monotonic() - t0
                if record.first_token is None:
                    record.first_token = now
                else:
                    record.chunk_times.append(now)
                parts.append(content)
    return usage


async def run(endpoint: Endpoint, workload: Workload, times: list[float] | None = None, *,
              concurrency: int | None = None, num_requests: int = 0, timeout: float = 120.0,
              slo_ttft: float | None = None, saturation_factor: float = 3.0) -> RunResult:
    """Send ``workload`` at ``times`` (open loop) or with ``concurrency`` clients."""
    workload.model = endpoint.model
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30),
                                 limits=limits) as client:
        t0 = time.monotonic()
        records: list[RequestRecord] = []

        async def one(scheduled: float) -> None:
            conv = workload.next()
            record = RequestRecord(scheduled, time.monotonic() - t0, conv.tenant, conv.kind,
                                   turn=sum(m["role"] == "assistant" for m in conv.messages))
            records.append(record)
            reply = await _send(client, endpoint, workload.body(conv), record, t0, timeout)
            workload.finish(conv, reply)

        saturated = False
        if concurrency:
            async def worker(k: int) -> None:
                while len(records) < num_requests:
                    await one(time.monotonic() - t0)

            await asyncio.gather(*(worker(k) for k in range(concurrency)))
            planned = num_requests
        else:
            assert times is not None
            planned = len(times)
            tasks = []
            for scheduled in times:
                delay = scheduled - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if slo_ttft and _oversaturated(records, time.monotonic() - t0,
                                               slo_ttft * saturation_factor):
                    saturated = True
                    break
                tasks.append(asyncio.ensure_future(one(scheduled)))
            await asyncio.gather(*tasks)
        ends = [r.end for r in records if r.end is not None]
        return RunResult(records, t0, max(ends, default=0.0), saturated, planned)


def _oversaturated(records: list[RequestRecord], now: float, patience: float) -> bool:
    """More than a fifth of the requests sent (and at least 8) have waited ``patience``
    seconds without a first token."""
    stuck = sum(1 for r in records
                if r.first_token is None and r.end is None and now - r.sent > patience)
    return stuck >= max(8, len(records) // 5)
