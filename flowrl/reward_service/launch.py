"""Start and stop the reward service on a Ray cluster: the checks before deploying, the deployments from the config,
and Serve's HTTP proxy on the configured address.

Why the checks come first: Serve waits for resources that never come (a GPU the cluster lacks) and retries a
reward whose module does not exist; both are one line here instead. Ray is imported inside the functions, so
``import flowrl`` stays light and Ray stays optional (the ``flowrl[serve]`` extra).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from flowrl.reward_service.config import ServiceConfig
from flowrl.rewards_api import check_reward_kwargs, resolve_reward_class

APP_NAME = "flowrl_rewards"
INGRESS = "ingress"
CONSTRUCTOR_RETRIES = 2  # a reward that fails to build fails the same way again: give up quickly


class ServiceError(ValueError):
    """The reward service cannot start as configured: one line saying why and what to change."""


def import_serve() -> Any:
    """``ray.serve``, or one line naming the extra that installs it."""
    try:
        from ray import serve
    except ImportError:
        raise ServiceError("the reward service runs on Ray Serve, which is not installed: "
                           "pip install 'flowrl[serve]'") from None
    return serve


def check_rewards(cfg: ServiceConfig) -> None:
    """Every configured reward resolves to a class that takes its kwargs (unknown names, missing modules and
    misnamed kwargs are one line), before Ray starts: a reward that fails in the replicas prints their tracebacks."""
    for spec in cfg.rewards:
        check_reward_kwargs(spec.name, resolve_reward_class(spec.name), spec.kwargs)


def check_port(cfg: ServiceConfig) -> None:
    """The HTTP port is free on this machine (a service started here binds it), checked before Ray starts, so a port
    in use is one line rather than Serve's "Failed to bind to address" traceback. A cluster joined at an address
    binds on its head node: not checked from here."""
    if cfg.address:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((cfg.host, cfg.port))
        except OSError as err:
            raise ServiceError(f"port {cfg.port} on {cfg.host} is not free ({err.strerror or err}): another service "
                               f"holds it; stop it, or choose another port (port=...)") from None


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (None: start a local one) unless this process already has; -> whether
    this call started the connection (and so should end it)."""
    import ray

    if ray.is_initialized():
        return False
    check_reachable(address)
    if address is None:
        patient_local_serve()
    try:
        ray.init(address=address, include_dashboard=False if address is None else None, runtime_env=worker_env())
    except ConnectionError as err:
        raise ServiceError(f"cannot join the Ray cluster at address {address!r}: {' '.join(str(err).split())} "
                           "(start one with `ray start --head`, or leave address unset for a local one)") from None
    return True


def check_reachable(address: str | None) -> None:
    """A HOST:PORT address answers a TCP connection within a few seconds (Ray itself keeps retrying a dead GCS for
    minutes); None, 'auto' and ray:// addresses are left to Ray."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise ServiceError(f"cannot join the Ray cluster at address {address!r}: nothing answers there ({err}); "
                           f"start its head with `ray start --head --port {port}`, or leave address unset for a "
                           "local one") from None


SERVE_START_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
"""Serve gives its HTTP proxy 5 s to report ready and 10 s per health check, three misses and it is replaced: on a
machine busy training beside a local service (or a CI runner) the proxy misses them and never starts."""


def patient_local_serve() -> None:
    """Before a local Ray starts (its processes inherit this environment): Serve's proxy checks wait
    `SERVE_START_TIMEOUTS`, unless the environment sets them. A cluster started by `ray start` reads its own."""
    for key, value in SERVE_START_TIMEOUTS.items():
        os.environ.setdefault(key, value)


def worker_env() -> dict[str, Any] | None:
    """The replicas import flowrl and the rewards from where this process does (its PYTHONPATH, if any; a cluster's
    other nodes need flowrl installed, or the same path)."""
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": path}} if path else None


def check_resources(cfg: ServiceConfig) -> None:
    """Every deployment's GPUs and the service's CPUs exist in the cluster, else one line naming the deployment,
    what it asks and what the cluster has."""
    import ray

    have = ray.cluster_resources()
    gpus = have.get("GPU", 0.0)
    for spec in cfg.rewards:
        asked = spec.replicas * spec.num_gpus
        if asked > gpus:
            raise ServiceError(
                f"deployment '{spec.name}' asks for {asked:g} GPU{'s' * (asked != 1)} ({spec.replicas} replica(s) x "
                f"num_gpus {spec.num_gpus:g}) and the Ray cluster has {gpus:g}; set its num_gpus: 0 to score on "
                "CPUs, or start the service on a cluster with GPUs (ray start --head --num-gpus N, then "
                "--address auto)")
    cpus, asked = have.get("CPU", 0.0), sum(spec.replicas * spec.num_cpus for spec in cfg.rewards)
    if asked > cpus:
        per = ", ".join(f"{spec.name} {spec.replicas} x {spec.num_cpus:g}" for spec in cfg.rewards)
        raise ServiceError(f"the deployments ask for {asked:g} CPUs ({per}) and the Ray cluster has {cpus:g}; "
                           "lower replicas or num_cpus (fractions are allowed), or add nodes to the cluster")


def build_app(cfg: ServiceConfig) -> Any:
    """The Serve application: one `RewardScorer` deployment per reward and the `Ingress` holding their handles."""
    serve = import_serve()
    from flowrl.reward_service.deployments import Ingress, RewardScorer

    scorers = {}
    for spec in cfg.rewards:
        options = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}
        if spec.runtime_env:
            options["runtime_env"] = spec.runtime_env
        deployment = serve.deployment(
            RewardScorer, name=spec.name, num_replicas=spec.replicas, ray_actor_options=options,
            max_ongoing_requests=spec.max_ongoing_requests, health_check_period_s=spec.health_check_period_s,
            health_check_timeout_s=spec.health_check_timeout_s, max_constructor_retry_count=CONSTRUCTOR_RETRIES)
        scorers[spec.name] = deployment.bind(spec.name, spec.kwargs, spec.max_batch_size, spec.batch_wait_s,
                                             cfg.on_error)
    ingress = serve.deployment(Ingress, name=INGRESS, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1000)  # it only waits on the scorers
    return ingress.bind(scorers, cfg.max_request_bytes)


def start_service(cfg: ServiceConfig) -> str:
    """Deploy the rewards and the HTTP proxy on the connected cluster; returns once every replica is up -> the
    service's URL."""
    serve = import_serve()
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    try:
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/",
                  logging_config={"enable_access_log": False})  # a log line per image call buries the rest
    except RuntimeError as err:  # a replica could not be built: Serve's message holds the reward's own error
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        raise ServiceError(f"the reward service did not start: {cause}") from None
    for spec in cfg.rewards:  # a reward whose replica could not build it: one line, no replica traceback
        described = serve.get_deployment_handle(spec.name, app_name=APP_NAME).describe.remote().result()
        if "error" in described:
            raise ServiceError(f"the reward service did not start: {described['error']}")
    return cfg.url


def stop_service() -> None:
    """Shut Serve down on the connected cluster (its deployments and HTTP proxies)."""
    import_serve().shutdown()
