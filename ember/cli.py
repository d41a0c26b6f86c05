"""The ``ember`` command: pull, models, inspect, tokenize, generate, chat, serve, eval, bench.

Every expected failure (missing or corrupt file, unknown alias, bad option) ends as
one ``ember: error: ...`` line on stderr and exit status 1 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ember.bench.traffic import WORKLOADS
from ember.errors import EmberError
from ember.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from ember.server.config import ServerConfig

# ember.kv.dtypes.KV_DTYPES' names, spelled out: importing it here would load torch for
# every command, --help included (tests/test_cli.py checks they agree)
KV_DTYPE_CHOICES = ("f32", "f16", "bf16", "q8_0")


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (EmberError, ValueError, OSError) as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    """The parser: each subcommand's options are defined beside its command."""
    p = argparse.ArgumentParser(prog="ember", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_pull_parser, _models_parser, _inspect_parser, _tokenize_parser,
                _generate_parser, _chat_parser, _serve_parser, _eval_parser):
        add(sub)
    bench = sub.add_parser("bench", help="benchmarks (print figures, write JSON)"
                           ).add_subparsers(dest="bench", required=True)
    for add in (_bench_throughput_parser, _bench_constrained_parser, _bench_serve_parser,
                _bench_simulate_parser, _bench_spec_parser, _bench_kv_parser,
                _bench_isolation_parser, _bench_lora_parser, _bench_moe_parser,
                _bench_synth_parser, _bench_spec_cost_parser, _bench_compare_parser,
                _bench_embed_parser, _bench_switch_parser):
        add(bench)
    return p

def _add_kv_flags(s: argparse.ArgumentParser) -> None:
    """The disk tier's flags (``--kv-dtype`` is one of every engine's: _model_args)."""
    s.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="keep prefix-cache blocks on disk here: they outlive eviction "
                        "and restarts (docs/kv-cache.md)")
    s.add_argument("--kv-disk-bytes", type=byte_size, default=16 * 1024**3,
                   help="the disk tier's budget; least recently used blocks go beyond it")
    s.add_argument("--kv-fsync", default="batch", choices=("always", "batch", "never"),
                   help="when disk blocks are fsynced (a crash never leaves a torn "
                        "block served, whatever the choice)")
    s.add_argument("--kv-restore", default="auto", choices=("auto", "always"),
                   help="auto: restore from disk only where faster than recomputing")
    s.add_argument("--state-snapshot-bytes", type=byte_size, default=256 * 1024**2,
                   help="hybrid models (Qwen 3.5): room for snapshots of recurrent state, "
                        "without which their cached prefixes cannot be used (0: no prefix "
                        "reuse for them; default 256M)")
    s.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV-cache events in vLLM's wire format on a ZMQ PUB socket "
                        "bound here, for routers that route by prefix (llm-d, Dynamo; "
                        "docs/scaling.md)")
    s.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="with --kv-events-endpoint: a ROUTER socket replaying missed "
                        "event batches from a sequence number")
    s.add_argument("--kv-events-topic", default="",
                   help="the topic frame of each published batch (default: empty)")



