"""``flowrl serve-rewards CONFIG [key=value ...] [--address ADDR]``: serve rewards over HTTP on Ray Serve.

Checks the config, the reward names (before Ray starts) and the cluster's GPUs and CPUs (before deploying), each
a one-line error; then deploys, prints ``serving [...] on http://HOST:PORT`` as its first line of output, and
blocks until Ctrl-C or SIGTERM, when it shuts Serve down (and the local Ray it started).
"""

from __future__ import annotations

import signal
import threading
import time


def run_serve_rewards(args) -> None:
    """Serve the config's rewards until interrupted."""
    from flowrl.reward_service.config import load_service_config
    from flowrl.reward_service.launch import (check_port, check_resources, check_rewards, connect, import_serve,
                                              start_service, stop_service)

    cfg = load_service_config(args.config, list(args.overrides))
    if args.address:
        cfg.address = args.address
    check_rewards(cfg)  # an unknown reward or kwarg is one line before Ray starts
    check_port(cfg)
    import_serve()
    import ray

    started = connect(cfg.address)
    deployed = False
    try:
        check_resources(cfg)
        deployed = True  # from here on Serve may hold deployments to take down
        url = start_service(cfg)
        print(f"serving {[spec.name for spec in cfg.rewards]} on {url}", flush=True)
        wait_for_interrupt()
    finally:
        if deployed:
            stop_service()
        if started:
            ray.shutdown()


def wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM (turned into Ctrl-C, so a supervisor's stop also shuts Serve down)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
