"""Every route the server has is keyed, unless it is on the public list: enumerated from
the app itself, so a route added later without a key check fails here."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from e2e_server import serve_in_process

KEY = "sk-routes-tenant-0123456789"
ADMIN = "sk-routes-admin-0123456789"
METRICS = "sk-routes-metrics-0123456789"

# What anyone may read: the chat page's shell and assets (its API calls need a key),
# the OpenAPI description and its viewers, liveness, and Ollama's version probe (which
# its clients send before anything else and which reveals nothing of the model).
PUBLIC = {"/", "/favicon.ico", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
          "/health", "/api/version"}
# Routes keyed by the admin key, not by a tenant's.
ADMIN_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/cache"}


@pytest.fixture(scope="module")
def keyed(tiny_gguf: Path, tiny_loaded, e2e_log_dir: Path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("route-keys") / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    server = serve_in_process(tiny_gguf, e2e_log_dir, "--api-keys-file", str(keys),
                              "--admin-api-key", ADMIN, "--metrics-api-key", METRICS,
                              "--num-kv-blocks", "64", loaded=tiny_loaded)
    server.wait_ready(api_key=KEY)
    yield server
    server.stop()


def _routes(server) -> list[tuple[str, str]]:
    app = server.serving.app.app  # the FastAPI app inside its admission gate
    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, path))
    return out


def _call(server, method: str, path: str, key: str | None) -> httpx.Response:
    url = server.url + path.replace("{name}", "x").replace("{path:path}", "app.js")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {} if method in ("POST", "PUT", "PATCH") else None
    return httpx.request(method, url, headers=headers, json=body, timeout=30)


def test_every_route_is_keyed_unless_public(keyed):
    routes = _routes(keyed)
    assert len(routes) > 20  # the enumeration found the app's routes
    unkeyed = []
    for method, path in routes:
        if path in PUBLIC or path.startswith("/ui"):
            continue
        for key in (None, "sk-wrong-key"):
            r = _call(keyed, method, path, key)
            if r.status_code not in (401, 403):
                unkeyed.append((method, path, key, r.status_code))
    assert not unkeyed, unkeyed


def test_admin_routes_want_the_admin_key_not_a_tenants(keyed):
    admin = [(m, p) for m, p in _routes(keyed) if p in ADMIN_ROUTES]
    assert {p for _, p in admin} == ADMIN_ROUTES
    for method, path in admin:
        assert _call(keyed, method, path, KEY).status_code == 401, path
        assert _call(keyed, method, path, ADMIN).status_code not in (401, 403), path
    # /metrics wants its own key when one is set
    assert _call(keyed, "GET", "/metrics", KEY).status_code == 401
    assert _call(keyed, "GET", "/metrics", METRICS).status_code == 200
