"""Misbehaving rewards and reward servers for tests/training/test_faults.py and tests/commands/test_bad_input.py.

Rewards are named in configs by dotted path (``tests.fault_helpers:AllNan``); servers speak the remote
reward wire format (rewards/remote.py) badly in one chosen way each.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

TINY_TRAIN = ["configs/smoke/sd3_tiny.yaml", "log.eval_every=0", "log.report_prompts=0", "log.progress=false",
              "sampling.num_steps=2", "sampling.group_size=2", "sampling.prompts_per_batch=1",
              "train.micro_batch_size=2", "train.async_rewards=false", "lora.rank=2"]
"""A 1-prompt, 2-image, 2-step SD3 tiny run: about a second an epoch on a CPU."""


class AllNan:
    """Could not score any image, ever."""

    name = "all_nan"

    def __call__(self, images, prompts, metadata):
        return {self.name: torch.full((images.shape[0],), math.nan)}


class Raising:
    name = "raising"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("judge model crashed")


class WrongShape:
    name = "wrong_shape"

    def __call__(self, images, prompts, metadata):
        return {self.name: torch.zeros(images.shape[0] + 1)}


class NotADict:
    name = "not_a_dict"

    def __call__(self, images, prompts, metadata):
        return [0.0] * images.shape[0]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, mode = len(body["images"]), self.server.mode
        self.server.requests += 1
        if mode == "dies" and self.server.requests > self.server.serve_first:
            self.close_connection = True
            self.send_response(503)
            self.end_headers()
            return
        if mode == "slow":
            time.sleep(self.server.delay)
        scores: object = [0.5] * n
        raw = None
        if mode == "bad_json":
            raw = b"<html>not json"
        elif mode == "short":
            scores = [0.5] * (n - 1)
        elif mode == "strings":
            scores = ["high"] * n
        elif mode == "nan":
            raw = ('{"scores": {"judge": [' + ", ".join(["NaN"] * n) + "]}}").encode()
        elif mode == "huge":
            raw = json.dumps({"scores": {"judge": [0.5] * n}, "pad": "x" * (17 * 2 ** 20)}).encode()
        elif mode == "list":
            raw = b"[1, 2, 3]"
        raw = raw if raw is not None else json.dumps({"scores": {"judge": scores}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(raw)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def reward_server(mode: str = "ok", *, serve_first: int = 0, delay: float = 2.0):
    """A judge on 127.0.0.1 (yields its URL) that misbehaves as ``mode`` says: ok, slow, bad_json, short,
    strings, nan, huge, list, or dies (HTTP 503 after ``serve_first`` good replies)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.mode, server.requests, server.serve_first, server.delay = mode, 0, serve_first, delay
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class TrickleServer:
    """A judge on 127.0.0.1 that answers one byte every ``interval`` seconds, never finishing: from the
    status line on (``part="head"``: the status line, then one endless header) or after the status line
    and headers (``part="body"``: a JSON body of endless spaces). Each byte comes long before any
    per-operation timeout, so only a total deadline ends a request. A connection gives up after
    ``give_up`` seconds, so a client without a deadline fails a test instead of hanging it.
    ``connections`` counts the attempts that reached it."""

    HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"

    def __init__(self, part: str, interval: float, give_up: float) -> None:
        assert part in ("head", "body"), part
        self.part, self.interval, self.give_up = part, interval, give_up
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._trickle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _trickle(self, conn: socket.socket) -> None:
        if self.part == "head":
            data = itertools.chain(b"HTTP/1.1 200 OK\r\nX-Slow: ", itertools.repeat(ord("a")))
        else:
            conn.sendall(self.HEAD)
            data = itertools.repeat(ord(" "))
        end = time.monotonic() + self.give_up
        with conn:
            for byte in data:
                if self._stop.is_set() or time.monotonic() > end:
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:  # the client shut the connection down: this attempt is over
                    return
                self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()


@contextlib.contextmanager
def trickle_server(part: str = "body", *, interval: float = 0.05, give_up: float = 10.0):
    """A `TrickleServer` for the duration of the block."""
    server = TrickleServer(part, interval, give_up)
    try:
        yield server
    finally:
        server.close()


def remote_spec(url: str, **kwargs) -> str:
    """The ``rewards=[...]`` override of a remote judge at ``url`` with quick retries."""
    options = {"url": url, "name": "judge", "max_retries": 2, "backoff": 0.0, "timeout": 0.5, "num_workers": 1,
               **kwargs}
    return "rewards=[{name: remote, kwargs: " + json.dumps(options) + "}]"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
    """A real filesystem of ``size_kib`` KiB (a tmpfs) mounted on ``path``, unmounted afterwards; skips the test
    where it cannot be mounted (not root, no mount(8), a container without the capability)."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs root to mount a tmpfs")
    if shutil.which("mount") is None:
        pytest.skip("a real full disk needs mount(8) to mount a tmpfs")
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a real full disk: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True)  # a file still open: detach it
