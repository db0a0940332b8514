"""Reference reward server for `rewards.remote.RemoteReward` (wire format: docs/remote_reward.md).

Why: it pins down the wire format with running code, lets a run use a reward from another process
or machine, and gives tests a real server (with injectable slowness and failures) to talk to.

    python -m rewards.server --port 8765 --reward brightness [--reward toyeval ...]
    flowrl-reward-server --port 8765 --reward brightness      # the same, as installed by pip

``--port 0`` picks a free port; the first line printed is ``serving [...] on http://HOST:PORT``.
``--delay S`` sleeps S seconds in every /score request (timeout tests); ``--fail-first N`` answers
the first N /score requests with ``--fail-status`` (503 by default; retry tests).
Rewards run one request at a time (a lock): reward models need not be thread-safe.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

import torch

from flowrl.rewards_api import Reward, RewardError, build_reward, score
from rewards.remote import IMAGE_FORMATS, WIRE_VERSION, decode_image

logger = logging.getLogger("flowrl.reward_server")


class BadRequest(ValueError):
    """The client sent something the wire format does not allow (-> HTTP 400)."""


def parse_request(body: bytes) -> tuple[torch.Tensor, list[str], list[Any]]:
    """A /score body -> (images [N,3,H,W] in [0,1], prompts, metadata); BadRequest otherwise."""
    try:
        req = json.loads(body)
    except ValueError as err:
        raise BadRequest(f"body is not JSON: {err}") from None
    if not isinstance(req, dict):
        raise BadRequest("body must be a JSON object")
    if req.get("version") != WIRE_VERSION:
        raise BadRequest(f"unsupported wire version {req.get('version')!r}; this server speaks {WIRE_VERSION}")
    if req.get("image_format", "png") not in IMAGE_FORMATS:
        raise BadRequest(f"image_format must be one of {IMAGE_FORMATS}, got {req.get('image_format')!r}")
    images, prompts = req.get("images"), req.get("prompts")
    metadata = req.get("metadata", [{}] * len(prompts) if isinstance(prompts, list) else None)
    if not all(isinstance(v, list) for v in (images, prompts, metadata)):
        raise BadRequest("'images', 'prompts' and 'metadata' must be lists")
    if not len(images) == len(prompts) == len(metadata) or not images:
        raise BadRequest(f"need N >= 1 images, prompts and metadata alike, got "
                         f"{len(images)}, {len(prompts)}, {len(metadata)}")
    decoded = []
    for i, data in enumerate(images):
        try:
            decoded.append(decode_image(data))
        except Exception as err:
            raise BadRequest(f"image {i} cannot be decoded: {type(err).__name__}: {err}") from None
    if len({tuple(x.shape) for x in decoded}) > 1:
        raise BadRequest("all images in one request must have the same size")
    return torch.stack(decoded), [str(p) for p in prompts], [m if m is not None else {} for m in metadata]


def _jsonable(values: torch.Tensor) -> list[float | None]:
    return [None if not math.isfinite(v) else v for v in values.tolist()]


class _Handler(BaseHTTPRequestHandler):
    server: "RewardServer"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: tests and training logs stay clean
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timed out): fine
            pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "rewards": [r.name for r in self.server.rewards],
                             "version": WIRE_VERSION})
        else:
            self._send(404, {"error": f"no such endpoint {self.path}; use GET /health or POST /score"})

    def do_POST(self) -> None:
        srv = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.rstrip("/") != "/score":
            self._send(404, {"error": f"no such endpoint {self.path}; use POST /score"})
            return
        with srv.lock:
            srv.hits += 1
            failing = srv.hits <= srv.fail_first
        if srv.delay:
            time.sleep(srv.delay)
        if failing:
            self._send(srv.fail_status, {"error": f"injected failure ({srv.fail_status})"})
            return
        try:
            images, prompts, metadata = parse_request(body)
            with srv.lock:
                out = score(srv.rewards, images, prompts, metadata, on_error=srv.on_error)
        except (BadRequest, ValueError) as err:  # ValueError: check_images rejected the batch
            self._send(400, {"error": str(err)})
            return
        except RewardError as err:
            self._send(500, {"error": str(err)})
            return
        except Exception as err:  # a server bug: say so rather than drop the connection
            logger.exception("scoring failed")
            self._send(500, {"error": f"{type(err).__name__}: {err}"})
            return
        self._send(200, {"scores": {k: _jsonable(v) for k, v in out.items()}})


class RewardServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the rewards, the fault-injection knobs and a /score hit counter."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], rewards: Sequence[Reward], delay: float = 0.0,
                 fail_first: int = 0, fail_status: int = 503, on_error: str = "raise") -> None:
        super().__init__(address, _Handler)
        self.rewards, self.on_error = list(rewards), on_error
        self.delay, self.fail_first, self.fail_status = float(delay), int(fail_first), int(fail_status)
        self.hits = 0  # /score requests seen, failed ones included
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def make_server(host: str, port: int, rewards: Sequence[Reward | str], delay: float = 0.0,
                fail_first: int = 0, fail_status: int = 503, on_error: str = "raise") -> RewardServer:
    """Bind (port 0 = a free port) without serving; call ``serve_forever()`` (e.g. in a thread).

    rewards: built rewards, or names/dotted paths for `build_reward`.
    """
    if not rewards:
        raise ValueError("give at least one reward")
    built = [build_reward(r) if isinstance(r, str) else r for r in rewards]
    names = [r.name for r in built]
    if len(set(names)) != len(names):
        raise ValueError(f"each reward may appear once, got {names}")
    if on_error not in ("raise", "nan"):
        raise ValueError(f"on_error must be 'raise' or 'nan', got {on_error!r}")
    return RewardServer((host, port), built, delay, fail_first, fail_status, on_error)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    ap.add_argument("--reward", action="append", required=True,
                    help="reward name or package.module:Class (repeatable)")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to sleep in every /score request")
    ap.add_argument("--fail-first", type=int, default=0, help="fail the first N /score requests")
    ap.add_argument("--fail-status", type=int, default=503, help="HTTP status of injected failures")
    ap.add_argument("--on-error", choices=("raise", "nan"), default="raise",
                    help="a raising reward: HTTP 500 (raise) or null scores (nan)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        server = make_server(args.host, args.port, args.reward, args.delay, args.fail_first,
                             args.fail_status, args.on_error)
    except (ValueError, OSError) as err:
        sys.exit(f"flowrl-reward-server: {err}")
    print(f"serving {[r.name for r in server.rewards]} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
