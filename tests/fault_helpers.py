"""Misbehaving rewards and reward servers for tests/training/test_faults.py, tests/commands/test_bad_input.py and
tests/rewards/test_rewards_remote.py.

Rewards are named in configs by dotted path (``tests.fault_helpers:AllNan``); servers speak the remote
reward wire format (flowrl/reward_wire.py), well or badly in one chosen way each: the test doubles of the reward
service (``flowrl serve-rewards``), which tests cannot make misbehave on purpose.
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

from flowrl.reward_wire import WIRE_VERSION, jsonable_scores, parse_request, to_float
from flowrl.rewards_api import RewardError, build_reward, score

TINY_TRAIN = ["configs/smoke/sd3_tiny.yaml", "log.eval_every=0", "log.report_prompts=0", "log.progress=false",
              "sampling.num_steps=2", "sampling.group_size=2", "sampling.prompts_per_batch=1",
              "train.micro_batch_size=2", "train.async_rewards=false", "lora.rank=2"]
"""A 1-prompt, 2-image, 2-step SD3 tiny run: about a second an epoch on a CPU."""


class AllNan:
    """Could not score any image, ever."""

    name = "all_nan"

    def __call__(self, images, prompts, metadata):
        return {self.name: torch.full((images.shape[0],), math.nan)}


class AllInf:
    """Scores every image +inf: as unusable as NaN."""

    name = "all_inf"

    def __call__(self, images, prompts, metadata):
        return {self.name: torch.full((images.shape[0],), math.inf)}


class Constant:
    """Scores every image 0.5: every group ties."""

    name = "constant"

    def __call__(self, images, prompts, metadata):
        return {self.name: torch.full((images.shape[0],), 0.5)}


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


class JudgeDouble(ThreadingHTTPServer):
    """A judge on 127.0.0.1 speaking the remote reward wire format (flowrl.reward_wire), well or badly on purpose:
    the reward service's stand-in where a test needs a server that misbehaves (slowness, injected 5xx or 4xx, broken
    replies, a server that dies). ``rewards`` (built, or names for build_reward) are scored for real; without any,
    every image scores 0.5 under the key ``judge``. ``mode``: ok, or a broken reply: bad_json, short, strings, nan,
    huge, list, or dies (HTTP 503 after ``serve_first`` good replies). ``delay`` sleeps in every /score request;
    the first ``fail_first`` /score requests answer ``fail_status``. ``hits`` counts /score requests. GET /health
    always answers, as a healthy service's does."""

    daemon_threads = True

    def __init__(self, rewards=(), mode: str = "ok", *, delay: float = 0.0, fail_first: int = 0,
                 fail_status: int = 503, serve_first: int = 0, on_error: str = "raise") -> None:
        super().__init__(("127.0.0.1", 0), _JudgeHandler)
        self.rewards = [build_reward(r) if isinstance(r, str) else r for r in rewards]
        self.mode, self.delay, self.on_error = mode, delay, on_error
        self.fail_first, self.fail_status, self.serve_first = fail_first, fail_status, serve_first
        self.hits = 0
        self.last_body: dict | None = None  # the last /score request's JSON (images included)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _JudgeHandler(BaseHTTPRequestHandler):
    server: JudgeDouble

    def do_GET(self):  # noqa: N802 (http.server's name)
        names = [r.name for r in self.server.rewards] or ["judge"]
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "rewards": names, "version": WIRE_VERSION})
        else:
            self._send(404, {"error": f"no such endpoint {self.path}"})

    def do_POST(self):  # noqa: N802
        srv = self.server
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with srv.lock:
            srv.hits += 1
            hit = srv.hits
            with contextlib.suppress(ValueError):
                srv.last_body = json.loads(raw)
        if srv.mode == "dies" and hit > srv.serve_first:
            self.close_connection = True
            self.send_response(503)
            self.end_headers()
            return
        time.sleep(srv.delay)
        if hit <= srv.fail_first:
            self._send(srv.fail_status, {"error": f"injected failure ({srv.fail_status})"})
        elif srv.rewards:
            self._score(raw)
        else:
            self._canned(len(json.loads(raw)["images"]))

    def _score(self, raw: bytes) -> None:
        srv = self.server
        try:
            req = parse_request(raw)
            with srv.lock:  # rewards need not be thread-safe
                out = score(srv.rewards, to_float(req.pixels), req.prompts, req.metadata, on_error=srv.on_error)
        except ValueError as err:  # BadRequest, or check_images rejecting the batch
            self._send(400, {"error": str(err)})
        except RewardError as err:
            self._send(500, {"error": str(err)})
        else:
            self._send(200, {"scores": {k: jsonable_scores(v) for k, v in out.items()}})

    def _canned(self, n: int) -> None:
        mode, scores, raw = self.server.mode, [0.5] * n, None
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
        self._send(200, {"scores": {"judge": scores}}, raw)

    def _send(self, status: int, payload: dict, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timed out): fine
            pass

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def judge_double(rewards=(), mode: str = "ok", **kwargs):
    """A running `JudgeDouble` for the duration of the block (yields it: ``.url``, ``.hits``)."""
    server = JudgeDouble(rewards, mode, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def reward_server(mode: str = "ok", *, serve_first: int = 0, delay: float = 2.0):
    """A judge scoring 0.5 that misbehaves as ``mode`` says (slow: ``delay`` seconds per request; see `JudgeDouble`
    for the rest); yields its URL."""
    with judge_double((), "ok" if mode == "slow" else mode, serve_first=serve_first,
                      delay=delay if mode == "slow" else 0.0) as server:
        yield server.url


class TrickleServer:
    """A judge on 127.0.0.1 that answers one byte every ``interval`` seconds, never finishing: from the
    status line on (``part="head"``: the status line, then one endless header) or after the status line
    and headers (``part="body"``: a JSON body of endless spaces). Each byte comes long before any
    per-operation timeout, so only a total deadline ends a request. A connection gives up after
    ``give_up`` seconds, so a client without a deadline fails a test instead of hanging it. GET /health answers
    at once, as a healthy service's does (the client asks it at construction); ``connections`` counts the other
    attempts that reached it."""

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
            thread = threading.Thread(target=self._trickle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _trickle(self, conn: socket.socket) -> None:
        if self._answered_health(conn):
            return
        self.connections += 1
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

    def _answered_health(self, conn: socket.socket) -> bool:
        """Read the request head; answer and close a GET /health -> whether it was one."""
        head = b""
        conn.settimeout(self.give_up)
        while b"\r\n\r\n" not in head and len(head) < 65536:
            try:
                chunk = conn.recv(4096)
            except OSError:
                break
            if not chunk:
                break
            head += chunk
        if not head.startswith(b"GET /health"):
            return False
        body = json.dumps({"status": "ok", "rewards": ["judge"], "version": WIRE_VERSION}).encode()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

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
