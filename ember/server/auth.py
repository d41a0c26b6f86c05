"""Who a request is: the tenant of its API key, and whether it holds the metrics or the
admin key. A key comes as OpenAI's clients send it (``Authorization: Bearer``) or as
Anthropic's do (``x-api-key``); both name the same tenants. Keys are kept only as
digests; a presented key is compared with every configured one in constant time, so a
response's timing tells nothing of which keys exist; only keys a client can send (RFC
9110 bearer tokens) are configured."""

from __future__ import annotations

import hmac

from fastapi import Request

from ember.server.chat_page import basic_password
from ember.server.config import ServerConfig, bearer_token, check_key, key_digest
from ember.server.errors import APIError

DEFAULT_TENANT = "default"


def presented_key(authorization: str, x_api_key: str) -> str | None:
    """The key a request presents: its bearer token, else its ``x-api-key``."""
    token = bearer_token(authorization)
    if token is None and x_api_key:
        token = bearer_token("Bearer " + x_api_key)
    return token


class Keys:
    def __init__(self, config: ServerConfig) -> None:
        for where, key in [("--api-key", k) for k in config.api_keys] + [
                ("--metrics-api-key", config.metrics_api_key),
                ("--admin-api-key", config.admin_api_key)]:
            if key is not None:
                check_key(key, where)
        self._keys = [(key_digest(k), t) for k, t in config.api_keys.items()]
        self._metrics_key = key_digest(config.metrics_api_key) if config.metrics_api_key else None
        self._admin_key = key_digest(config.admin_api_key) if config.admin_api_key else None

    def _bearer(self, request: Request) -> bytes:
        token = presented_key(request.headers.get("authorization", ""),
                              request.headers.get("x-api-key", ""))
        if token is None:
            raise APIError(401, "missing or malformed API key: send 'Authorization: Bearer "
                           "<key>' or 'x-api-key: <key>'", code="invalid_api_key")
        return key_digest(token)

    def tenant(self, request: Request) -> str:
        """The tenant of the request's API key (every key is compared: constant time)."""
        if not self._keys:
            return DEFAULT_TENANT
        tenant = self._owner(self._bearer(request))
        if tenant is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def _owner(self, digest: bytes) -> str | None:
        tenant = None
        for key, owner in self._keys:
            if hmac.compare_digest(key, digest):
                tenant = owner
        return tenant

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        """Whether raw ASGI headers hold a valid key (or none is needed)."""
        return self.tenant_of(headers) is not None

    def tenant_of(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant of raw ASGI headers' key (None: no valid key)."""
        if not self._keys:
            return DEFAULT_TENANT
        token = presented_key(headers.get(b"authorization", b"").decode("latin-1"),
                              headers.get(b"x-api-key", b"").decode("latin-1"))
        return None if token is None else self._owner(key_digest(token))

    def may_see_page(self, request: Request) -> bool:
        """Whether a request may load the chat page: no keys are configured, or it
        carries one, as a bearer key or as an HTTP Basic password (what a browser
        sends when it asks its user)."""
        if not self._keys:
            return True
        header = request.headers.get("authorization", "")
        token = bearer_token(header)
        if token is None:
            token = basic_password(header)
        return token is not None and self._owner(key_digest(token)) is not None

    def check_metrics_access(self, request: Request) -> None:
        if self._metrics_key is None:
            self.tenant(request)  # the API keys, if any
        elif not hmac.compare_digest(self._bearer(request), self._metrics_key):
            raise APIError(401, "invalid metrics API key", code="invalid_api_key")

    def check_admin(self, request: Request,
                    what: str = "loading and unloading LoRA adapters at run time") -> None:
        if self._admin_key is None:
            raise APIError(403, f"{what} needs the server started with --admin-api-key",
                             code="admin_disabled")
        if not hmac.compare_digest(self._bearer(request), self._admin_key):
            raise APIError(401, "invalid admin API key", code="invalid_api_key")
