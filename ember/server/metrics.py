"""The server's Prometheus metrics (the text format itself: :mod:`ember.prometheus`).

Counters and histograms are updated from the event loop; engine gauges are read
from the engine when ``/metrics`` is scraped.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ember.prometheus import Histogram, family


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]],
                 extra: Callable[[], list[str]] = lambda: [],
                 model_name: Callable[[], str] = lambda: "",
                 max_loras: int = 0) -> None:
        self._engine_stats = engine_stats
        self._model_name, self._max_loras = model_name, max_loras
        self._extra = extra  # more families (the replicas' and the router's)
        self._lock = threading.Lock()
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("ember_inter_token_latency_seconds",
                             "Time between consecutive streamed outputs of a request.")
        self.e2e = Histogram("ember_e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = Histogram("ember_request_queue_time_seconds",
                               "Time from arrival to admission into the running batch.")
        self.slo_met = 0
        self.slo_missed = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected_429 = 0
        self.client_aborts = 0
        self.slow_connections_closed = 0
        self.finished: dict[str, int] = defaultdict(int)
        self.http: dict[tuple[str, int], int] = defaultdict(int)

    def observe_request(self, ttft: float | None, itls: list[float], e2e: float,
                        prompt_tokens: int, generation_tokens: int, finish_reason: str,
                        queued: float | None = None) -> None:
        with self._lock:
            if queued is not None:
                self.queue.observe(queued)
            if ttft is not None:
                self.ttft.observe(ttft)
            for x in itls:
                self.itl.observe(x)
            self.e2e.observe(e2e)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.finished[finish_reason] += 1

    def observe_slo(self, met: bool) -> None:
        """A finished request that had objectives: did its client see them met?"""
        with self._lock:
            if met:
                self.slo_met += 1
            else:
                self.slo_missed += 1

    def count_http(self, route: str, status: int) -> None:
        with self._lock:
            self.http[(route, status)] += 1
            if status == 429:
                self.rejected_429 += 1

    def count_client_abort(self, route: str) -> None:
        """A client that disconnected before its response was complete (HTTP 499)."""
        with self._lock:
            self.http[(route, 499)] += 1
            self.client_aborts += 1

    def count_slow_close(self) -> None:
        """A connection closed because its request headers did not arrive in time."""
        with self._lock:
            self.slow_connections_closed += 1

    def render(self) -> str:
        s = self._engine_stats()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, value: Any) -> None:
            lines.extend(family(name, kind, help, [("", value)]))

        metric("ember_requests_running", "gauge", "Requests being decoded or prefilled.",
               s.get("requests_running", 0))
        metric("ember_requests_waiting", "gauge", "Requests waiting for admission.",
               s.get("requests_waiting", 0))
        metric("ember_kv_blocks_used", "gauge", "KV blocks held by requests.",
               s.get("kv_blocks_used", 0))
        metric("ember_kv_blocks_total", "gauge", "KV blocks in the pool.",
               s.get("kv_blocks_total", 0))
        metric("ember_prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache.", s.get("prefix_cache_queries", 0))
        metric("ember_prefix_cache_hits_total", "counter",
               "Prompt tokens served from the prefix cache.", s.get("prefix_cache_hits", 0))
        metric("ember_preemptions_total", "counter", "Requests preempted for KV space.",
               s.get("preemptions", 0))
        metric("ember_tpot_plan_scale", "gauge", "Share of the TPOT objectives the "
               "scheduler plans steps to, corrected by what finished requests got (1: "
               "as predicted; ember/engine/pace.py).", s.get("pace_scale", 1.0))
        lines += _disk_lines(s.get("kv_disk"))
        lines += _moe_lines(s.get("moe"))
        lines += _lora_lines(s.get("lora"))
        lines += self._extra()
        spec = s.get("spec", {"sources": {}, "bonus": 0, "steps": {}})
        for i, what in ((0, "drafted"), (1, "accepted")):
            lines += family(f"ember_spec_{what}_tokens_total", "counter",
                            f"Draft tokens {what} (finished requests), per source.",
                            [(f'{{source="{_label(src)}"}}', counts[i])
                             for src, counts in sorted(spec["sources"].items())])
        metric("ember_spec_bonus_tokens_total", "counter",
               "Tokens committed after a fully accepted draft.", spec["bonus"])
        lines += family("ember_spec_steps_total", "counter",
                        "Decode steps of speculating requests, by what they did (verify, "
                        "fallback: nothing to draft, off: gate declined).",
                        [(f'{{kind="{k}"}}', n) for k, n in sorted(spec["steps"].items())])
        tenants = {tenant_hash(t): c for t, c in s.get("tenants", {}).items()}
        for name, what in _TENANT_GAUGES:
            lines += family(f"ember_tenant_{name}", "gauge", f"{what}, per tenant (labelled "
                            "by its hash: ember.server.metrics.tenant_hash).",
                            [(f'{{tenant="{t}"}}', c.get(name, 0))
                             for t, c in sorted(tenants.items())])
        metric("ember_prefill_tokens_total", "counter",
               "Prompt tokens computed by the model (tokens served from cache excluded).",
               s.get("prompt_tokens", 0))
        with self._lock:
            metric("ember_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   self.prompt_tokens)
            metric("ember_generation_tokens_total", "counter",
                   "Tokens generated for finished requests.", self.generation_tokens)
            metric("ember_rejected_requests_total", "counter",
                   "Requests refused with 429 (queue full).", self.rejected_429)
            metric("ember_slo_met_total", "counter",
                   "Finished requests with objectives whose client saw them met.",
                   self.slo_met)
            metric("ember_slo_missed_total", "counter",
                   "Requests with objectives that missed them (late, failed or cut short).",
                   self.slo_missed)
            metric("ember_client_disconnects_total", "counter",
                   "Requests whose client disconnected before the response was complete.",
                   self.client_aborts)
            metric("ember_slow_connections_closed_total", "counter",
                   "Connections closed because request headers did not arrive in time.",
                   self.slow_connections_closed)
            reasons = sorted(set(self.finished) | {"stop", "length", "abort", "error"})
            lines += family("ember_request_finished_total", "counter",
                            "Finished requests by finish reason.",
                            [(f'{{finish_reason="{r}"}}', self.finished.get(r, 0))
                             for r in reasons])
            lines += family("ember_http_responses_total", "counter",
                            "HTTP responses by route and status.",
                            [(f'{{route="{route}",status="{status}"}}', n)
                             for (route, status), n in sorted(self.http.items())])
            for h in (self.ttft, self.itl, self.e2e, self.queue):
                lines += h.render()
            lines += self._vllm_lines(s)
        return "\n".join(lines) + "\n"

    def _vllm_lines(self, s: dict[str, Any]) -> list[str]:
        """The same figures under the names vLLM exports, labelled ``model_name``: what
        routers that score replicas scrape (llm-d's inference scheduler, the Gateway
        API inference extension, KServe, the vLLM production stack). Caller holds the
        lock."""
        model = f'model_name="{_label(self._model_name())}"'
        total = s.get("kv_blocks_total", 0)
        usage = s.get("kv_blocks_used", 0) / total if total else 0.0
        lines: list[str] = []
        values = {**s, "kv_usage": usage, "prompt_tokens_finished": self.prompt_tokens,
                  "generation_tokens_finished": self.generation_tokens}
        for name, kind, key, help in _VLLM_SERIES:
            lines += family(f"vllm:{name}", kind, help, [(f"{{{model}}}", values.get(key, 0))])
        running, waiting = (",".join(s.get(k, [])) for k in ("lora_running", "lora_waiting"))
        lines += family("vllm:lora_requests_info", "gauge",
                        "Adapters of running and waiting requests (value: the time of the "
                        "scrape, as vLLM sets it).",
                        [(f'{{max_lora="{self._max_loras}",running_lora_adapters='
                          f'"{_label(running)}",waiting_lora_adapters="{_label(waiting)}"}}',
                          time.time())])
        lines += family("vllm:request_success_total", "counter", "Finished requests by "
                        "finish reason.", [(f'{{finished_reason="{r}",{model}}}', n)
                                           for r, n in sorted(self.finished.items())])
        for h, name in ((self.ttft, "time_to_first_token_seconds"),
                        (self.itl, "inter_token_latency_seconds"),
                        (self.e2e, "e2e_request_latency_seconds"),
                        (self.queue, "request_queue_time_seconds")):
            lines += h.render(f"vllm:{name}", model)
        return lines


# vLLM's name, its type, the ember figure it carries (a key of the engine's stats, or
# of what _vllm_lines adds to them), and its help
_VLLM_SERIES = (
    ("num_requests_running", "gauge", "requests_running",
     "Requests running (ember_requests_running)."),
    ("num_requests_waiting", "gauge", "requests_waiting",
     "Requests waiting (ember_requests_waiting)."),
    ("kv_cache_usage_perc", "gauge", "kv_usage", "Share of KV blocks in use, 0-1."),
    ("gpu_cache_usage_perc", "gauge", "kv_usage", "The same share, under the name vLLM "
     "used before 0.10 (read by older routers), on CPU too."),
    ("prefix_cache_queries_total", "counter", "prefix_cache_queries",
     "Prompt tokens looked up."),
    ("prefix_cache_hits_total", "counter", "prefix_cache_hits",
     "Prompt tokens served from cache."),
    ("num_preemptions_total", "counter", "preemptions", "Requests preempted."),
    ("prompt_tokens_total", "counter", "prompt_tokens_finished",
     "Prompt tokens of finished requests."),
    ("generation_tokens_total", "counter", "generation_tokens_finished",
     "Generated tokens of finished requests."),
)

_TENANT_GAUGES = (
    ("requests_running", "Requests running"), ("requests_waiting", "Requests waiting"),
    ("kv_blocks", "KV blocks its running requests hold"),
    ("cached_blocks", "Prefix-cache blocks held (the cache evicts from the tenant holding "
                      "the most first)"),
    ("disk_bytes", "Disk-tier bytes stored"),
    ("adapters", "LoRA adapters resident on its account (its requests used them last)"))


def tenant_hash(tenant: str) -> str:
    """How a tenant is named in metrics and logs: the first 16 hex digits of the SHA-256
    of ``ember-tenant:`` + its name (so a dashboard or an export does not carry tenant
    names; an operator who knows a name can compute its hash)."""
    return hashlib.sha256(b"ember-tenant:" + tenant.encode()).hexdigest()[:16]


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_DISK_COUNTERS = (
    ("hits", "Blocks read from the KV disk tier and verified."),
    ("misses", "KV disk tier lookups it could not serve."),
    ("bytes_read", "Bytes read from the KV disk tier."),
    ("bytes_written", "Bytes written to the KV disk tier."),
    ("corrupt", "KV disk blocks that failed to verify (deleted)."),
    ("evicted", "KV disk blocks deleted to stay within --kv-disk-bytes."),
    ("dropped", "KV blocks not written because the write queue was full."),
    ("restored_snapshots", "Recurrent-state snapshots read from the KV disk tier (hybrid "
                           "models)."),
)


def _moe_lines(m: dict[str, Any] | None) -> list[str]:
    """The expert store's metrics (a mixture-of-experts model only)."""
    if m is None:
        return []
    lines = family("ember_moe_expert_lookups_total", "counter",
                   "Experts a step needed, by where they were: pinned, lru (cache hits) or "
                   "miss (read from the file).",
                   [(f'{{result="{k}"}}', m[key]) for k, key in
                    (("pinned", "pinned_hits"), ("lru", "lru_hits"), ("miss", "misses"))])
    for key, kind, help in (
            ("bytes_read", "counter", "Expert bytes read from the model file."),
            ("tokens_routed", "counter", "Token-to-expert assignments routed."),
            ("hit_rate", "gauge", "Share of expert lookups served from the cache."),
            ("cached_bytes", "gauge", "Resident bytes of built experts."),
            ("pilot_reads", "counter", "Experts the pilot read ahead (--moe-pilot)."),
            ("pilot_used", "counter", "Of those, experts their layer then needed."),
            ("pilot_recall", "gauge", "Share of the experts layers needed that the pilot "
                                      "had guessed.")):
        if m.get(key) is None:  # no guesses yet: no recall to give
            continue
        name = f"ember_moe_{key}" + ("_total" if kind == "counter" else "")
        lines += family(name, kind, help, [("", m[key])])
    return lines


