"""RemoteReward: score images with a judge served over HTTP (`flowrl serve-rewards`, a GenEval server, an
sglang/vLLM VLM judge).

Why: some judges are too big, or need a different environment, to live in the training process.
The trainer sends each chunk of images to a server and gets scores back; the reward behaves like any
local one (`flowrl.rewards_api.Reward`), so `score`/`AsyncScorer` and their error policy apply as is.

Wire format, version 1 (`flowrl.reward_wire`, docs/remote_reward.md; `flowrl serve-rewards CONFIG` serves
it on Ray Serve)::

    POST {url}/score   Content-Type: application/json
      {"version": 1,
       "images": ["<base64 of a PNG or JPEG file>", ...],      # N images, RGB, 8 bits per channel
       "image_format": "png" | "jpeg",
       "prompts": ["...", ...],                                # N strings
       "metadata": [{...}, ...],                               # N JSON objects (or null)
       "groups": [0, 0, ...]}                                  # optional: N group ids (group-wise judges)
    200 -> {"scores": {"<name>": [float | null, ...],          # N values each; null = could not score
                       "<name>/<sub>": [...], ...}}
    4xx/5xx -> {"error": "<one-line message>"}                 # (a plain-text body is accepted too)

    GET {url}/health
    200 -> {"status": "ok", "rewards": ["<name>", ...], "version": 1,
            "max_request_bytes": 67108864}                     # optional: the server's cap on a /score body

At construction the client asks ``/health`` (a few quick tries within one ``deadline``), so a run whose judge
is down or speaks another wire version stops at start, in one line, before it samples anything
(``check_health=False`` skips it for a server without ``/health``); a request over the ``max_request_bytes`` it
reports is refused before it is sent. With ``groups=True`` the reward is
group-wise (``scores_groups``): flowrl's scorer calls it once per group, and each call goes out as one request,
never split by ``batch_size``, with every row in group 0.

Returned keys are renamed into this reward's namespace: the main key becomes ``name``,
``"<main>/<sub>"`` becomes ``"<name>/<sub>"``, and any other key ``k`` (another reward the same
server runs) becomes ``"<name>/<k>"``, so several remote judges can coexist under distinct names.
Images holding NaN/inf are never sent: they score NaN locally (could not score, never zero); a
sub-key absent from one chunk's reply is NaN for that chunk's rows.

Failures: every attempt has two clocks. ``timeout`` bounds each socket operation (connect, one
send, one read); ``deadline`` bounds the whole attempt (connect, sending the request, and the whole
reply: status line, headers and body), so a server that answers one byte at a time, each byte in
time for ``timeout``, still cannot hold the trainer for longer than ``deadline`` per attempt. Past
it the attempt's sockets are shut down and it counts as timed out. Connection errors, timeouts,
HTTP 5xx and 429 are retried up to ``max_retries`` attempts in all, with exponential backoff
(``backoff * 2**k``, capped at ``max_backoff``; each retry is a logged warning, counted in
``retries``), so one request takes at most about ``max_retries * deadline`` plus the backoff sleeps
(host-name lookup is the OS resolver's and not bounded here); other 4xx (413 included) are the
client's fault and raise at once with the server's message.
Every failure is a one-line `RemoteRewardError` (a RuntimeError), so `score(on_error="nan")` can
mark the batch NaN and go on.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from flowrl.reward_wire import IMAGE_FORMATS, WIRE_VERSION, encode_image, to_uint8

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 16 * 2 ** 20  # a reply of N floats is kilobytes; more is a misbehaving server
DEADLINE = 300.0  # seconds per attempt: a judge scoring one chunk takes seconds, a stuck one forever


class RemoteRewardError(RuntimeError):
    """A remote reward could not be scored: unreachable, timed out, rejected, or a malformed reply."""


class ServiceUnavailable(RemoteRewardError, ValueError):
    """The judge did not pass its health check at construction: a setup problem (service down, wrong URL), so it
    is also a ValueError, which `flowrl.rewards_api.build_reward` reports in one line before the run starts."""


def _one_line(text: Any, limit: int = 300) -> str:
    s = re.sub(r"\s+", " ", str(text)).strip()
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ------------------------------------------------------------------------------------ encoding

def _jsonable(obj: Any) -> Any:
    """json.dumps fallback for metadata: tensors and numpy values become lists/numbers."""
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"metadata value of type {type(obj).__name__} is not JSON-serialisable")


def _number(name: str, value: Any, kind: type) -> Any:
    """``value`` as a ``kind`` (int or float): a setting written as text that is not a number (``deadline:
    forever``) is a one-line error naming the setting, not Python's bare conversion message."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number (seconds where it is a time)"
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