def _loras(specs: list[str]) -> dict[str, str]:
    """``--lora NAME=PATH`` flags as name -> path (a name given twice is refused)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora wants NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora {name!r} given twice")
        out[name] = path
    return out

def _kv_options(args: argparse.Namespace) -> dict:
    return dict(kv_dtype=args.kv_dtype, kv_cache_dir=args.kv_cache_dir,
                kv_disk_bytes=args.kv_disk_bytes, kv_fsync=args.kv_fsync,
                kv_restore=args.kv_restore, state_snapshot_bytes=args.state_snapshot_bytes,
                kv_events_endpoint=args.kv_events_endpoint,
                kv_events_replay_endpoint=args.kv_events_replay_endpoint,
                kv_events_topic=args.kv_events_topic)


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("eval", help="drift of each weight format and KV dtype from f32")
    s.add_argument("--model", "-m", default=DEFAULT_MODEL)
    s.add_argument("--weights", default="f32,bf16,q4", help="comma-separated weight formats")
    s.add_argument("--kv-dtype", default="f32,f16,bf16,q8_0", help="comma-separated KV dtypes")
    s.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    s.add_argument("--decode-tokens", type=int, default=64,
                   help="tokens of the decode-speed run (0: skip it)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--out", type=Path, default=Path("bench-results/eval.json"))
    s.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from ember.eval import main as eval_main
    from ember.kv.blocks import KV_DTYPES
    from ember.models.linear import WEIGHT_FORMATS

    weights = [w for w in args.weights.split(",") if w]
    kv = [d for d in args.kv_dtype.split(",") if d]
    for w in weights:
        if w not in WEIGHT_FORMATS:
            raise ValueError(f"--weights: {w!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    for d in kv:
        if d not in KV_DTYPES:
            raise ValueError(f"--kv-dtype: {d!r} is not one of {', '.join(KV_DTYPES)}")
    if args.window < 2 or args.decode_tokens < 0:
        raise ValueError("--window must be at least 2 and --decode-tokens at least 0")
    eval_main(args.model, weights, kv, args.window, args.decode_tokens, args.threads, args.out)
    return 0


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ember serve`` options as a :class:`~ember.server.config.ServerConfig` (its
    ``engine`` the engine's); a bad value raises ValueError naming the option."""
    from ember.config import EngineConfig
    from ember.models.registry import ensure_model
    from ember.server.config import ServerConfig, load_api_keys, load_tenant_limits
    from ember.server.models import model_sources

    given = args.model or [DEFAULT_MODEL]
    several = len(given) > 1 or args.models_dir is not None
    sources = model_sources(args.model or [], args.models_dir) if several else given
    if not several and (args.models_idle is not None or args.models_max_bytes is not None):
        raise ValueError("--models-idle and --models-max-bytes act on several models "
                         "(--model repeated, or --models-dir)")
    for given_flag, why in (
            (args.lora, "--lora names an adapter of one base model; with several, load "
                        "adapters at run time naming their model (?model=NAME)"),
            (args.kv_cache_dir, "--kv-cache-dir serves one model: with several, a tenant's "
                                "purge could not reach the disk tier of a model that is not "
                                "loaded"),
            (args.kv_events_endpoint, "--kv-events-endpoint publishes one engine's blocks: "
                                      "with several models, run one server per model behind "
                                      "the router"),
            (args.served_model_name, "--served-model-name names one model; with several, "
                                     "each is named by its file (or alias)")):
        if several and given_flag:
            raise ValueError(why)
    if args.models_idle is not None and args.models_idle <= 0:
        raise ValueError(f"--models-idle must be positive, got {args.models_idle}")
    engine = EngineConfig(
        tenant_limits=load_tenant_limits(args.tenant_limits) if args.tenant_limits else {},
        model=sources[0], weights=args.weights, threads=args.threads,
        allow_drift=args.allow_drift, moe_stream=args.moe_stream,
        moe_cache_bytes=args.moe_cache_bytes, moe_pilot=args.moe_pilot,
        moe_expert_top_p=args.moe_expert_top_p, moe_pinned_share=args.moe_pinned_share,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        max_prefill_step_seconds=args.max_prefill_step_seconds,
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
        max_queue=args.max_queue, enable_prefix_caching=not args.no_prefix_caching,
        max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
        lora_dtype=args.lora_dtype, speculation=args.speculation,
        calibrate_costs=args.spec_calibrate,
        spec_references=tuple(f.read_text(encoding="utf-8") for f in args.spec_ref),
        chat_template=(args.chat_template.read_text(encoding="utf-8")
                       if args.chat_template else None), **_kv_options(args))
    if not several:
        ensure_model(sources[0])  # a bad name fails here, before the server starts
    keys, weights = load_api_keys(args.api_key, args.api_keys_file)
    for name in ("max_request_bytes", "header_timeout", "body_timeout", "slo_ttft",
                 "slo_tpot"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                             f"got {getattr(args, name)}")
    return ServerConfig(engine=engine, api_keys=keys, served_model_name=args.served_model_name,
                        metrics_api_key=args.metrics_api_key,
                        max_request_bytes=args.max_request_bytes,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
                        tenant_weights=weights, loras=_loras(args.lora),
                        admin_api_key=args.admin_api_key, lora_dir=args.lora_dir,
                        chat_page=not args.no_ui,
                        otlp_traces_endpoint=args.otlp_traces_endpoint,
                        trace_content=args.trace_content, request_log=args.request_log,
                        models=tuple(sources) if several else (),
                        models_idle=args.models_idle,
                        models_max_bytes=args.models_max_bytes)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _model_args(s, several=True)
    s.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                   help="also serve every .gguf in DIR (several models: each loads on "
                        "first use; docs/server.md#several-models)")
    s.add_argument("--models-idle", type=float, default=None, metavar="SECONDS",
                   help="with several models: unload one idle this long")
    s.add_argument("--models-max-bytes", type=byte_size, default=None,
                   help="with several models: loaded models' files and KV pools together "
                        "at most this (the least recently used idle one is unloaded to "
                        "make room; K, M, G suffixes: powers of 1024)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=[],
                   help="accept this bearer key (repeatable); its tenant is derived from it")
    s.add_argument("--api-keys-file", type=Path,
                   help="lines of 'KEY [TENANT [WEIGHT]]' (WEIGHT: the tenant's fair share)")
    s.add_argument("--tenant-limits", type=Path, metavar="FILE",
                   help="lines of 'TENANT KEY=VALUE ...' ('*': every other tenant); keys: "
                        "max_running, max_queued (more: 429 naming the limit), kv_share, "
                        "disk_share (fractions of the KV pool / disk tier), max_adapters "
                        "(docs/server.md#limits)")
    s.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="run N engine replicas on Ray Serve behind this server, routed by "
                        "tenant-aware prefix affinity (needs: pip install 'ember[ray]')")
    s.add_argument("--ray-address", default=None,
                   help="with --replicas: an existing Ray cluster (default: a private "
                        "local Ray on 127.0.0.1)")
    s.add_argument("--router", choices=("affinity", "round-robin"), default="affinity",
                   help="with --replicas: tenant-aware prefix affinity (default), or replicas "
                        "in turn (the baseline it is measured against)")
    s.add_argument("--prefill-replicas", default=None, metavar="K|auto",
                   help="with --replicas: K replicas (or any, 'auto') may prefill a long "
                        "prompt for another and hand its KV over, per request when the "
                        "rule of docs/scaling.md#disaggregation says it pays")
    s.add_argument("--disagg", choices=("rule", "always"), default="rule",
                   help="with --prefill-replicas: hand a prompt over when the rule says it "
                        "pays (default), or every prompt with a full block (static "
                        "disaggregation, to measure the rule against)")
    s.add_argument("--slo-ttft", type=float, default=None,
                   help="seconds to first token: requests predicted to miss it get 429")
    s.add_argument("--slo-tpot", type=float, default=None,
                   help="seconds per output token: steps carry only the prompt tokens "
                        "that keep streams within it")
    s.add_argument("--served-model-name", help="model id clients use (default: the alias)")
    s.add_argument("--graceful-seconds", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish")
    s.add_argument("--metrics-api-key",
                   help="bearer key /metrics requires (default: any --api-key, if set)")
    s.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (a GGUF adapter or a PEFT directory) as model "
                        "NAME, for every tenant (repeatable)")
    s.add_argument("--max-lora-rank", type=int, default=64,
                   help="adapters of a higher rank are refused at load (default 64)")
    s.add_argument("--max-loras", type=int, default=8,
                   help="adapters kept in memory; the least recently used is evicted and "
                        "read again from its file when asked for (default 8)")
    s.add_argument("--lora-dtype", choices=("auto", "f32", "bf16"), default="auto",
                   help="how adapters are held: bf16 halves the bytes each step reads; "
                        "auto (default): bf16 over the fused native stack, else f32")
    s.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export one OpenTelemetry trace per request over OTLP/HTTP, e.g. "
                        "http://127.0.0.1:4318/v1/traces (docs/observability.md)")
    s.add_argument("--trace-content", action="store_true",
                   help="put prompt and completion text in the traces (off: never exported)")
    s.add_argument("--request-log", metavar="FILE",
                   help="append one JSON line per finished request (rotation-safe)")
    s.add_argument("--no-ui", action="store_true",
                   help="do not serve the chat page at / (docs/ui.md)")
    s.add_argument("--admin-api-key",
                   help="bearer key for POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter (without it they are refused)")
    s.add_argument("--lora-dir", metavar="DIR",
                   help="adapters loaded at run time must lie under DIR (a relative "
                        "lora_path resolves against it); without it, absolute paths only")
    s.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get 413 before being read (default 4 MiB)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request may take to send its whole body (else 408)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    s.add_argument("--max-prefill-chunk", type=int, default=None,
                   help="most prompt tokens one request prefills per step while others "
                        "wait (default: a quarter of --max-num-batched-tokens)")
    s.add_argument("--max-prefill-step-seconds", type=float, default=0.5,
                   help="a step carrying prompt tokens is sized to take at most this long, "
                        "so a request arriving during a long prefill waits short steps "
                        "(default 0.5)")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--kv-cache-bytes", type=byte_size, default=2 * 1024**3)
    s.add_argument("--num-kv-blocks", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-queue", type=int, default=1024)
    s.add_argument("--no-prefix-caching", action="store_true")
    _add_kv_flags(s)
    s.add_argument("--spec-ref", action="append", type=Path, default=[], metavar="FILE",
                   help="a text every request may draft from (repeatable)")
    s.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template replacing the model's (one with <think> "
                        "enables reasoning output and budgets)")
    s.add_argument("--spec-calibrate", action="store_true",
                   help="measure this machine's step costs at startup (about 2 s)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.server.run import run_server

    config = server_config(args)
    engine = config.engine
    if args.replicas < 0 or (args.ray_address and not args.replicas):
        raise ValueError("--replicas must be >= 1 (and --ray-address needs it)")
    if args.replicas and config.models:
        raise ValueError("--replicas serves one model; several models run in one process")
    if args.replicas and args.kv_events_endpoint:
        raise ValueError("--kv-events-endpoint publishes one engine's blocks: behind an "
                         "external router, run one ember serve per replica")
    prefill = _prefill_replicas(args.prefill_replicas, args.replicas)
    if not args.replicas:
        return run_server(config, args.host, args.port, args.graceful_seconds)
    from ember.cluster import deploy

    # Ray starts here, in the main thread (see start_ray); the replicas in the background
    deploy.start_ray(args.ray_address, args.replicas,
                     deploy.replica_threads(engine, args.replicas))
    try:
        return run_server(config, args.host, args.port, args.graceful_seconds,
                          start=lambda: deploy.start_replicas(
                              engine, args.replicas, args.ray_address, args.router,
                              prefill_replicas=prefill, disagg=args.disagg))
    finally:
        deploy.stop()


def _prefill_replicas(value: str | None, replicas: int) -> int | str | None:
    """``--prefill-replicas``: None (off), ``auto`` or a count below ``--replicas``."""
    if value is None:
        return None
    if replicas < 2:
        raise ValueError("--prefill-replicas needs --replicas 2 or more")
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--prefill-replicas must be a count or 'auto', got {value!r}") \
            from None
    if not 1 <= k < replicas:
        raise ValueError(f"--prefill-replicas must be between 1 and --replicas - 1 "
                         f"({replicas - 1}), got {k}")
    return k


def _bench_serve_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("serve", help="goodput of OpenAI-compatible endpoints under load")
    b.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the endpoint (without /v1)")
    b.add_argument("--model", default=None, help="model id to request (default: its first)")
    b.add_argument("--api-keys", default="",
                   help="comma-separated bearer keys, one per tenant (default: none)")
    b.add_argument("--label", default=None, help="name in the table (default: the URL)")
    b.add_argument("--compare", default=None, metavar="URL",
                   help="a second endpoint, run on the same trace, alternating")
    b.add_argument("--compare-model", default=None)
    b.add_argument("--compare-api-keys", default=None, help="default: --api-keys")
    b.add_argument("--compare-label", default=None)
    b.add_argument("--workload", default="chat", choices=WORKLOADS)
    b.add_argument("--tenants", type=int, default=None,
                   help="tenants (default: the number of --api-keys, else 1)")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=None, help="requests/s")
    load.add_argument("--rates", default=None, help="comma-separated rates: a sweep")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: this many clients")
    b.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson, < 1 burstier)")
    b.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals per step (open loop)")
    b.add_argument("--num-requests", type=int, default=None,
                   help="requests per step (overrides --duration)")
    b.add_argument("--slo", default="ttft=2000,tpot=150",
                   help="objectives in ms, e.g. ttft=2000,tpot=150")
    b.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    b.add_argument("--warmup", type=int, default=4, help="requests sent first, not counted")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", type=Path, default=Path("bench-results/serve.json"))
    b.add_argument("--plot", type=Path, default=None,
                   help="write PNG plots with this path prefix (needs matplotlib)")
    b.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ember.bench.goodput import Objectives
    from ember.bench.loadgen import Endpoint
    from ember.bench.serve import Plan
    from ember.bench.serve import main as bench_main

    slo = Objectives.parse(args.slo)
    keys = [k for k in args.api_keys.split(",") if k]
    endpoints = [Endpoint(args.url.rstrip("/"), args.model or "", keys,
                          args.label or args.url)]
    if args.compare:
        other = keys if args.compare_api_keys is None else [
            k for k in args.compare_api_keys.split(",") if k]
        endpoints.append(Endpoint(args.compare.rstrip("/"), args.compare_model or "", other,
                                  args.compare_label or args.compare))
    if len({e.label for e in endpoints}) < len(endpoints):
        raise ValueError("--label and --compare-label must differ")
    if args.rates:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    elif args.request_rate:
        rates = [args.request_rate]
    elif args.concurrency:
        rates = []
    else:
        raise ValueError("give --request-rate, --rates or --concurrency")
    for name, value in (("rates", min(rates, default=1)), ("burstiness", args.burstiness),
                        ("duration", args.duration), ("timeout", args.timeout),
                        ("concurrency", args.concurrency or 1),
                        ("num-requests", args.num_requests or 1)):
        if not value > 0:
            raise ValueError(f"--{name} must be positive, got {value}")
    plan = Plan(rates, args.concurrency, args.duration, args.num_requests, args.burstiness,
                args.workload, args.tenants or max(1, len(keys)), args.seed, args.timeout,
                args.warmup)
    bench_main(endpoints, plan, slo, args.out, args.plot)
    return 0


