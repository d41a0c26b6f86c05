"""``ember serve``'s configuration: the server's options, and the API-key and tenant-limit
files they name. A key is stored and compared only as its digest, and only a key a
client can send (an RFC 9110 bearer token) is accepted."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from ember.config import EngineConfig, InvalidConfig, TenantLimits
from ember.errors import EmberError

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    served_model_name: str | None = None
    metrics_api_key: str | None = None  # else /metrics takes the API keys, if any
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    header_timeout: float = 10.0  # seconds for a request's headers to arrive
    body_timeout: float = 60.0  # seconds for a request's whole body to arrive
    prep_threads: int = 2  # threads that decode, template and tokenize requests
    slo_ttft: float | None = None  # default seconds to first token (requests may set theirs)
    slo_tpot: float | None = None  # default seconds per output token
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights
    loras: dict[str, str] = field(default_factory=dict)  # --lora NAME=PATH, every tenant's
    admin_api_key: str | None = None  # runtime adapter (un)loading needs it
    lora_dir: str | None = None  # runtime adapters must lie under it (else: absolute paths)
    admin_timeout: float = 120.0  # seconds an admin call (an adapter load) may take (504)
    chat_page: bool = True  # the chat page at / (--no-ui: off)
    otlp_traces_endpoint: str | None = None  # export one trace per request (OTLP/HTTP)
    trace_content: bool = False  # prompt and completion text in the traces
    request_log: str | None = None  # one JSON line per finished request
    # several models behind one port (ember/server/models.py): every model's source (the
    # engine's ``model`` is then the first); empty: one model, the engine's
    models: tuple[str, ...] = ()
    models_idle: float | None = None  # unload a model idle this many seconds
    models_max_bytes: int | None = None  # loaded models' files + KV pools, at most


def load_api_keys(keys: list[str], keys_file: Path | None
                  ) -> tuple[dict[str, str], dict[str, float]]:
    """``--api-key K`` (tenant derived from the key) and a file of ``KEY [TENANT [WEIGHT]]``
    lines; returns key -> tenant and tenant -> fair-share weight (default 1)."""
    for i, key in enumerate(keys, 1):
        check_key(key, f"--api-key #{i}")
    out = {k: tenant_of_key(k) for k in keys}
    weights: dict[str, float] = {}
    if keys_file is not None:
        for n, line in enumerate(keys_file.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 3:
                raise EmberError(f"{keys_file}:{n}: expected 'KEY [TENANT [WEIGHT]]', "
                                 f"got {line!r}")
            check_key(parts[0], f"{keys_file}:{n}")
            tenant = parts[1] if len(parts) >= 2 else tenant_of_key(parts[0])
            out[parts[0]] = tenant
            if len(parts) == 3:
                weights[tenant] = _weight(parts[2], f"{keys_file}:{n}")
    return out, weights


def load_tenant_limits(path: Path) -> dict[str, TenantLimits]:
    """A file of ``TENANT key=value ...`` lines (the keys are :class:`TenantLimits`'
    fields: counts are integers, shares fractions of the pool; the tenant ``*``: every
    tenant without a line of its own); '#' starts a comment."""
    out: dict[str, TenantLimits] = {}
    known = TenantLimits.COUNTS + TenantLimits.SHARES
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        tenant, *settings = fields
        values: dict[str, float] = {}
        for setting in settings:
            key, eq, value = setting.partition("=")
            try:
                values[key] = int(value) if key in TenantLimits.COUNTS else float(value)
            except ValueError:
                eq = ""
            if key not in known or not eq:
                raise EmberError(f"{path}:{n}: expected KEY=VALUE with KEY one of "
                                 f"{', '.join(known)}, got {setting!r}")
        try:
            out[tenant] = TenantLimits(**values)  # type: ignore[arg-type]
        except InvalidConfig as e:
            raise EmberError(f"{path}:{n}: {e}") from None
    return out


def _weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = 0.0
    if not weight > 0 or weight != weight or weight == float("inf"):
        raise EmberError(f"{where}: the weight must be a positive number, got {text!r}")
    return weight


# RFC 9110 token68: what a bearer credential may hold. A key is compared byte for byte
# with what the client sent, never after stripping (Python's str.strip also removes
# NBSP, NEL and other Unicode spaces, which would make "KEY\xa0" the key).
_TOKEN68 = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def check_key(key: str, where: str) -> None:
    """Refuse a configured key no client can send as a bearer token (not token68)."""
    if not _TOKEN68.fullmatch(key):
        raise EmberError(f"{where}: an API key must be a bearer token: letters, digits and "
                         "-._~+/ with '=' only at the end (RFC 9110 token68)")


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token68>`` header value, exactly as
    sent (the HTTP parser already dropped the spaces and tabs around the value); None
    if the header is anything else."""
    scheme, sep, token = authorization.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    token = token.lstrip(" ")  # 1*SP between the scheme and the token
    return token if _TOKEN68.fullmatch(token) else None


def tenant_of_key(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
