"""Which weight formats and KV dtypes a model may use: the records ``ember eval`` keeps.

Each record is one (model checksum, weight format, KV dtype) measurement of drift
from the f32 reference. An engine refuses a pair whose recorded KL exceeds
:data:`MAX_KL` or whose top-1 agreement is below :data:`MIN_TOP1`, unless told to
allow drift. ember ships the measurements of its registered models
(``ember/data/validation.json``); a user's own ``ember eval`` (recorded in
``$EMBER_HOME/validation.json``) overrides them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ember.models.files import ember_home

MAX_KL = 0.05  # mean KL(f32 ‖ format) in nats above which a format is refused
MIN_TOP1 = 0.90  # teacher-forced top-1 agreement with f32 below which it is refused
SHIPPED = Path(__file__).parents[1] / "data" / "validation.json"


@dataclass
class Drift:
    weights: str
    kv_dtype: str
    tokens: int  # positions scored
    perplexity: float
    kl: float
    top1: float
    max_drift: float
    bytes_per_weight: float
    decode_tok_s: float | None = None


def model_sha(loaded: Any) -> str:
    """The model file's sha256 (the registry's for a registered file: no hashing)."""
    return loaded.fingerprint().rsplit(":", 1)[0]


def _user_records() -> Path:
    return ember_home() / "validation.json"


def _key(model_sha: str, weights: str, kv_dtype: str) -> str:
    return f"{model_sha}:{weights}:{kv_dtype}"


def record(model_sha: str, rows: list[Drift], path: Path | None = None) -> Path:
    """Add ``rows`` to the records ``check_drift`` reads (the user's file by default)."""
    path = path or _user_records()
    data = json.loads(path.read_text()) if path.exists() else {}
    for r in rows:
        data[_key(model_sha, r.weights, r.kv_dtype)] = asdict(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def recorded(model_sha: str, weights: str, kv_dtype: str) -> dict[str, Any] | None:
    """The measurement of this pair: the user's own, else the shipped one, else None."""
    key = _key(model_sha, weights, kv_dtype)
    for path in (_user_records(), SHIPPED):
        try:
            found = json.loads(path.read_text()).get(key)
        except (FileNotFoundError, ValueError):
            continue
        if found is not None:
            return found
    return None


def check_drift(model_sha: str, weights: str, kv_dtype: str) -> str | None:
    """Why this pair must not be used (its recorded drift crosses a threshold), or None
    (within the thresholds, or never measured)."""
    m = recorded(model_sha, weights, kv_dtype)
    if m is None:
        return None
    if m["kl"] > MAX_KL or m["top1"] < MIN_TOP1:
        return (f"weights {weights!r} with KV {kv_dtype!r} drift too far from f32 on this "
                f"model: measured KL {m['kl']:.4f} (limit {MAX_KL}) and top-1 agreement "
                f"{m['top1']:.1%} (limit {MIN_TOP1:.0%}) by `ember eval`; pass "
                "--allow-drift (allow_drift=True) to use them anyway")
    return None