def _bench_simulate_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("simulate", help="predict a cluster's goodput from measured step "
                                          "costs (replicas, roles, link; docs/scaling.md)")
    b.add_argument("--costs", type=Path, required=True,
                   help="a step-cost table (ember bench spec-cost --threads T)")
    b.add_argument("--prefill-costs", type=Path, default=None,
                   help="the prefill pool's own table (replicas on other hardware; with a "
                        "count for --prefill-replicas)")
    b.add_argument("--trace", type=Path, default=None,
                   help="an ember bench serve result: its requests (without --rates, each "
                        "step replayed as sent and compared with what it measured)")
    b.add_argument("--prompt-tokens", default="",
                   help="synthetic requests of these prompt lengths (comma-separated)")
    b.add_argument("--output-tokens", type=int, default=64)
    b.add_argument("--cached-tokens", type=int, default=0)
    b.add_argument("--rates", default="", help="comma-separated requests/s (Poisson)")
    b.add_argument("--requests", type=int, default=400, help="requests per point")
    b.add_argument("--replicas", default="1", help="comma-separated replica counts")
    b.add_argument("--prefill-replicas", default="off",
                   help="comma-separated: off, auto or a count")
    b.add_argument("--disagg", choices=("rule", "always"), default="rule")
    b.add_argument("--bandwidth-gbit", default="10",
                   help="comma-separated KV handoff link speeds, Gbit/s")
    b.add_argument("--coordination-ms", type=float, default=5.0)
    b.add_argument("--overhead-ms", type=float, default=0.0,
                   help="per request before its first step (HTTP, template, Ray hop)")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="the model whose KV bytes per token a handoff moves")
    b.add_argument("--kv-dtype", default="f16")
    b.add_argument("--max-num-seqs", type=int, default=64)
    b.add_argument("--max-num-batched-tokens", type=int, default=512)
    b.add_argument("--slo", default="ttft=2000,tpot=150",
                   help="goodput's objectives in ms")
    b.add_argument("--slo-tpot", type=float, default=None,
                   help="the servers' TPOT objective in seconds (as ember serve --slo-tpot: "
                        "steps carry only the prompt tokens that keep streams within it)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", type=Path, default=Path("bench-results/simulate.json"))
    b.set_defaults(func=cmd_bench_simulate)


