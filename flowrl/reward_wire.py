"""The remote reward wire format, version 1 (docs/remote_reward.md): image codec and /score request parsing.

Why a leaf of its own: both ends speak it. The client (``rewards.remote.RemoteReward``) encodes images and
builds requests; the reward service (``flowrl.reward_service``) parses them; tests fake misbehaving servers
with it. One copy keeps the two ends from drifting apart, and it imports nothing of flowrl, so the reward
plugins may use it.

    POST /score {"version": 1, "images": [base64 PNG/JPEG, ...], "image_format": "png" | "jpeg",
                 "prompts": [N str], "metadata": [N objects or null], "groups": [N ints] (optional)}
    200 -> {"scores": {"<name>": [N float | null], "<name>/<sub>": [...], ...}}
    GET /health -> {"status": "ok", "rewards": [...], "version": 1}

``groups`` says which rows form a group for a group-wise reward (rows with equal ids); without it, rows with
the same prompt text do. A server that does not know the field ignores it, so it is backward compatible.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

WIRE_VERSION = 1
IMAGE_FORMATS = ("png", "jpeg")


class BadRequest(ValueError):
    """The client sent something the wire format does not allow (-> HTTP 400)."""


# ------------------------------------------------------------------------------------ images

def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N,3,H,W] float in [0,1] -> [N,H,W,3] uint8, the exact pixels the server will see."""
    x = images.detach().to("cpu", torch.float32).clamp(0, 1)
    return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def to_float(pixels: Sequence[np.ndarray]) -> torch.Tensor:
    """N arrays [H,W,3] uint8 of one size -> [N,3,H,W] float in [0,1] (the inverse of `to_uint8`)."""
    stacked = torch.from_numpy(np.stack(pixels))  # [N,H,W,3] uint8
    return stacked.permute(0, 3, 1, 2).float() / 255.0


def encode_image(arr: np.ndarray, image_format: str = "png", jpeg_quality: int = 95) -> str:
    """[H,W,3] uint8 -> base64 string of a PNG (lossless, fast zlib level) or JPEG file."""
    buf = io.BytesIO()
    if image_format == "png":
        Image.fromarray(arr).save(buf, format="PNG", compress_level=1)  # size matters less than CPU
    else:
        Image.fromarray(arr).save(buf, format="JPEG", quality=jpeg_quality)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_pixels(data: str) -> np.ndarray:
    """Base64 PNG/JPEG (an optional "data:...;base64," prefix is accepted) -> [H,W,3] uint8."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


def decode_image(data: str) -> torch.Tensor:
    """Base64 PNG/JPEG -> [3,H,W] float in [0,1]."""
    return to_float([decode_pixels(data)])[0]


# ------------------------------------------------------------------------------------ requests

@dataclass
class ScoreRequest:
    """A parsed /score body: N rows, one image each."""

    pixels: list[np.ndarray]  # N x [H,W,3] uint8, all one size
    prompts: list[str]  # [N]
    metadata: list[Any]  # [N] JSON objects ({} for null)
    groups: list[int]  # [N] group id per row: the request's "groups", else one id per distinct prompt


def parse_request(body: bytes) -> ScoreRequest:
    """A /score body -> `ScoreRequest`; BadRequest (one line) for anything the wire format does not allow."""
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
    groups = req.get("groups")
    if groups is not None and (not isinstance(groups, list) or len(groups) != len(images) or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in groups)):
        raise BadRequest(f"'groups' must be a list of {len(images)} integers (one group id per image), "
                         f"got {str(groups)[:80]}")
    pixels = []
    for i, data in enumerate(images):
        try:
            pixels.append(decode_pixels(data))
        except Exception as err:
            raise BadRequest(f"image {i} cannot be decoded: {type(err).__name__}: {err}") from None
    if len({x.shape for x in pixels}) > 1:
        raise BadRequest("all images in one request must have the same size")
    prompts = [str(p) for p in prompts]
    if groups is None:
        first: dict[str, int] = {}
        groups = [first.setdefault(p, len(first)) for p in prompts]
    return ScoreRequest(pixels, prompts, [m if m is not None else {} for m in metadata], groups)


def jsonable_scores(values: torch.Tensor | Sequence[float]) -> list[float | None]:
    """Scores -> a JSON list: NaN and inf ("could not score") become null."""
    listed = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return [None if v is None or not math.isfinite(v) else float(v) for v in listed]