# ------------------------------------------------------------------------------------ the deadline

class _Deadline:
    """The total time one attempt may take: when it passes, every socket of the attempt is shut down.

    Why a timer and not only socket timeouts: a socket timeout bounds one recv, and a server that sends
    one byte per recv resets it forever. ``shutdown(SHUT_RDWR)`` makes a recv or send blocked in the
    attempt's thread return at once (EOF or an error), wherever http.client is: sending the request,
    or reading the status line, headers or body, over plain TCP or TLS. Use as a context manager: the
    timer thread is always cancelled and joined on exit, so none outlives its attempt.
    """

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        self._timer.join()
        with self._lock:
            self._socks.clear()

    def clip(self, timeout: Any) -> float:
        """A socket timeout no longer than the time left (``timeout`` may be None or urllib's default)."""
        left = self._end - time.monotonic()
        return max(min(timeout, left) if isinstance(timeout, (int, float)) else left, 1e-3)

    def watch(self, sock: socket.socket) -> socket.socket:
        """Shut ``sock`` down when the deadline passes (at once if it already has) -> ``sock``."""
        with self._lock:
            if not self.expired:
                if sock not in self._socks:  # plain HTTP hands over its one socket twice
                    self._socks.append(sock)
                return sock
        _shutdown(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by http.client, or never connected
        pass


class _WatchedConnection:
    """Mixin for http.client connections: every socket they open is handed to a `_Deadline`."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        self._create_tcp = self._create_connection
        self._create_connection = self._create_watched

    def _create_watched(self, address: Any, timeout: Any = None, *args: Any, **kwargs: Any) -> socket.socket:
        """The TCP socket: connect within the time left, then watched before any proxy CONNECT or TLS
        handshake; its timeout (inherited by the TLS socket, whose handshake CPython bounds by it as a
        whole) is cut to the time left, as the timer cannot shut a socket down mid-wrap."""
        sock = self._create_tcp(address, self._deadline.clip(timeout), *args, **kwargs)
        sock.settimeout(self._deadline.clip(timeout))
        return self._deadline.watch(sock)

    def connect(self) -> None:
        super().connect()
        self._deadline.watch(self.sock)  # the TLS socket once wrapped (the TCP one is detached by then)


class _WatchedHTTPConnection(_WatchedConnection, http.client.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_WatchedConnection, http.client.HTTPSConnection):
    pass


class _WatchedHandler:
    """Mixin for urllib's HTTP(S) handlers: connect through the calling thread's current `_Deadline`.

    One opener serves every thread (proxies, TLS context), so the attempt's deadline travels in a
    thread-local rather than in the opener; redirects made inside the attempt inherit it.
    """

    connection_class: type

    def __init__(self, local: threading.local, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._local = local

    def do_open(self, http_class: Any, req: urllib.request.Request, **kwargs: Any) -> Any:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            http_class = functools.partial(self.connection_class, deadline=deadline)
        return super().do_open(http_class, req, **kwargs)


class _HTTPHandler(_WatchedHandler, urllib.request.HTTPHandler):
    connection_class = _WatchedHTTPConnection


class _HTTPSHandler(_WatchedHandler, urllib.request.HTTPSHandler):
    connection_class = _WatchedHTTPSConnection


# ------------------------------------------------------------------------------------ the client

class RemoteReward:
    """A reward scored by an HTTP server speaking the wire format above.

    url: server base URL (``http://host:port``; "/score" and "/health" are appended).
    name: this reward's name, the prefix of every key it returns (several remote judges can coexist).
    timeout: seconds allowed per socket operation (connect, each send, each read) of one request.
    deadline: seconds allowed for one whole attempt (connect, send, status line, headers and body);
        past it the attempt counts as timed out and is retried like any timeout. Default 300.
    max_retries: attempts in all per request (>= 1), on connection errors, timeouts, 5xx and 429.
    backoff / max_backoff: sleep ``min(backoff * 2**k, max_backoff)`` after failed attempt k (0-based).
    batch_size: images per request. image_format: "png" (lossless) or "jpeg" (``jpeg_quality``).
    main_key: the returned key that is the main score; default: ``name`` if the server returns it,
        else the first key of the reply (the reference server puts its first reward's main key first).
    num_workers: threads encoding images (PIL releases the GIL while compressing).
    use_env_proxy: honour http_proxy/no_proxy; off by default because judges usually sit on the
        cluster network, where a proxy meant for the internet only gets in the way.
    max_response_bytes: a reply larger than this (default 16 MiB) is refused unread, so a broken server
        cannot fill the trainer's memory.
    groups: a group-wise judge: ``scores_groups`` is set, so flowrl's scorer calls it once per group, and each
        call is sent as one request (``batch_size`` does not split it) whose rows all carry group id 0.
    check_health: ask ``/health`` at construction (``max_retries`` quick tries within one ``deadline``) and
        raise `ServiceUnavailable` in one line if the judge is down; off for a server without ``/health``.
    """

    def __init__(self, url: str, name: str = "remote", timeout: float = 60.0, max_retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 10.0, batch_size: int = 32,
                 image_format: str = "png", jpeg_quality: int = 95, main_key: str | None = None,
                 num_workers: int = 4, use_env_proxy: bool = False,
                 max_response_bytes: int = MAX_RESPONSE_BYTES, deadline: float = DEADLINE, groups: bool = False,
                 check_health: bool = True) -> None:
        jpeg_quality, max_retries, batch_size, max_response_bytes, num_workers = (
            _number(name, value, int) for name, value in (
                ("jpeg_quality", jpeg_quality), ("max_retries", max_retries), ("batch_size", batch_size),
                ("max_response_bytes", max_response_bytes), ("num_workers", num_workers)))
        timeout, backoff, max_backoff, deadline = (
            _number(name, value, float) for name, value in (
                ("timeout", timeout), ("backoff", backoff), ("max_backoff", max_backoff), ("deadline", deadline)))
        parsed = urllib.parse.urlparse(str(url))
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url must look like http://host:port, got {url!r}")
        if not name or not isinstance(name, str) or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if not 1 <= int(jpeg_quality) <= 100:
            raise ValueError(f"jpeg_quality must be in [1, 100], got {jpeg_quality}")
        if int(max_retries) < 1 or int(batch_size) < 1:
            raise ValueError(f"max_retries and batch_size must be >= 1, got {max_retries}, {batch_size}")
        if not (math.isfinite(float(timeout)) and float(timeout) > 0) or not float(backoff) >= 0 \
                or not float(max_backoff) >= 0:
            raise ValueError("timeout must be finite and > 0, and backoff, max_backoff >= 0")
        if not (math.isfinite(float(deadline)) and float(deadline) > 0):
            raise ValueError(f"deadline must be finite and > 0 seconds (the most one attempt may take), "
                             f"got {deadline}")
        if int(max_response_bytes) < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        self.max_response_bytes = int(max_response_bytes)
        self.url = str(url).rstrip("/")
        self.name, self.main_key = name, main_key
        self.timeout, self.deadline, self.max_retries = float(timeout), float(deadline), int(max_retries)
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.batch_size, self.image_format = int(batch_size), image_format
        self.jpeg_quality, self.num_workers = int(jpeg_quality), max(1, int(num_workers))
        self._local = threading.local()  # the current attempt's _Deadline, per calling thread
        handlers = [_HTTPHandler(self._local), _HTTPSHandler(self._local)]
        if not use_env_proxy:
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)
        self.max_request_bytes: int | None = None  # the service's cap on a /score body, as its /health says
        self.retries = 0  # failed attempts that were retried, over this client's life
        if groups:
            self.scores_groups = True  # flowrl's scorer: call once per group, with exactly that group's rows
        if check_health:
            self._check_health()

    # ---------------------------------------------------------------------------- public

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        n = images.shape[0]
        finite = torch.isfinite(images.detach()).flatten(1).all(1).cpu()  # [N]
        keep = finite.nonzero().flatten().tolist()  # rows worth sending
        out = {self.name: torch.full((n,), math.nan)}
        # Not rewards.base.chunked: sub-keys may differ between chunks (a server scoring with
        # on_error="nan" drops a failed reward's sub-scores), so rows missing a key stay NaN here.
        chunk = len(keep) if self.grouped else self.batch_size  # a group goes whole, in one request
        for start in range(0, len(keep), max(chunk, 1)):
            rows = keep[start:start + chunk]
            idx = torch.tensor(rows)
            body = self._body(images[idx.to(images.device)], [prompts[i] for i in rows],
                              [metadata[i] for i in rows])
            for key, value in self._parse(self._request("/score", body), len(rows)).items():
                out.setdefault(key, torch.full((n,), math.nan))[idx] = value
        return out

    @property
    def grouped(self) -> bool:
        """Whether this judge scores whole groups (``groups=True``)."""
        return getattr(self, "scores_groups", False)

    def health(self) -> dict:
        """GET {url}/health -> the server's reply (with the same retries and one-line errors)."""
        return self._request("/health", None)

    def _check_health(self) -> None:
        """GET /health with ``max_retries`` quick tries sharing one ``deadline``: a judge that is down, unhealthy or
        speaks another wire version is one `ServiceUnavailable` line now rather than an error at the first batch."""
        try:
            reply = self._request("/health", None, deadline=self.deadline / self.max_retries)
        except RemoteRewardError as err:
            raise ServiceUnavailable(str(err)) from None
        cap = reply.get("max_request_bytes")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
            self.max_request_bytes = cap
        version = reply.get("version", WIRE_VERSION)
        if reply.get("status") != "ok" or version != WIRE_VERSION:
            raise ServiceUnavailable(self._where(
                f"is not ready: its health reply is {_one_line(json.dumps(reply), 200)} (expected status 'ok' and "
                f"version {WIRE_VERSION})", self.url + "/health"))

    # ---------------------------------------------------------------------------- request

    def _body(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any]) -> bytes:
        arrs = list(to_uint8(images))

        def enc(a: np.ndarray) -> str:
            return encode_image(a, self.image_format, self.jpeg_quality)

        if self.num_workers > 1 and len(arrs) > 1:
            with ThreadPoolExecutor(min(self.num_workers, len(arrs))) as pool:
                encoded = list(pool.map(enc, arrs))
        else:
            encoded = [enc(a) for a in arrs]
        body = {"version": WIRE_VERSION, "images": encoded, "image_format": self.image_format,
                "prompts": list(prompts), "metadata": list(metadata)}
        if self.grouped:
            body["groups"] = [0] * len(encoded)  # this call is one group (the scorer's group-wise contract)
        try:
            data = json.dumps(body, default=_jsonable).encode("utf-8")
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(self._where(f"cannot send metadata as JSON: {_one_line(err)}")) from None
        if self.max_request_bytes is not None and len(data) > self.max_request_bytes:
            # Refused here rather than sent: a server answering 413 before reading a body that big resets the
            # connection mid-send, which would look like a network failure and be retried.
            raise RemoteRewardError(self._where(
                f"would send {len(data)} bytes for {len(encoded)} images, over the service's max_request_bytes="
                f"{self.max_request_bytes} (from its /health); lower batch_size or raise max_request_bytes in the "
                "service config"))
        return data

    def _request(self, path: str, body: bytes | None, deadline: float | None = None) -> dict:
        """One request with bounded retries -> the decoded JSON object; RemoteRewardError otherwise.

        ``deadline``: seconds per attempt, ``self.deadline`` unless given (the health check shares one)."""
        endpoint = self.url + path
        per_attempt = self.deadline if deadline is None else deadline
        kind, detail = "failed", ""
        for attempt in range(self.max_retries):
            if attempt:
                pause = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                self.retries += 1
                logger.warning("remote reward '%s' at %s: attempt %d of %d failed (%s); retrying in %.2f s", self.name,
                               endpoint, attempt, self.max_retries, detail, pause)
                time.sleep(pause)
            req = urllib.request.Request(endpoint, data=body, method="POST" if body is not None else "GET",
                                         headers={"Content-Type": "application/json"})
            raw, status, msg, failure = b"", 0, "", None
            with _Deadline(per_attempt) as clock:
                self._local.deadline = clock
                try:
                    with self._opener.open(req, timeout=min(self.timeout, per_attempt)) as resp:
                        raw = resp.read(self.max_response_bytes + 1)  # never more than the cap into memory
                except urllib.error.HTTPError as err:
                    status, msg = err.code, _server_message(err)  # its body is read within the deadline too
                except (urllib.error.URLError, OSError, HTTPException) as err:
                    failure = _classify(err)
                finally:
                    self._local.deadline = None
            if clock.expired:  # what a shut-down socket gave back last (EOF, a reset, half a body) is no reply
                kind, detail = "timed out", "timed out"
                continue
            if failure is not None:
                kind, detail = failure
                continue
            if status:
                if status != 429 and status < 500:  # the request is wrong: retrying cannot help
                    raise RemoteRewardError(self._where(f"rejected the request: HTTP {status}: {msg}", endpoint))
                kind, detail = "failed", f"HTTP {status}: {msg}"
                continue
            if len(raw) > self.max_response_bytes:
                raise RemoteRewardError(self._where(f"replied with more than max_response_bytes="
                                                    f"{self.max_response_bytes} bytes; refused (raise "
                                                    "max_response_bytes if the server is right)", endpoint))
            try:
                reply = json.loads(raw)
            except ValueError:
                raise RemoteRewardError(self._where(f"replied with invalid JSON: {_one_line(raw[:200])}",
                                                    endpoint)) from None
            if not isinstance(reply, dict):
                raise RemoteRewardError(self._where(f"replied with {type(reply).__name__}, "
                                                    "expected a JSON object", endpoint))
            return reply
        n = self.max_retries
        if kind == "timed out":
            summary = (f"timed out after {n} attempts (timeout={self.timeout}s per socket operation, "
                       f"deadline={round(per_attempt, 3)}s per attempt)")
        elif kind == "unreachable":
            summary = f"unreachable after {n} attempts: {detail} ({self._start_hint()})"
        else:
            summary = f"failed after {n} attempts: {detail}"
        raise RemoteRewardError(self._where(summary, endpoint))

    def _parse(self, reply: dict, n: int) -> dict[str, torch.Tensor]:
        """Check a /score reply and rename its keys into this reward's namespace."""
        scores = reply.get("scores")
        if not isinstance(scores, dict) or not scores:
            got = sorted(reply) if not isinstance(scores, dict) else "an empty 'scores'"
            raise RemoteRewardError(self._where(f"reply needs a non-empty 'scores' object, got {got}"))
        main = self.main_key or (self.name if self.name in scores else next(iter(scores)))
        if main not in scores:
            raise RemoteRewardError(self._where(f"reply has no main key {main!r} (got {sorted(scores)}); "
                                                "set main_key to one of them"))
        out: dict[str, torch.Tensor] = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != n:
                size = len(values) if isinstance(values, list) else type(values).__name__
                raise RemoteRewardError(self._where(f"key {key!r} has {size} values for {n} images"))
            if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
                raise RemoteRewardError(self._where(f"key {key!r} holds values other than numbers or null"))
            if not all(v is None or math.isfinite(v) for v in values):  # json.loads reads NaN / Infinity
                raise RemoteRewardError(self._where(f"key {key!r} holds NaN or Infinity; send null for an image "
                                                    "that could not be scored"))
            tensor = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
            if key == main:
                new = self.name
            elif key.startswith(main + "/"):
                new = f"{self.name}/{key[len(main) + 1:]}"
            else:
                new = f"{self.name}/{key}"
            if new in out:
                raise RemoteRewardError(self._where(f"reply keys collide as {new!r} (got {sorted(scores)})"))
            out[new] = tensor
        return {self.name: out.pop(self.name), **out}  # main key first

    # ---------------------------------------------------------------------------- messages

    def _where(self, what: str, endpoint: str | None = None) -> str:
        return _one_line(f"remote reward '{self.name}' at {endpoint or self.url + '/score'} {what}", 800)

    def _start_hint(self) -> str:
        port = urllib.parse.urlparse(self.url).port or 8765
        return (f"is the service running? start it with: flowrl serve-rewards CONFIG port={port} "
                "(configs/serve/ holds examples)")


def _server_message(err: urllib.error.HTTPError) -> str:
    """The server's one-line error: {"error": ...} when JSON, else the text body, else the reason."""
    try:
        raw = err.read(65536)  # the message is one line; never read an unbounded error body
    except Exception:
        raw = b""
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and "error" in data:
            return _one_line(data["error"])
    except ValueError:
        pass
    return _one_line(raw.decode("utf-8", "replace")) or _one_line(err.reason) or "no message"


def _classify(err: BaseException) -> tuple[str, str]:
    """A transport failure -> ("timed out" | "unreachable", short reason)."""
    reason = err.reason if isinstance(err, urllib.error.URLError) else err
    if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
        return "timed out", "timed out"
    if isinstance(reason, ConnectionRefusedError):
        return "unreachable", "connection refused"
    if isinstance(reason, socket.gaierror):
        return "unreachable", f"cannot resolve host ({_one_line(reason)})"
    return "unreachable", _one_line(f"{type(reason).__name__}: {reason}")