def cmd_bench_simulate(args: argparse.Namespace) -> int:
    from ember.bench import simulate
    from ember.bench.goodput import Objectives

    def numbers(text: str, kind: type) -> list:
        return [kind(x) for x in text.split(",") if x.strip()]

    prefill = [p.strip() for p in args.prefill_replicas.split(",") if p.strip()]
    for p in prefill:
        if p not in ("off", "auto") and not p.isdigit():
            raise ValueError(f"--prefill-replicas: off, auto or a count, got {p!r}")
    base = simulate.Cluster(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.disagg, coordination_s=args.coordination_ms / 1e3,
        overhead_s=args.overhead_ms / 1e3, seed=args.seed, slo_tpot=args.slo_tpot,
        kv_bytes_per_token=simulate.kv_bytes_per_token(args.model, args.kv_dtype))
    if args.prefill_costs is not None:
        base.prefill_costs = simulate.read_costs(args.prefill_costs)
    simulate.main(costs=args.costs, trace=args.trace,
                  prompt_tokens=numbers(args.prompt_tokens, int),
                  output_tokens=args.output_tokens, cached_tokens=args.cached_tokens,
                  rates=numbers(args.rates, float), requests=args.requests,
                  replicas=numbers(args.replicas, int), prefill=prefill,
                  bandwidths=numbers(args.bandwidth_gbit, float), base=base,
                  slo=Objectives.parse(args.slo), out=args.out)
    return 0


def _bench_spec_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("spec", help="speculative decoding: speedup per task, vs llama.cpp")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--concurrency", default="1,16", help="comma-separated request counts")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary: measure its n-gram speculation too")
    b.add_argument("--llama-only", action="store_true",
                   help="measure only llama.cpp (with --llama-server)")
    b.add_argument("--out", type=Path, default=Path("bench-results/spec.json"))
    b.set_defaults(func=cmd_bench_spec)


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from ember.bench.spec import main_spec

    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    main_spec(args.model, args.weights, args.threads, _int_list(args.concurrency,
                                                                "--concurrency"),
              args.reps, args.out, args.llama_server, skip_ember=args.llama_only)
    return 0


def _bench_kv_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("kv", help="KV disk tier: follow-up TTFT cold, RAM, disk, restart")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--history", type=int, default=2000, help="conversation tokens")
    b.add_argument("--kv-dtype", default="f32,f16", help="comma-separated KV dtypes")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before the restart run (needs root)")
    b.add_argument("--out", type=Path, default=Path("bench-results/kv.json"))
    b.set_defaults(func=cmd_bench_kv)


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from ember.bench.kv import main as bench_main

    if args.reps < 1 or args.history < 32:
        raise ValueError("--reps must be at least 1 and --history at least 32")
    bench_main(args.model, args.weights, args.threads, args.history, args.reps,
               [d for d in args.kv_dtype.split(",") if d], args.drop_caches, args.out)
    return 0


def _bench_isolation_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("isolation", help="can one tenant time another's prefix cache "
                                           "(timing AUC, 0.5: no signal)")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--trials", type=int, default=300)
    b.add_argument("--out", type=Path, default=Path("bench-results/isolation.json"))
    b.set_defaults(func=cmd_bench_isolation)


def cmd_bench_isolation(args: argparse.Namespace) -> int:
    from ember.bench.isolation import main as bench_main
    from ember.models.registry import ensure_model

    if args.trials < 2:
        raise ValueError("--trials must be at least 2")
    bench_main(str(ensure_model(args.model)), args.weights, args.threads, args.trials,
               args.out)
    return 0


