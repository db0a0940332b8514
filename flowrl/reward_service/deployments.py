"""The Ray Serve deployments of the reward service: a `RewardScorer` per reward and the HTTP `Ingress` in front.

Why this shape: each reward is its own deployment, so it gets its own replicas, CPUs or GPUs and runtime
environment (judges with conflicting dependencies side by side), and Serve's batching gathers the images of
concurrent requests (several trainer processes) into batches of the configured size. The ingress speaks the wire
format of docs/remote_reward.md (`flowrl.reward_wire`), so `RemoteReward` and any other client keep working.

The batching unit is one image for a pointwise reward (the ingress sends each image as its own call) and one whole
group for a group-wise reward (``scores_groups = True``: it is called once per group, with exactly that group's
rows). A replica returns a failure as a `Failure` value rather than raising it, so the ingress answers with the
reward's own one-line message instead of a remote traceback.

This module imports Ray at the top: only `flowrl.reward_service.launch` imports it, inside functions.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import JSONResponse

from flowrl.reward_wire import WIRE_VERSION, BadRequest, ScoreRequest, jsonable_scores, parse_request, to_float
from flowrl.rewards_api import RewardError, build_reward, group_rows, score

logger = logging.getLogger("flowrl.reward_service")

HEALTHY = "HEALTHY"


class Failure(NamedTuple):
    """A scoring call that failed: the HTTP status it maps to and a one-line message."""

    status: int
    message: str


Row = tuple[np.ndarray, str, Any]  # one image [H,W,3] uint8, its prompt, its metadata
Group = tuple[list[np.ndarray], list[str], list[Any]]  # one group's images, prompts and metadata


class RewardScorer:
    """One replica of one reward: builds it once, then scores batches of images or of groups."""

    def __init__(self, name: str, kwargs: dict[str, Any], max_batch_size: int, batch_wait_s: float,
                 on_error: str) -> None:
        try:
            self.reward, self.build_error = build_reward(name, **kwargs), None
        except Exception as error:  # noqa: BLE001  kept for the launcher's one line: raised here, Serve would print
            # this replica's traceback (and retry it) before the service could say what was wrong
            self.reward, self.build_error = None, " ".join(str(error).split()) or type(error).__name__
        self.on_error = on_error
        self.batches: Counter[int] = Counter()  # batch size -> batches of that size this replica scored
        for method in (self.score_rows, self.score_groups):
            method.set_max_batch_size(max_batch_size)
            method.set_batch_wait_timeout_s(batch_wait_s)

    def describe(self) -> dict[str, Any]:
        """The built reward's name and whether it scores whole groups; ``{"error": ...}`` when it could not be
        built (bad kwarg values, missing files)."""
        if self.build_error is not None:
            return {"error": self.build_error}
        return {"name": self.reward.name, "scores_groups": bool(getattr(self.reward, "scores_groups", False))}

    def batch_sizes(self) -> dict[int, int]:
        """{batch size: how many batches of that size} this replica scored: whether batching batches."""
        return dict(self.batches)

    def check_health(self) -> None:
        """Serve's periodic health check: the reward is built (cheap; a dead replica fails it by not answering)."""
        if getattr(self, "reward", None) is None and getattr(self, "build_error", None) is None:
            raise RuntimeError("the reward is not built")  # a build error is the launcher's to report, not a restart

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)  # the config's values are set in __init__
    async def score_rows(self, rows: list[Row]) -> list[dict[str, float] | Failure]:
        """A batch of single images (from any requests) -> each one's {key: score}."""
        self.batches[len(rows)] += 1
        return await asyncio.to_thread(self._score_rows, rows)  # the event loop keeps taking calls meanwhile

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def score_groups(self, groups: list[Group]) -> list[dict[str, list[float]] | Failure]:
        """A batch of whole groups -> each group's {key: [its rows' scores]}, the reward called once per group."""
        self.batches[len(groups)] += 1
        return await asyncio.to_thread(lambda: [self._score(*group, whole_group=True) for group in groups])

    def _score_rows(self, rows: list[Row]) -> list[dict[str, float] | Failure]:
        by_size: dict[tuple[int, ...], list[int]] = defaultdict(list)  # requests may differ in image size
        for i, (pixels, _, _) in enumerate(rows):
            by_size[pixels.shape].append(i)
        out: list[dict[str, float] | Failure] = [Failure(500, "not scored")] * len(rows)
        for idx in by_size.values():
            scored = self._score([rows[i][0] for i in idx], [rows[i][1] for i in idx], [rows[i][2] for i in idx])
            for j, i in enumerate(idx):
                out[i] = scored if isinstance(scored, Failure) else {k: v[j] for k, v in scored.items()}
        return out

    def _score(self, pixels: list[np.ndarray], prompts: list[str], metadata: list[Any], *, whole_group: bool = False
               ) -> dict[str, list[float]] | Failure:
        """One call of the reward on images of one size -> {key: [N] floats} (NaN: could not score). With
        ``whole_group`` the rows are one group whatever their prompts (the request's ``groups`` said so)."""
        groups = torch.zeros(len(prompts), dtype=torch.long) if whole_group else None
        try:
            scores = score([self.reward], to_float(pixels), prompts, metadata, groups=groups, on_error=self.on_error)
        except RewardError as err:
            return Failure(500, str(err))
        except ValueError as err:  # the batch itself is wrong (check_images)
            return Failure(400, str(err))
        return {key: values.tolist() for key, values in scores.items()}


