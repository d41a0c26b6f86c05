"""Errors as the HTTP API answers them, and the engine's errors translated to them.

Every refusal is an :class:`APIError`: status, message, type, param and code as
OpenAI's API sends them. The engine names parameters its own way (``max_tokens``,
``structured``); :func:`as_api_errors` names them as the request did
(``max_completion_tokens``, ``response_format``), from the engine error's fields —
never by editing its text.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from ember.engine.admission import QueueFull, TenantQueueFull, Unattainable
from ember.engine.intake import InvalidRequest
from ember.engine.output import RequestOutput
from ember.engine.thread import EngineStopped

RETRY_AFTER_SECONDS = 1  # what a 429 for a full queue asks the client to wait


class APIError(Exception):
    """An error answered as OpenAI does: status, message, type, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def unsupported(param: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def overloaded(why: str) -> APIError:
    return APIError(429, f"server overloaded: {why}; retry later", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def slo_unattainable(why: str, late: float | None) -> APIError:
    """A request refused because it would miss its TTFT objective by ``late`` seconds
    (wherever that was decided: the HTTP gate, preparation, the engine)."""
    wait = max(1, math.ceil(late or 1))
    return APIError(429, f"server overloaded: {why}; retry after {wait} s",
                    type="rate_limit_error", code="slo_unattainable",
                    headers={"Retry-After": str(wait)})


def unattainable(out: RequestOutput) -> APIError:
    """A request the engine rejected because it would miss its TTFT objective."""
    return slo_unattainable(out.error or "", out.retry_after)


def failure(out: RequestOutput, names: dict[str, str]) -> APIError:
    """A request that failed during generation: 400 when its own parameter was at
    fault (a grammar the model's tokens cannot satisfy), else 500."""
    if out.error_param:
        param = names.get(out.error_param, out.error_param)
        return APIError(400, f"{param}: {out.error}", param=param,
                        code="invalid_request_during_generation")
    return APIError(500, f"generation failed: {out.error}", type="server_error")


@contextlib.contextmanager
def as_api_errors(names: dict[str, str]) -> Iterator[None]:
    """Engine admission errors as HTTP errors; ``names`` maps the engine's parameter
    names to the request's."""
    try:
        yield
    except Unattainable as e:
        raise slo_unattainable(str(e), e.retry_after) from None
    except TenantQueueFull as e:
        raise APIError(429, f"{e}; retry later", type="rate_limit_error",
                       code="tenant_queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except QueueFull as e:
        raise overloaded(str(e)) from None
    except InvalidRequest as e:
        param = names.get(e.param, e.param)
        raise APIError(400, e.describe(param), param=param) from None
    except EngineStopped as e:
        raise APIError(503, str(e), type="server_error", code="shutting_down") from None