def _bench_lora_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("lora", help="streams with a different LoRA adapter each vs the "
                                      "base model alone")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--streams", type=int, default=8, help="concurrent streams (= adapters)")
    b.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--gen", type=int, default=64, help="tokens generated per stream")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--lora-dtype", choices=("auto", "f32", "bf16"), default="auto",
                   help="how ember holds the adapters (as ember serve --lora-dtype)")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="also run llama.cpp's server (this binary) with the same adapters")
    b.add_argument("--out", type=Path, default=Path("bench-results/lora.json"))
    b.set_defaults(func=cmd_bench_lora)


def cmd_bench_lora(args: argparse.Namespace) -> int:
    from ember.bench.lora import main as bench_main
    from ember.models.registry import ensure_model

    if min(args.streams, args.rank, args.prompt_len, args.gen, args.reps) < 1:
        raise ValueError("--streams, --rank, --prompt-len, --gen and --reps must be >= 1")
    bench_main(str(ensure_model(args.model)), args.weights, args.threads, args.streams,
               args.rank, args.prompt_len, args.gen, args.reps, args.out, args.llama_server,
               args.lora_dtype)
    return 0


def _bench_embed_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("embed", help="embeddings/s of ember serve vs llama-server "
                                       "--embedding on the same file")
    b.add_argument("--model", "-m", default="qwen3-embedding-0.6b",
                   help="a .gguf path, alias, a shape of `ember bench synth` (written "
                        "with random weights at --quant on first use), or bert-base (a "
                        "random BERT-base-shaped encoder, F16)")
    b.add_argument("--quant", default="Q8_0", help="with a shape: its llama.cpp file type")
    b.add_argument("--batches", default="1,16,64", help="inputs per request")
    b.add_argument("--tokens", type=int, default=128, help="tokens per input")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--weights", default="auto")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="also run llama.cpp's server (this binary) on the same requests")
    b.add_argument("--out", type=Path, default=Path("bench-results/embed.json"))
    b.set_defaults(func=cmd_bench_embed)


def cmd_bench_embed(args: argparse.Namespace) -> int:
    from ember.bench import synth
    from ember.bench.embed import main as bench_main
    from ember.models.registry import ensure_model, synth_dir

    if min(args.tokens, args.threads, args.reps) < 1:
        raise ValueError("--tokens, --threads and --reps must be >= 1")
    if args.model == "bert-base":
        from ember.bench.embed import write_bert_base

        path = synth_dir() / "bert-base-F16.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bert_base(path)
    elif args.model in synth.SHAPES:
        path = synth_dir() / f"{args.model}-{synth.file_type(args.quant).name}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            synth.write_synth(path, args.model, args.quant)
    else:
        path = ensure_model(args.model)
    bench_main(path, _int_list(args.batches, "--batches"), args.tokens, args.threads,
               args.reps, args.weights, args.llama_server, args.out)
    return 0


def _bench_switch_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("switch", help="several models: first token of an unloaded model "
                                        "and memory with two, vs llama.cpp's router mode")
    b.add_argument("--shape", default="llama-1b", help="a shape of `ember bench synth`")
    b.add_argument("--quant", default="Q4_K_M")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="also run llama.cpp's server in router mode (this binary)")
    b.add_argument("--out", type=Path, default=Path("bench-results/switch.json"))
    b.set_defaults(func=cmd_bench_switch)


def cmd_bench_switch(args: argparse.Namespace) -> int:
    from ember.bench import synth
    from ember.bench.switch import main as bench_main
    from ember.models.registry import synth_dir

    quant = synth.file_type(args.quant).name
    directory = synth_dir() / f"switch-{args.shape}-{quant}"
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for seed in (0, 1):  # two files of one shape: two models
        path = directory / f"{args.shape}-{quant}-seed{seed}.gguf"
        if not path.exists():
            synth.write_synth(path, args.shape, quant, seed=seed)
        files.append(path)
    bench_main(files, args.threads, args.llama_server, args.out)
    return 0


def _bench_moe_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("moe", help="MoE experts resident vs streamed: at cache budgets, "
                                     "or bigger than RAM under a memory limit vs llama.cpp")
    b.add_argument("--model", "-m", default=None,
                   help="a mixture-of-experts GGUF (a split one by its first part); "
                        "'trained': ember's own trained MoE, whose routing follows its "
                        "text (trained once, ~15 min); default: a random-weight one")
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--budgets", default=None,
                   help="comma-separated cache budgets, percent of all experts' bytes "
                        "(default 100,50,25,10)")
    b.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt")
    b.add_argument("--memory-limit", type=byte_size, default=None, metavar="BYTES",
                   help="bigger than RAM: run every engine in a memory cgroup of this "
                        "size, page cache included (needs root or a delegated cgroup)")
    b.add_argument("--cache-bytes", type=byte_size, default=None, metavar="BYTES",
                   help="with --memory-limit: ember's --moe-cache-bytes (default: half "
                        "the limit)")
    b.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="with --memory-limit: also run llama.cpp's llama-bench (this "
                        "binary, or its directory) under the same limit")
    b.add_argument("--pilot", action="store_true",
                   help="streamed runs use the pilot (--moe-pilot): its recall is "
                        "reported")
    b.add_argument("--no-resident", action="store_true",
                   help="with --memory-limit: skip the resident run (outside the limit) "
                        "that streamed tokens are checked against")
    b.add_argument("--out", type=Path, default=Path("bench-results/moe.json"))
    b.set_defaults(func=cmd_bench_moe)


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from ember.bench.moe import main as bench_main

    if args.tokens < 2:
        raise ValueError("--tokens must be at least 2")
    limit_only = [flag for flag, given in (("--cache-bytes", args.cache_bytes is not None),
                                           ("--llama-bench", args.llama_bench is not None),
                                           ("--no-resident", args.no_resident)) if given]
    if args.memory_limit is None and limit_only:
        raise ValueError(f"{', '.join(limit_only)}: only with --memory-limit")
    if args.memory_limit is not None and args.budgets is not None:
        raise ValueError("--budgets: not with --memory-limit (its runs use --cache-bytes)")
    if args.memory_limit is not None:
        from ember.bench.moe import main_limit

        main_limit(args.model, args.weights, args.threads, args.memory_limit,
                   args.cache_bytes or args.memory_limit // 2, args.tokens, args.llama_bench,
                   not args.no_resident, args.out, args.pilot)
        return 0
    budgets = _int_list(args.budgets or "100,50,25,10", "--budgets")
    if any(not 0 < b <= 100 for b in budgets):
        raise ValueError("--budgets must be percentages in (0, 100]")
    bench_main(args.model, args.weights, args.threads, budgets, args.tokens, args.out,
               args.pilot)
    return 0


