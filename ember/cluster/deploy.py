"""Start Ray (or join a cluster), deploy N ember replicas on Ray Serve, build the front.

Local Ray (no ``--ray-address``) is started by ember, bound to 127.0.0.1, with the
dashboard off and token authentication on (``RAY_AUTH_MODE=token``; Ray writes the
token to ``~/.ray/auth_token``). Ray Serve's own HTTP proxy is disabled: the HTTP
surface is ember's server in this process, talking to the replicas through a
deployment handle.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from ember.cluster.protocol import APP, DEPLOYMENT
from ember.config import EngineConfig
from ember.errors import EmberError

log = logging.getLogger("ember.cluster")
STATS_PERIOD_S = 0.5  # how often replicas report their prefix-cache digest to the router
_started_ray = False  # whether this process started the Ray it uses (else: a cluster's)


class RayUnavailable(EmberError):
    """``--replicas`` needs Ray Serve: ``pip install 'ember[ray]'``."""


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise RayUnavailable("--replicas needs Ray Serve: pip install 'ember[ray]'") from None
    return ray


def replica_threads(config: EngineConfig, replicas: int) -> int:
    """Each replica's compute threads: given, or this machine's cores shared out."""
    return config.threads or max(1, (os.cpu_count() or 1) // replicas)


def _token_auth_unless_joining(address: str | None) -> None:
    """A Ray ember starts itself requires its token (a cluster's mode is its own) and
    listens on loopback only. Ray reads both when imported: call it before anything
    imports ray.

    Loopback: on Linux Ray turns a node address of 127.0.0.1 into the machine's
    outward address (its "cluster" mode), and its GCS, raylet, workers and agents then
    listen on every interface (measured with ``ss -ltnp``, Ray 2.60). Ray's
    single-machine mode (what it runs on macOS and Windows) keeps the node on 127.0.0.1,
    and every listener with it; a private cluster of one machine is exactly that."""
    if not address:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None:  # imported already: the flag is read at call time
            constants.ENABLE_RAY_CLUSTER = os.environ[  # type: ignore[attr-defined]
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")


def start_ray(address: str | None, replicas: int, threads: int = 1) -> None:
    """Join ``address``, or start a private local Ray on loopback.

    Call it from the main thread, or from one that lives as long as Ray should: Ray
    ties its local processes' lives to the thread that started them (their parent-death
    signal fires when that thread exits)."""
    cpus = max(os.cpu_count() or 1, replicas * threads)
    _token_auth_unless_joining(address)
    ray = _ray()
    if ray.is_initialized():
        return
    common = {"include_dashboard": False, "logging_level": logging.WARNING,
              "log_to_driver": False, "namespace": "ember"}
    if address:
        ray.init(address=address, **common)
        return
    global _started_ray
    _started_ray = True
    ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1", **common)


def deploy(config: EngineConfig, replicas: int, router: str = "affinity",
           imbalance: int = 4) -> Any:
    """Run ``replicas`` engines as one Ray Serve deployment; return its handle."""
    _ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from ember.cluster.replica import EmberReplica
    from ember.cluster.router import ROUTERS, view

    view().reset()
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        EmberReplica, name=DEPLOYMENT, num_replicas=replicas,
        # the engine's own queue is the bound (and answers 429 at once): Ray must not queue
        max_ongoing_requests=config.max_num_seqs + config.max_queue + 8,
        ray_actor_options={"num_cpus": config.threads or 1},
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[router],
            request_router_kwargs={"imbalance": imbalance} if router == "affinity" else {},
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=10 * STATS_PERIOD_S))
    return serve.run(deployment.bind(config), name=APP, route_prefix=None)


def start_replicas(config: EngineConfig, replicas: int, address: str | None = None,
                   router: str = "affinity", imbalance: int = 4,
                   prefill_replicas: int | str | None = None, disagg: str = "rule") -> Any:
    """Ray up, replicas deployed and a started :class:`ReplicaSet` for the server.
    ``prefill_replicas``: how many may prefill for the others (``auto``: any), per
    request when it pays (:mod:`ember.cluster.disagg`); None: never."""
    if config.kv_cache_dir is not None and replicas > 1:
        raise EmberError("--kv-cache-dir with --replicas > 1: the replicas would share one "
                         "disk store, which is not supported (yet)")
    if prefill_replicas is not None and not config.enable_prefix_caching:
        raise EmberError("--prefill-replicas hands prompts over through the prefix cache: "
                         "drop --no-prefix-caching")
    _token_auth_unless_joining(address)  # ember.cluster.front imports ray
    from ember.cluster.disagg import Planner
    from ember.cluster.front import ReplicaSet
    from ember.models.loader import load_model_meta

    loaded = load_model_meta(config.model, config.weights)
    # the front resolved "auto": every replica uses the same format (the prefix-cache
    # salt, which the router must predict, includes it)
    config = dataclasses.replace(config, weights=loaded.weights,
                                 threads=replica_threads(config, replicas))
    start_ray(address, replicas, config.threads)
    handle = deploy(config, replicas, router, imbalance)
    planner = None
    if prefill_replicas is not None:
        planner = Planner(None if prefill_replicas == "auto" else int(prefill_replicas),
                          disagg)
    return ReplicaSet(handle, config, replicas, loaded, planner, imbalance).start()


def stop() -> None:
    """Tear the deployment down; and Serve and Ray if this process started them (on a
    cluster, only ember's application goes: others may share its Serve)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        return
    if not ray.is_initialized():
        return
    if not _started_ray:
        serve.delete(APP)
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