def _lora_lines(m: dict[str, Any] | None) -> list[str]:
    """Per LoRA adapter: requests, generated tokens, loads and evictions (none without
    adapters)."""
    if m is None:
        return []
    lines = []
    adapters = sorted(m["adapters"].items())
    for key, help in (("requests", "Requests run with the adapter."),
                      ("tokens", "Tokens generated with the adapter (finished requests)."),
                      ("loads", "Times the adapter was read from its file."),
                      ("evictions", "Times the adapter was evicted (over --max-loras).")):
        lines += family(f"ember_lora_{key}_total", "counter", help,
                        [(f'{{adapter="{_label(n)}"}}', c[key]) for n, c in adapters])
    lines += family("ember_lora_resident", "gauge", "LoRA adapters resident in memory.",
                    [("", m["resident"])])
    lines += family("ember_lora_resident_bytes", "gauge", "Bytes of resident LoRA adapters.",
                    [("", m["resident_bytes"])])
    return lines


def _disk_lines(d: dict[str, Any] | None) -> list[str]:
    """The disk tier's metrics (none without ``--kv-cache-dir``)."""
    if d is None:
        return []
    lines = []
    for key, help in _DISK_COUNTERS:
        lines += family(f"ember_kv_disk_{key}_total", "counter", help, [("", d[key])])
    lines += family("ember_kv_disk_decisions_total", "counter",
                    "Runs of disk blocks restored or recomputed, by measured cost.",
                    [(f'{{decision="{k}"}}', n) for k, n in sorted(d["decisions"].items())])
    for key, help in (("blocks", "Blocks in the KV disk tier."),
                      ("bytes", "Bytes in the KV disk tier."),
                      ("read_bytes_per_second", "Measured KV disk restore bandwidth.")):
        value = d[key] if isinstance(d[key], int) else f"{d[key]:.0f}"
        lines += family(f"ember_kv_disk_{key}", "gauge", help, [("", value)])
    return lines
