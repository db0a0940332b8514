"""The reward service (``flowrl serve-rewards``) with a CPU reward, toyeval: throughput, a replica killed mid-run,
and a request over the size cap. Prints markdown tables (docs/remote_reward.md, "Measured").

1. Throughput: images/s scored over HTTP by ``--clients`` concurrent client threads (as several trainer processes
   would), each sending ``--requests`` requests of ``--batch`` toy-world images, for 1 and 2 replicas x batching on
   (``max_batch_size`` 32) and off (1). Each setting is its own ``flowrl serve-rewards`` process joined to one
   local Ray cluster, stopped with SIGTERM before the next (the command's own shutdown path).
2. A replica killed mid-run: a short toy GRPO run (configs/toy/grpo.yaml, ``--epochs`` epochs, its reward the
   service's toyeval through ``rewards: [{name: remote, ...}]``) runs twice against a service of 2 replicas: once
   untouched, once with one replica killed (``ray.kill``) while a /score request of epoch 1 is in flight. That
   service waits 0.5 s for a batch to fill, so the kill, 0.15 s into the request, finds the request's calls waiting
   in both replicas (with the 10 ms wait of part 1 the calls of a small request are often done before). Reported:
   the retries the run logged, the /score requests the ingress answered by status, the images it scored against
   the images the run sent, and whether the per-epoch metrics equal the untouched run's (equal: no score lost or
   duplicated).
3. A request over the size cap (``max_request_bytes`` 1 MiB here): the client's one line, once from a client that
   learned the cap from /health (refused before sending) and once from one that did not (the service's HTTP 413).

Run from the repository root, pinned to one core (the numbers are then contended by Ray's own processes; the
toy run and the service share the core):
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/bench/reward_service.py
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
CAP = 2 ** 20  # the kill and size-cap service's max_request_bytes
KILL_WAIT = 0.5  # the kill service's batch_wait_s: a request's 8 calls wait this long in the replicas for a batch
KILL_AFTER = 0.15  # seconds into a request when the replica is killed: its calls are waiting in both replicas
TIMING = re.compile(r"time|_s$|/s$|per_s|sec|wall")  # metrics that are clocks, not scores


# ------------------------------------------------------------------------------------ the service

class Service:
    """``flowrl serve-rewards`` on a temporary config, joined to the benchmark's Ray cluster; stopped with SIGTERM."""

    def __init__(self, address: str, port: int, replicas: int, max_batch_size: int, max_request_bytes: int,
                 batch_wait_s: float = 0.01):
        self.config = Path(tempfile.mkstemp(suffix=".yaml")[1])
        self.config.write_text(yaml.safe_dump({
            "port": port, "max_request_bytes": max_request_bytes,
            "rewards": [{"name": "toyeval", "replicas": replicas, "num_cpus": 0.5, "max_batch_size": max_batch_size,
                         "batch_wait_s": batch_wait_s}]}))
        self.proc = subprocess.Popen([sys.executable, "-m", "flowrl", "serve-rewards", str(self.config), "--address",
                                      address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        if not line.startswith("serving "):
            self.stop()
            raise SystemExit(f"flowrl serve-rewards did not start: {line!r}")
        self.url = line.rsplit(" on ", 1)[1].strip()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # the command shuts Serve down on SIGTERM
        self.proc.wait(120)
        self.config.unlink()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ingress_stats() -> dict:
    from ray import serve

    from flowrl.reward_service.launch import APP_NAME, INGRESS

    return serve.get_deployment_handle(INGRESS, app_name=APP_NAME).stats.remote().result()


def wait_healthy(url: str, limit: float = 300.0) -> float:
    """Seconds until GET /health answers 200 (every deployment healthy again)."""
    import urllib.error
    import urllib.request

    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10):
                return time.perf_counter() - start
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise SystemExit(f"the service at {url} was not healthy again within {limit:.0f} s")


def toyeval_replicas() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::flowrl_rewards#toyeval#")]


# ------------------------------------------------------------------------------------ 1. throughput

def toy_images(n: int, seed: int = 0):
    from flowrl.toy.prompts import all_prompts
    from flowrl.toy.world import render_batch

    items = all_prompts()[::37][:n]
    images, _ = render_batch([spec for _, spec in items], rng=seed)
    return images, [p for p, _ in items], [spec for _, spec in items]


def throughput(url: str, clients: int, requests: int, batch: int) -> float:
    """images/s over ``clients`` threads, each sending ``requests`` requests of ``batch`` images."""
    from rewards.remote import RemoteReward

    images, prompts, metadata = toy_images(batch)
    reward = RemoteReward(url, name="toyeval", batch_size=batch, num_workers=1)

    def send(count):
        for _ in range(count):
            reward(images, prompts, metadata)

    def clocked(count) -> float:
        threads = [threading.Thread(target=send, args=(count,)) for _ in range(clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    clocked(1)  # warm every replica: the first calls import what scoring needs
    return clients * requests * batch / clocked(requests)


# ------------------------------------------------------------------------------------ 2. the replica kill

class Retries(logging.Handler):
    """Collects the client's retry warnings (rewards.remote)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(url: str, run_dir: Path, epochs: int, kill_at: int | None) -> tuple[list[dict], int, list[str]]:
    """The toy GRPO run against ``url`` -> (its metrics rows, images it sent, retry lines it logged). ``kill_at``:
    kill a toyeval replica ``KILL_AFTER`` s into the run's /score request of that index (0-based, retries not
    counted), while the request's calls wait in the replicas for their batch to fill."""
    import ray

    import rewards.remote as remote
    from flowrl.cli import main

    requests, images, real_request, real_call = [0], [0], remote.RemoteReward._request, remote.RemoteReward.__call__

    def request(self, path, body, deadline=None):
        if path == "/score":
            if requests[0] == kill_at:
                victim = ray.get_actor(toyeval_replicas()[0], namespace="serve")
                threading.Timer(KILL_AFTER, ray.kill, args=(victim,)).start()
            requests[0] += 1
        return real_request(self, path, body, deadline)

    def call(self, batch, prompts, metadata):
        images[0] += int(torch.isfinite(batch).flatten(1).all(1).sum())  # the images it sends
        return real_call(self, batch, prompts, metadata)

    retries = Retries()
    logging.getLogger("rewards.remote").addHandler(retries)
    remote.RemoteReward._request, remote.RemoteReward.__call__ = request, call
    spec = {"url": url, "name": "toyeval", "batch_size": 8, "max_retries": 5, "backoff": 0.2, "num_workers": 1}
    try:
        code = main(["train", "configs/toy/grpo.yaml", f"run_dir={run_dir}", f"train.epochs={epochs}",
                     "sampling.prompts_per_batch=4", "train.micro_batch_size=32", "log.eval_every=0",
                     "log.report_prompts=0", "log.progress=false", "train.checkpoint_every=0",
                     "rewards=[{name: remote, kwargs: " + json.dumps(spec) + "}]"])
    finally:
        remote.RemoteReward._request, remote.RemoteReward.__call__ = real_request, real_call
        logging.getLogger("rewards.remote").removeHandler(retries)
    if code != 0:
        raise SystemExit(f"the toy run against the service failed (exit {code})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, images[0], retries.lines


def compare_metrics(a: list[dict], b: list[dict]) -> str:
    """Whether two runs' per-epoch metrics are equal, clocks aside (NaN equals NaN), in words."""
    def equal(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))

    keys = sorted({k for row in a + b for k in row if not TIMING.search(k)})
    differ = [k for k in keys if any(not equal(x.get(k), y.get(k)) for x, y in zip(a, b))]
    if len(a) != len(b) or differ:
        return f"differ: {len(a)} vs {len(b)} epochs; {', '.join(differ)}"
    means = ", ".join(f"{row['reward/toyeval_mean']:.4f}" for row in a) if "reward/toyeval_mean" in keys else "-"
    return f"equal: {len(keys)} keys x {len(a)} epochs (reward/toyeval_mean {means})"


# ------------------------------------------------------------------------------------ 3. the size cap

def over_the_cap(url: str) -> list[str]:
    from rewards.remote import RemoteReward, RemoteRewardError

    noise = torch.rand(120, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # ~2 MB of PNGs
    lines = []
    for reward in (RemoteReward(url, batch_size=120), RemoteReward(url, batch_size=120, check_health=False)):
        try:
            reward(noise, ["noise"] * 120, [{}] * 120)
            lines.append("(no error)")
        except RemoteRewardError as err:
            lines.append(f"{err} [retries: {reward.retries}]")
    return lines


# ------------------------------------------------------------------------------------ main

def measure_throughput(address: str, args: argparse.Namespace, cores: int) -> None:
    print(f"### Throughput: toyeval, {args.clients} client threads x {args.requests} requests x {args.batch} "
          f"images of 64 px; {cores} CPU core(s), shared by the clients, Ray and the replicas\n")
    print("| replicas | max_batch_size | images/s |\n|---|---|---|")
    for replicas in (1, 2):
        for batch_size in (32, 1):
            with Service(address, args.port, replicas, batch_size, 64 * 2 ** 20) as service:
                rate = throughput(service.url, args.clients, args.requests, args.batch)
            print(f"| {replicas} | {batch_size}{' (off)' * (batch_size == 1)} | {rate:.0f} |", flush=True)


def kill_and_cap(address: str, args: argparse.Namespace) -> None:
    with Service(address, args.port, 2, 32, CAP, KILL_WAIT) as service, tempfile.TemporaryDirectory() as tmp:
        plain, images, plain_retries = train(service.url, Path(tmp) / "plain", args.epochs, None)
        before = ingress_stats()
        first_of_epoch_1 = before["replies"].get(200, 0) // args.epochs  # the untouched run's requests per epoch
        killed, _, kill_retries = train(service.url, Path(tmp) / "killed", args.epochs, first_of_epoch_1 + 1)
        after = ingress_stats()
        verdict = compare_metrics(plain, killed)
        replies = {int(k): after["replies"].get(k, 0) - before["replies"].get(k, 0) for k in after["replies"]}
        print(f"\n### A toyeval replica killed mid-run: toy GRPO, {args.epochs} epochs, 2 replicas (batch_wait_s "
              f"{KILL_WAIT}), the kill {KILL_AFTER} s into /score request {first_of_epoch_1 + 1} of "
              f"{before['replies'].get(200, 0)}\n")
        print("| run | retries logged | /score replies | images scored (HTTP 200) | images the run sent | "
              "per-epoch metrics |\n|---|---|---|---|---|---|")
        print(f"| untouched | {len(plain_retries)} | {before['replies']} | {before['images']} | {images} | - |")
        print(f"| replica killed | {len(kill_retries)} | {replies} | {after['images'] - before['images']} | {images} "
              f"| {verdict} |")
        print(f"\nThe replacement replica made the service healthy again {wait_healthy(service.url):.0f} s after the "
              "run ended. The retries the killed run logged:\n")
        for line in kill_retries:
            print(f"    {line}")
        print(f"\n### A request over the size cap (max_request_bytes={CAP})\n")
        for line in over_the_cap(service.url):
            print(f"    {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="concurrent client threads in the throughput runs")
    ap.add_argument("--requests", type=int, default=6, help="requests per client thread")
    ap.add_argument("--batch", type=int, default=32, help="images per request")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each toy run")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--parts", default="throughput,kill", help="which parts to run: throughput, kill (the replica "
                    "kill and the size cap)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    os.chdir(REPO)
    import ray

    from flowrl.reward_service.launch import worker_env

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=worker_env())
    address = ray.get_runtime_context().gcs_address
    cores = len(os.sched_getaffinity(0))

    if "throughput" in parts:
        measure_throughput(address, args, cores)
    if "kill" in parts:
        kill_and_cap(address, args)
    ray.shutdown()


if __name__ == "__main__":
    main()