class Ingress:
    """The HTTP front: ``POST /score`` and ``GET /health`` in the v1 wire format, fanned out to every reward."""

    def __init__(self, scorers: dict[str, Any], max_request_bytes: int) -> None:
        self.scorers = scorers  # deployment name -> DeploymentHandle of its RewardScorer
        self.max_request_bytes = max_request_bytes
        self._described: dict[str, dict[str, Any]] | None = None
        self.replies: Counter[int] = Counter()  # HTTP status -> /score requests answered with it
        self.images = 0  # images in the /score requests answered 200

    def stats(self) -> dict[str, Any]:
        """What this ingress replica answered: {"replies": {status: requests}, "images": images scored}."""
        return {"replies": dict(self.replies), "images": self.images}

    async def __call__(self, request: Request) -> JSONResponse:
        path = request.url.path.rstrip("/") or "/"
        if path == "/health" and request.method == "GET":
            return await self.health()
        if path != "/score" or request.method != "POST":
            return error(404, f"no such endpoint {request.method} {request.url.path}; use GET /health or POST /score")
        reply = await self.score(request)
        self.replies[reply.status_code] += 1
        return reply

    async def score(self, request: Request) -> JSONResponse:
        """POST /score: the body (capped), parsed, scored by every reward, the keys merged."""
        body = await self._read_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            parsed = await asyncio.to_thread(parse_request, body)  # decoding PNGs: off the event loop
        except BadRequest as err:
            return error(400, str(err))
        try:
            described = await self._describe()
        except (RayActorError, BackPressureError) as err:
            return error(503, unavailable(err))
        parts = await asyncio.gather(*(self._score(name, parsed, described[name]["scores_groups"])
                                       for name in self.scorers))
        merged: dict[str, list[float | None]] = {}
        for name, part in zip(self.scorers, parts):
            if isinstance(part, Failure):
                return error(part.status, f"reward '{name}': {part.message}")
            for key, values in part.items():
                if key in merged:
                    return error(500, f"rewards return the same key {key!r}; serve each reward once")
                merged[key] = values
        self.images += len(parsed.prompts)
        return JSONResponse({"scores": merged})

    async def health(self) -> JSONResponse:
        """200 with the rewards' names only while every deployment of the service is healthy, else 503."""
        problems = await asyncio.to_thread(unhealthy_deployments)
        if problems:
            return error(503, "not every reward deployment is healthy: " + "; ".join(problems))
        try:
            described = await self._describe()
        except (RayActorError, BackPressureError) as err:
            return error(503, unavailable(err))
        return JSONResponse({"status": "ok", "rewards": [described[name]["name"] for name in self.scorers],
                             "version": WIRE_VERSION, "max_request_bytes": self.max_request_bytes})

    async def _read_body(self, request: Request) -> bytes | JSONResponse:
        """The body, or a 413 as soon as it is known to pass the cap: from Content-Length before reading, else
        while it streams in."""
        too_big = f"is over this service's max_request_bytes={self.max_request_bytes}; send fewer images per " \
                  "request (the client's batch_size) or raise max_request_bytes in the service config"
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return error(413, f"the request body of {int(length)} bytes {too_big}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                return error(413, f"the request body {too_big}")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _describe(self) -> dict[str, dict[str, Any]]:
        """Each deployment's reward name and kind, asked once."""
        if self._described is None:
            answers = await asyncio.gather(*(handle.describe.remote() for handle in self.scorers.values()))
            self._described = dict(zip(self.scorers, answers))
        return self._described

    async def _score(self, name: str, req: ScoreRequest, grouped: bool) -> dict[str, list[float | None]] | Failure:
        """One reward over the request: one call per image, or one per group -> {key: [N]}."""
        handle, n = self.scorers[name], len(req.prompts)
        if grouped:
            units = [rows.tolist() for rows in group_rows(torch.tensor(req.groups), req.prompts)]
            calls = [handle.score_groups.remote(([req.pixels[i] for i in rows], [req.prompts[i] for i in rows],
                                                 [req.metadata[i] for i in rows])) for rows in units]
        else:
            units = [[i] for i in range(n)]
            calls = [handle.score_rows.remote((req.pixels[i], req.prompts[i], req.metadata[i])) for i in range(n)]
        try:
            answers = await asyncio.gather(*calls)
        except (RayActorError, BackPressureError) as err:  # a replica died or is full: the client retries
            return Failure(503, unavailable(err))
        merged: dict[str, list[float | None]] = {}
        for rows, answer in zip(units, answers):
            if isinstance(answer, Failure):
                return answer
            for key, values in answer.items():
                column = merged.setdefault(key, [None] * n)  # a key one unit lacks is null for its rows
                for row, value in zip(rows, values if grouped else [values]):
                    column[row] = value
        return {key: jsonable_scores(values) for key, values in merged.items()}


def error(status: int, message: str) -> JSONResponse:
    """A one-line JSON error reply."""
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)


def unavailable(err: Exception) -> str:
    """The 503 message of a replica that died (or a deployment too busy) while scoring."""
    return f"a replica is unavailable ({type(err).__name__}); retry the request"


def unhealthy_deployments() -> list[str]:
    """One phrase per deployment of this replica's application that is not HEALTHY (Serve's status)."""
    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    if status is None:
        return [f"application {app!r} is not running"]
    return [f"{name} is {d.status.value}" + (f" ({d.message})" if d.message else "")
            for name, d in status.deployments.items() if d.status.value != HEALTHY]
