"""The reward service's config (``flowrl serve-rewards CONFIG``): where it listens and one deployment per reward.

Plain dataclasses read by flowrl's config loader, so an unknown key, a wrong type or an impossible value is one
line naming the dotted key, as in a training config. Nothing here touches Ray: the cluster's resources are checked
when the service starts (:func:`flowrl.reward_service.launch.check_resources`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from flowrl.config.loader import check, load_config

MAX_REQUEST_BYTES = 64 * 2 ** 20
"""The default cap on a /score body: 64 MiB holds a few hundred 512 px PNGs, a client's usual chunk many times."""


@dataclass
class RewardDeployment:
    """One reward served by its own Ray Serve deployment: its replicas, their resources and environment, and how
    its calls are batched."""

    name: str = "brightness"
    """Short reward name or dotted path 'package.module:Class' (as in a training config's `rewards:`); also the
    deployment's name."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Flat keyword arguments of the reward's constructor (device, model path, ...); each replica builds it once."""
    replicas: int = 1
    """Replicas of this deployment; requests are spread over them."""
    num_cpus: float = 1.0
    """CPUs Ray reserves for each replica (fractions allowed)."""
    num_gpus: float = 0.0
    """GPUs Ray reserves for each replica (fractions share one GPU); the cluster must have them."""
    max_batch_size: int = 32
    """Target batch: images (a pointwise reward) or groups (a group-wise one) scored in one call, gathered across
    concurrent requests; 1 turns batching off."""
    batch_wait_s: float = 0.01
    """How long a replica waits for a batch to fill before scoring what it has."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray runtime environment of the replicas (pip, conda, env_vars, working_dir, ...): judges with conflicting
    dependencies run side by side."""
    health_check_period_s: float = 10.0
    """Seconds between Serve's health checks of each replica (a failed one restarts the replica)."""
    health_check_timeout_s: float = 30.0
    """Seconds a replica's health check may take before it counts as failed."""

    def validate(self):
        check(bool(self.name) and "#" not in self.name, "name", "must be a reward name without '#' (Serve keeps "
              "'#' for its replica names)")
        check(self.replicas >= 1, "replicas", "must be >= 1")
        check(self.num_cpus >= 0, "num_cpus", "must be >= 0")
        check(self.num_gpus >= 0, "num_gpus", "must be >= 0 (0: CPU only)")
        check(self.max_batch_size >= 1, "max_batch_size", "must be >= 1 (1: batching off)")
        check(self.batch_wait_s >= 0, "batch_wait_s", "must be >= 0 seconds")
        check(self.health_check_period_s > 0, "health_check_period_s", "must be > 0 seconds")
        check(self.health_check_timeout_s > 0, "health_check_timeout_s", "must be > 0 seconds")

    @property
    def max_ongoing_requests(self) -> int:
        """Calls one replica holds at once: several batches' worth, so the images of concurrent requests queue in
        the replica and fill its batches. With room for only two batches, Serve's router held the rest back and
        retried them with backoff: 1 replica scored 24 images/s instead of 72 (scripts/bench/reward_service.py)."""
        return max(8 * self.max_batch_size, 64)


@dataclass
class ServiceConfig:
    """The reward service: its HTTP address, the Ray cluster it runs on, its size cap, and its rewards."""

    host: str = "127.0.0.1"
    """Interface the HTTP proxy listens on: 0.0.0.0 for trainers on other machines."""
    port: int = 8765
    """HTTP port of /score and /health."""
    address: str | None = None
    """Ray cluster to join: None starts a local one, 'auto' joins the one `ray start` began on this node,
    HOST:6379 a remote head (also `--address` on the command line)."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """A /score body larger than this is refused with HTTP 413, unread."""
    on_error: Literal["raise", "nan"] = "raise"
    """A reward that raises: HTTP 500 for the images of its batch (raise), or null scores (nan)."""
    rewards: list[RewardDeployment] = field(default_factory=list)
    """The rewards served, one deployment each; /score returns all their keys."""

    def validate(self):
        check(bool(self.rewards), "rewards", "needs at least one reward, e.g. rewards: [{name: toyeval}]")
        names = [r.name for r in self.rewards]
        check(len(set(names)) == len(names), "rewards", f"names a reward twice ({names}); serve each once")
        check(1 <= self.port <= 65535, "port", "must be a TCP port in [1, 65535]")
        check(self.max_request_bytes >= 1, "max_request_bytes", "must be >= 1")

    @property
    def url(self) -> str:
        """The address clients use (0.0.0.0 listens everywhere; on this machine it answers at 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def load_service_config(path: str | Path, overrides: Sequence[str] = ()) -> ServiceConfig:
    """YAML file + ``key=value`` overrides -> a validated `ServiceConfig` (one-line ConfigError otherwise)."""
    return load_config(ServiceConfig, path, overrides)