def _bench_synth_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("synth", help="random-weight GGUFs with real models' shapes "
                                       "and llama.cpp's tensor types, for speed runs")
    b.add_argument("--shape", required=True,
                   help="comma-separated: llama-1b, llama-3b, llama-8b, qwen3-4b, gemma3-1b, "
                        "qwen3moe-30b-a3b, gpt-oss-20b, qwen35-0.8b, qwen35-4b, qwen35moe-35b-a3b")
    b.add_argument("--quant", default="Q4_K_M",
                   help="comma-separated llama.cpp file types: Q4_0, Q4_K_M, Q5_K_M, Q6_K, "
                        "Q8_0, MXFP4_MOE (experts MXFP4, the rest Q8_0: as gpt-oss ships; "
                        "also Q4_1, Q5_0, Q5_1)")
    b.add_argument("--layers", type=int, default=None, metavar="N",
                   help="write N of the shape's real layers (a cut model, named SHAPE-Nl)")
    b.add_argument("--out-dir", type=Path, default=None,
                   help="default: $EMBER_HOME/synth; files are named SHAPE-QUANT.gguf")
    b.add_argument("--tokenizer", type=Path, default=None, metavar="GGUF",
                   help="borrow this GGUF's tokenizer (default: SmolLM2's), padded to the "
                        "shape's vocabulary")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--force", action="store_true", help="write files that already exist")
    b.set_defaults(func=cmd_bench_synth)


def cmd_bench_synth(args: argparse.Namespace) -> int:
    from ember.bench.synth import main as bench_main
    from ember.models.registry import synth_dir

    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    quants = [q.strip() for q in args.quant.split(",") if q.strip()]
    if not shapes or not quants:
        raise ValueError("--shape and --quant must each name at least one")
    bench_main(shapes, quants, args.out_dir or synth_dir(), args.tokenizer,
               args.seed, args.force, args.layers)
    return 0


def _bench_spec_cost_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("spec-cost", help="measure the step-cost table of this machine")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--out", type=Path, default=Path("bench-results/step_costs.json"))
    b.set_defaults(func=cmd_bench_spec_cost)


def cmd_bench_spec_cost(args: argparse.Namespace) -> int:
    from ember.bench.spec import main_cost

    main_cost(args.model, args.weights, args.threads, args.out)
    return 0


def _bench_constrained_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("constrained", help="grammar mask cost per token")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--max-tokens", type=int, default=48)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--out", type=Path, default=Path("bench-results/constrained.json"))
    b.set_defaults(func=cmd_bench_constrained)


def cmd_bench_constrained(args: argparse.Namespace) -> int:
    from ember.bench.constrained import main as bench_main

    bench_main(args.model, args.weights, args.max_tokens, args.reps, args.out, args.threads)
    return 0


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{option} must list positive integers, got {text!r}")
    return values


def _bench_compare_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("compare", help="ember vs llama.cpp on the same GGUF and threads")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default=None,
                   help="comma-separated ember weight formats (default: q4 if its kernel "
                        "builds here, else f32)")
    b.add_argument("--threads", type=int, default=None,
                   help="threads for both engines (default: physical cores)")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary, or the directory holding it and "
                        "llama-batched-bench: the anchor every ratio is against")
    b.add_argument("--llama-python", default=None,
                   help="interpreter with llama_cpp, the Python binding (default: this one, "
                        "unless --llama-bench is given)")
    b.add_argument("--prefill", default="128,512", help="comma-separated prompt lengths")
    b.add_argument("--decode-tokens", type=int, default=128,
                   help="tokens generated by the single-stream decode run")
    b.add_argument("--streams", default="4,16,32", help="comma-separated stream counts")
    b.add_argument("--stream-prompt", type=int, default=32, help="prompt tokens per stream")
    b.add_argument("--stream-gen", type=int, default=32, help="tokens generated per stream")
    b.add_argument("--kv-dtype", default="f16", choices=KV_DTYPE_CHOICES,
                   help="ember's KV pool dtype (llama.cpp uses its default, f16)")
    b.add_argument("--llama-extra-bufts", choices=["on", "off"], default="on",
                   help="llama.cpp's extra CPU buffer types (repacked weights, AMX); off "
                        "where they crash (a VM that reports AMX without granting it)")
    b.add_argument("--llama-flash-attn", choices=["auto", "on", "off"], default="auto",
                   help="llama.cpp flash attention (default: auto, llama.cpp's default)")
    b.add_argument("--no-spec", action="store_true",
                   help="skip the speculation rows (the qa and code tasks of `ember bench "
                        "spec`, speculation on and off)")
    b.add_argument("--out", type=Path, default=Path("bench-results/compare.json"))
    b.set_defaults(func=cmd_bench_compare)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from ember.models.linear import WEIGHT_FORMATS

    if args.weights is None:
        from ember import kernels

        weights = ["q4" if kernels.available() else "f32"]
    else:
        weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    bad = [w for w in weights if w not in WEIGHT_FORMATS]
    if not weights or bad:
        raise ValueError(f"--weights: unknown format(s) {bad or args.weights!r} "
                         f"(choose from {', '.join(WEIGHT_FORMATS)})")
    for name, low in (("reps", 1), ("threads", 1), ("decode_tokens", 2),
                      ("stream_prompt", 1), ("stream_gen", 2)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    from ember.bench.compare import main as bench_main

    bench_main(args.model, list(dict.fromkeys(weights)), args.threads, args.reps, args.out,
               args.llama_python, _int_list(args.prefill, "--prefill"), args.decode_tokens,
               _int_list(args.streams, "--streams"), args.stream_prompt, args.stream_gen,
               llama_flash_attn=args.llama_flash_attn, kv_dtype=args.kv_dtype,
               llama_extra_bufts=args.llama_extra_bufts == "on", llama_bench=args.llama_bench,
               spec_rows=not args.no_spec)
    return 0


def _bench_throughput_parser(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("throughput", help="aggregate tok/s vs concurrency; prefix reuse TTFT")
    b.add_argument("--model", "-m", default=DEFAULT_MODEL)
    b.add_argument("--weights", default="auto")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--concurrency", default="1,2,4,8,16,32,64",
                   help="comma-separated concurrency levels")
    b.add_argument("--prompt-len", type=int, default=32)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--history-tokens", type=int, default=1500)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--out", type=Path, default=Path("bench-results/throughput.json"))
    b.set_defaults(func=cmd_bench_throughput)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from ember.bench.throughput import main as bench_main

    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {args.concurrency!r}")
    bench_main(args.model, args.weights, levels, args.prompt_len, args.output_len,
               args.history_tokens, args.reps, args.out, args.threads)
    return 0


_BYTE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def byte_size(text: str) -> int:
    """A byte count: ``1073741824``, ``600M``, ``1.5G``, ``512KiB`` (K, M, G, T: powers of
    1024, with or without ``iB`` / ``B``)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 600M, 2G)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])


def _model_args(s: argparse.ArgumentParser, several: bool = False) -> None:
    if several:  # ember serve: one model, or several behind one port
        s.add_argument("--model", "-m", action="append", default=None,
                       help="alias, .gguf path or Hub name (default: smollm2-135m); repeat "
                            "to serve several, the first the default (docs/server.md)")
    else:
        s.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help="alias, .gguf path or Hub name")
    s.add_argument("--weights", default="auto",
                   help="weight format: auto (q4 where the native kernel builds, else f32), "
                        "q4, f32 (the exact oracle), bf16")
    s.add_argument("--threads", type=int, default=None, help="default: physical cores")
    s.add_argument("--speculation", choices=["auto", "off"], default="auto",
                   help="auto: verify draft tokens where the cost gate says it pays "
                        "(the output is the same either way); off: never")
    s.add_argument("--verbose", "-v", action="store_true", help="print load and speed figures")
    s.add_argument("--allow-drift", action="store_true",
                   help="use a weight format / KV dtype whose measured drift from f32 "
                        "(`ember eval`) crosses the limits (docs/quantization.md)")
    s.add_argument("--moe-stream", action="store_true",
                   help="mixture-of-experts models: keep dense weights resident and page "
                        "experts from the file through a cache (docs/models.md)")
    s.add_argument("--moe-cache-bytes", type=byte_size, default=1024**3,
                   help="the streamed experts' cache: a per-layer LRU warmed from earlier "
                        "runs (+ any --moe-pinned-share) "
                        "(bytes; K, M, G suffixes: powers of 1024)")
    s.add_argument("--moe-pilot", action=argparse.BooleanOptionalAction, default=False,
                   help="with --moe-stream: guess each layer's experts one layer ahead and "
                        "read them early (never changes the output; off by default: on 2 "
                        "cores its reads slowed decode, docs/models.md)")
    s.add_argument("--moe-pinned-share", type=float, default=0.0, metavar="F",
                   help="with --moe-stream: this share of the cache holds the experts "
                        "earlier runs used most, never evicted (default 0: they start the "
                        "LRU instead, which measured better)")
    s.add_argument("--moe-expert-top-p", type=float, default=1.0, metavar="F",
                   help="LOSSY: each token keeps its experts only up to cumulative router "
                        "weight F (< 1 reads fewer experts and changes the output; 1: exact)")
    s.add_argument("--kv-dtype", default="f16", choices=KV_DTYPE_CHOICES,
                   help="KV cache storage: f16 (default; half of f32, drift within noise), "
                        "f32 (exact), bf16, q8_0 (llama.cpp's 8-bit blocks: 0.53x of f16; "
                        "head_dim a multiple of 32)")


def _sampling_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", "-t", type=float, default=0.7, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=40, help="0 disables")
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--min-p", type=float, default=0.05)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)


def _params(args: argparse.Namespace):
    from ember.sampling.params import InvalidSamplingParams, SamplingParams

    if args.max_tokens is not None and args.max_tokens < 1:  # 0 only scores a prompt
        raise InvalidSamplingParams("max_tokens", f"must be an integer >= 1, got "
                                    f"{args.max_tokens}")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _llm(args: argparse.Namespace):
    from ember.models.registry import ensure_model

    # Validate the options and find the model before the slow torch import and load,
    # so a typo fails at once.
    params = _params(args)
    ensure_model(args.model)
    from ember.llm import LLM

    llm = LLM(args.model, weights=args.weights, threads=args.threads, allow_drift=args.allow_drift,
              speculation=args.speculation, moe_stream=args.moe_stream,
              moe_cache_bytes=args.moe_cache_bytes, moe_pilot=args.moe_pilot,
              moe_expert_top_p=args.moe_expert_top_p,
              moe_pinned_share=args.moe_pinned_share, kv_dtype=args.kv_dtype)
    if args.verbose:
        print(f"[loaded {llm.engine.loaded.name} ({llm.engine.loaded.weights}) in "
              f"{llm.engine.loaded.load_seconds:.2f}s]", file=sys.stderr)
    return llm, params


def _pull_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("pull", help="fetch a model (a registered alias, or ORG/REPO[:QUANT] "
                       "or hf://ORG/REPO/FILE.gguf from the Hugging Face Hub) and verify it")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    s.add_argument("--force", action="store_true", help="fetch again even if present")
    s.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from ember.models.gguf import SPLIT_NAME, split_part_path
    from ember.models.registry import pull

    path = pull(args.model, force=args.force)
    m = SPLIT_NAME.match(path.name)
    count = int(m["count"]) if m else 1
    parts = [split_part_path(path, i, count) for i in range(count)] if m else [path]
    size = sum(p.stat().st_size for p in parts)
    what = f", {len(parts)} parts" if len(parts) > 1 else ""
    print(f"{args.model}: {path} ({size / 1e6:.1f} MB{what}, sha256 verified)")
    return 0


def _models_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("models", help="list registered and installed models")
    s.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from ember.models.registry import list_models

    for m in list_models():
        size = f"{m.size / 1e6:8.1f} MB" if m.size is not None else "       - "
        where = str(m.path) if m.path else "not installed (ember pull)"
        print(f"{m.name:<16} {size}  {m.description:<52} {where}")
    return 0


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("inspect", help="what ember makes of a GGUF: architecture, tokenizer, "
                       "formats, native paths, chat template, KV bytes (no weights loaded)")
    s.add_argument("model", help="alias or path to a .gguf")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from ember.models.gguf import GGUFFile
    from ember.models.inspect import format_report, inspect_gguf
    from ember.models.registry import ensure_model

    with GGUFFile(ensure_model(args.model)) as gguf:
        report = inspect_gguf(gguf)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 0


def _tokenize_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    s.add_argument("model", help="alias or path to a .gguf file")
    s.add_argument("text", nargs="?")
    s.add_argument("--text-file", type=Path, help="read the text from this file")
    s.add_argument("--add-bos", action="store_true", help="prepend BOS as the model asks")
    s.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from ember.models.gguf import GGUFFile
    from ember.models.registry import ensure_model
    from ember.tokenizer import Tokenizer

    if (args.text is None) == (args.text_file is None):
        raise ValueError("give either TEXT or --text-file")
    text = args.text if args.text is not None else args.text_file.read_text(encoding="utf-8")
    tok = Tokenizer.from_gguf(GGUFFile(ensure_model(args.model)))
    print(json.dumps(tok.encode(text, add_bos=args.add_bos and tok.add_bos)))
    return 0


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("generate", help="stream a reply to one prompt")
    _model_args(s)
    _sampling_args(s)
    s.add_argument("--raw", action="store_true", help="complete the text as is (no chat template)")
    s.add_argument("--spec-stats", action="store_true",
                   help="print what speculative decoding did (drafted, accepted, steps)")
    s.add_argument("prompt")
    s.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    llm, params = _llm(args)
    ids = llm.encode(args.prompt) if args.raw else llm.encode_chat(
        [{"role": "user", "content": args.prompt}])
    out = _stream_reply(llm, ids, params, args.verbose)
    llm.engine.close()  # e.g. saves a streamed MoE model's expert histogram
    if args.spec_stats:
        print(out.spec.summary() if out.spec else "spec: off", file=sys.stderr)
    return 0


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_args(s)
    _sampling_args(s)
    s.add_argument("--system", help="system message")
    s.add_argument("--conversation", type=Path, default=None, metavar="FILE",
                   help="keep the conversation and its KV here: a later chat on the same "
                        "FILE resumes it warm (docs/kv-cache.md)")
    s.add_argument("--lora", default=None, metavar="PATH",
                   help="answer with this LoRA adapter (GGUF or PEFT directory); a "
                        "--conversation file's KV is reused only with the same adapter")
    s.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    llm, params = _llm(args)
    lora = None
    if args.lora:
        llm.load_lora("chat", args.lora)
        lora = "chat"
    messages = [{"role": "system", "content": args.system}] if args.system else []
    saved = _ConversationFile(llm, args.conversation, lora) if args.conversation else None
    if saved is not None and saved.state.messages:
        messages = saved.state.messages
        warm = llm.engine.import_prefix(saved.state.records, lora=lora)
        print(f"[resumed {len(messages)} messages from {args.conversation}, "
              f"{warm} tokens of KV restored]", file=sys.stderr)
    print("ember chat — empty line or Ctrl-D to quit, Ctrl-C stops a reply.", file=sys.stderr)
    try:
        return _chat_loop(llm, params, messages, saved, args.verbose, lora)
    finally:
        llm.engine.close()


def _chat_loop(llm, params, messages: list[dict], saved, verbose: bool,
               lora: str | None = None) -> int:
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream_reply(llm, llm.encode_chat(messages), params, verbose, lora).text
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()  # the turn was abandoned; keep history consistent
            continue
        except (EmberError, ValueError) as e:  # e.g. the conversation outgrew the context
            print(f"ember: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
        if saved is not None:
            saved.save(messages)


class _ConversationFile:
    """``ember chat --conversation``: after each reply, append its new KV blocks and the
    messages, committed together (a kill mid-reply loses only that turn)."""

    def __init__(self, llm, path: Path, lora: str | None = None) -> None:
        from ember.kv import conversation

        self.llm, self.path, self.lora = llm, path, lora
        self.fp = llm.engine.kv_fingerprint()
        self.state = conversation.read(path, self.fp)

    def save(self, messages: list[dict]) -> None:
        from ember.kv import conversation

        history = self.llm.encode_chat(messages, add_generation_prompt=False)
        records = self.llm.engine.export_prefix(history, lora=self.lora)
        self.state = conversation.save_turn(self.path, self.fp, self.state, messages, records)


def _stream_reply(llm, prompt_ids: list[int], params, verbose: bool,
                  lora: str | None = None):
    """Stream a reply to stdout; returns the final output."""
    start = time.perf_counter()
    first = last = None
    for out in llm.stream_ids(prompt_ids, params, lora=lora):
        if first is None:
            first = time.perf_counter()
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        last = out
        if out.error:
            raise EmberError(out.error)
    sys.stdout.write("\n")
    n = len(last.token_ids) if last else 0
    if verbose and first is not None:
        decode = time.perf_counter() - first
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        print(f"[prompt {len(prompt_ids)} tok ({last.cached_tokens} cached), "
              f"first token {first - start:.3f}s, "
              f"{n} tok, decode {rate:.1f} tok/s]", file=sys.stderr)
        moe = llm.engine.moe_metrics()
        if moe is not None:
            print(f"[experts: hits {moe['pinned_hits']} pinned + {moe['lru_hits']} lru, "
                  f"misses {moe['misses']}, read {moe['bytes_read'] / 1e6:.1f} MB, "
                  f"hit rate {moe['hit_rate']:.1%}, cached {moe['cached_bytes'] / 1e6:.1f} MB]",
                  file=sys.stderr)
    return last


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
