"""Shape detector for toy-world images (numpy only, batched).

Why here and not in `rewards/`: the ground-truth diversity metric
(`flowrl.toy.diversity`) must measure a trained model's outputs from pixels, and
flowrl core never imports the `rewards` package; the ToyEval reward imports
this module instead.

Pipeline, all vectorised over the batch:
1. background = per-channel median of the 1-pixel border ring;
2. colour unmixing (on a [1,2,1]-smoothed copy, to cut noise): a pixel x belongs to palette colour k if it lies on the
   segment from the background B towards P_k at least half way
   (x ~ B + a (P_k - B), a >= 0.5) with a small residual.  Anti-aliased or
   blurred edges are mixtures of object and background, so they fall on that
   segment and never masquerade as a third palette colour;
3. 8-connected components per colour (label propagation + pointer jumping);
4. components below a minimum area are noise.  The rest are classified from
   soft (alpha-weighted, incl. a 2-pixel fringe) moments that blur cannot
   change: the 4-fold harmonic  H4 = sum w (x^4 - 6x^2y^2 + y^4) / W^3
   (square -1, circle 0, diamond +1 after scaling) and the vertical skew
   S3 = sum w y^3 / W^2.5 (triangle -1, the symmetric shapes 0).  Moments of
   every pixel are far steadier than bounding-box fill ratios at 5-10 px.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flowrl.toy.world import BACKGROUNDS, COLORS

PALETTE = np.array(list(COLORS.values()), np.float32) / 255.0  # [K, 3]
COLOR_NAMES = tuple(COLORS)
BG_PALETTE = np.array(list(BACKGROUNDS.values()), np.float32) / 255.0  # [B, 3]
BG_NAMES = tuple(BACKGROUNDS)

# Shape prototypes in (H4, S3) feature space; the fraction of its bbox each shape
# fills; the offset of its area centroid below its bbox centre (in sides).
PROTOTYPES: dict[str, tuple[float, float]] = {
    "circle": (0.0, 0.0),
    "square": (-1.0, 0.0),
    "triangle": (0.11, -1.0),
    "diamond": (1.0, 0.0),
}
FILL = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5, "diamond": 0.5}
CENTROID_DROP = {"circle": 0.0, "square": 0.0, "triangle": 1 / 6, "diamond": 0.0}
_PROTO = np.array(list(PROTOTYPES.values()), np.float64)  # [S, 2]
_PROTO_NAMES = tuple(PROTOTYPES)
_H4_SCALE, _S3_SCALE = 60.0, 48.0  # ideal square / triangle -> unit features

IMAGE_TOLERANCE = 1e-4  # slack on [0, 1] for decoder rounding (same as flowrl.rewards_api)
MIN_ALPHA = 0.5  # a pixel is foreground once it is at least half object colour
MAX_RESIDUAL = 0.22  # off-segment distance allowed (RGB in [0, 1]); soft for blurry models
MIN_AREA_FRAC = 0.006  # smaller components are noise (6 px at 32x32, 25 px at 64x64)
FLOOR = 0.1  # fringe pixels below this alpha are treated as noise
FRINGE = 2  # pixels of anti-aliased / blurred edge added to each component's moments
MAX_ELONGATION = 1.8  # sqrt of the covariance eigenvalue ratio; triangle is 1.15
MAX_SHAPE_DIST = 0.6  # farther from every prototype -> "unknown"


@dataclass(frozen=True)
class Detection:
    """One detected object; geometry normalised by the image side (y downwards)."""

    color: str
    shape: str  # one of PROTOTYPES or "unknown"
    cx: float  # bbox centre (same convention as world.Obj), from the soft centroid
    cy: float
    size: float  # side, from the soft area and the shape's fill ratio
    area: int  # pixels with alpha >= 0.5
    bbox: tuple[float, float, float, float]  # (x0, y0, x1, y1) of those pixels
    h4: float  # shape features, see the module docstring
    s3: float
    elongation: float


def check_images(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Validate a reward batch -> (float32 [N, H, W, 3] in [0, 1], finite [N] bool).

    One-line ValueError for a non-float tensor, a shape other than [N, 3, H, W]
    or finite values outside [0, 1] (+- IMAGE_TOLERANCE, as flowrl.rewards_api).
    Images holding NaN/inf pass, flagged not finite (rewards score them NaN).
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        kind = f"{images.dtype} tensor" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a float tensor [N,3,H,W] in [0,1], got {kind}")
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[2] < 8 or images.shape[3] < 8:
        raise ValueError(f"images must have shape [N,3,H,W] with H,W >= 8, got {tuple(images.shape)}")
    x = images.detach().to("cpu", torch.float32)
    finite = torch.isfinite(x).flatten(1).all(dim=1)  # [N]
    vals = x[torch.isfinite(x)]
    if vals.numel() and (vals.min() < -IMAGE_TOLERANCE or vals.max() > 1 + IMAGE_TOLERANCE):
        raise ValueError(f"image values must lie in [0,1], got [{vals.min():.4g}, {vals.max():.4g}]")
    arr = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0).clamp(0, 1).permute(0, 2, 3, 1)
    return np.ascontiguousarray(arr.numpy()), finite.numpy()


def _as_hwc(image) -> np.ndarray:
    """One image (Tensor [3,H,W] in [0,1] or ndarray [H,W,3] uint8/float) -> float32 [H,W,3]."""
    if isinstance(image, torch.Tensor):
        return check_images(image[None] if image.ndim == 3 else image)[0][0]
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image must be [H,W,3], got {arr.shape}")
    return arr.astype(np.float32) / 255.0 if arr.dtype == np.uint8 else arr.astype(np.float32)


def smooth(x: np.ndarray) -> np.ndarray:
    """Separable [1,2,1]/4 blur of [N,H,W,3] (edges replicated).

    Cuts pixel noise ~2.7x before unmixing; the shape moments are invariant to
    blur, so it costs no shape information.
    """
    p = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    p = 0.25 * p[:, :-2] + 0.5 * p[:, 1:-1] + 0.25 * p[:, 2:]
    return 0.25 * p[:, :, :-2] + 0.5 * p[:, :, 1:-1] + 0.25 * p[:, :, 2:]


def estimate_background(x: np.ndarray) -> np.ndarray:
    """Median colour of the border ring: [N, H, W, 3] -> [N, 3]."""
    ring = np.concatenate([x[:, 0], x[:, -1], x[:, 1:-1, 0], x[:, 1:-1, -1]], axis=1)  # [N, P, 3]
    return np.median(ring, axis=1)


def background_index(bg: np.ndarray) -> np.ndarray:
    """Quantise background colours [N, 3] to the nearest BACKGROUNDS entry -> [N]."""
    return np.argmin(((bg[:, None, :] - BG_PALETTE[None]) ** 2).sum(-1), axis=1)


def unmix(x: np.ndarray, bg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fit every pixel as B + a (P_k - B) for every palette colour k.

    [N,H,W,3], [N,3] -> (alpha [N,H,W,K] mixing weight, resid [N,H,W,K]
    distance to the segment, inf where P_k is too close to B to be seen).
    """
    d = x - bg[:, None, None, :]  # [N, H, W, 3]
    v = PALETTE[None] - bg[:, None, :]  # [N, K, 3]
    vv = (v * v).sum(-1)[:, None, None, :]  # [N, 1, 1, K]
    dv = np.einsum("nhwc,nkc->nhwk", d, v)  # [N, H, W, K]
    alpha = dv / np.maximum(vv, 1e-6)
    a = np.clip(alpha, 0.0, 1.5)
    dd = (d * d).sum(-1, keepdims=True)  # [N, H, W, 1]
    resid = np.sqrt(np.maximum(dd - 2 * a * dv + a * a * vv, 0.0))
    return alpha, np.where(vv > 0.15**2, resid, np.inf)


def classify_pixels(x: np.ndarray, bg: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Palette class per pixel: [N,H,W,3], [N,3] -> (cls, soft, alpha).

    soft  int8 [N,H,W]: colour whose segment fits best among those with
          alpha >= FLOOR, -1 if none fits within MAX_RESIDUAL (owns faint edges);
    cls   int8 [N,H,W]: soft where that colour's alpha >= MIN_ALPHA, else -1.
          Choosing the colour before thresholding alpha matters: a faint blue
          edge is closer to half-way towards purple than towards blue.
    alpha float [N,H,W,K] from `unmix`.
    """
    alpha, resid = unmix(x, bg)
    r = np.where(alpha >= FLOOR, resid, np.inf)
    k = np.argmin(r, axis=-1)[..., None]  # [N, H, W, 1]
    fits = np.take_along_axis(r, k, -1)[..., 0] <= MAX_RESIDUAL
    soft = np.where(fits, k[..., 0], -1).astype(np.int8)
    strong = np.take_along_axis(alpha, k, -1)[..., 0] >= MIN_ALPHA
    return np.where(fits & strong, soft, -1).astype(np.int8), soft, alpha


_SHIFTS = [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)]


def _sl(o: int) -> slice:
    return slice(o, None) if o >= 0 else slice(None, o)


def label_components(cls: np.ndarray) -> np.ndarray:
    """8-connected components of equal non-negative class: int [N,H,W] -> int64 [N,H,W].

    Each foreground pixel gets the flat index of the smallest pixel index in
    its component; background gets -1.  Neighbours never cross images.
    """
    n, h, w = cls.shape
    fg = cls >= 0
    big = np.int64(n * h * w)
    lab = np.where(fg, np.arange(n * h * w, dtype=np.int64).reshape(n, h, w), big)
    links = []  # (dst slices, src slices, same-component mask on dst)
    for dy, dx in _SHIFTS:
        dst = (slice(None), _sl(dy), _sl(dx))
        src = (slice(None), _sl(-dy), _sl(-dx))
        same = fg[dst] & (cls[dst] == cls[src])
        if same.any():
            links.append((dst, src, same))
    flat = lab.reshape(-1)
    while True:
        prev = lab.copy()
        for dst, src, same in links:
            lab[dst] = np.where(same, np.minimum(lab[dst], lab[src]), lab[dst])
        idx = np.flatnonzero(fg)
        for _ in range(4):  # pointer jumping: a label is a pixel of the same component
            flat[idx] = flat[flat[idx]]
        if np.array_equal(lab, prev):
            break
    return np.where(fg, lab, -1)


def _grow(lab: np.ndarray, cls: np.ndarray, soft: np.ndarray, steps: int) -> np.ndarray:
    """Hand each background pixel within `steps` (8-neighbourhood) of a component
    to that component if the pixel's faint colour (`soft`) is the component's."""
    flat_cls = cls.reshape(-1)
    own = lab.copy()
    for _ in range(steps):
        grown = own.copy()
        for dy, dx in _SHIFTS:
            dst = (slice(None), _sl(dy), _sl(dx))
            src = own[(slice(None), _sl(-dy), _sl(-dx))]
            take = (grown[dst] < 0) & (src >= 0)
            take &= soft[dst] == flat_cls[np.maximum(src, 0)]
            grown[dst] = np.where(take, src, grown[dst])
        own = grown
    return own


def _shape_of(h4: float, s3: float, elongation: float) -> str:
    dist = np.hypot(_PROTO[:, 0] - h4, _PROTO[:, 1] - s3)  # [S]
    best = int(dist.argmin())
    if elongation > MAX_ELONGATION or dist[best] > MAX_SHAPE_DIST:
        return "unknown"
    return _PROTO_NAMES[best]


def detect_arrays(x: np.ndarray) -> tuple[list[list[Detection]], np.ndarray]:
    """Detect objects in float [N,H,W,3] images in [0,1] -> (per-image detections, backgrounds [N,3])."""
    n, h, w, _ = x.shape
    bg = estimate_background(x)
    cls, soft, _ = classify_pixels(smooth(x), bg)  # decide on the denoised image
    lab = label_components(cls)  # [N, H, W]
    out: list[list[Detection]] = [[] for _ in range(n)]
    hard = lab.reshape(-1)
    roots, area = np.unique(hard[hard >= 0], return_counts=True)
    if roots.size == 0:
        return out, bg
    own = _grow(lab, cls, soft, FRINGE).reshape(-1)
    pix = np.flatnonzero(own >= 0)  # component pixels + their fringe
    comp = np.searchsorted(roots, own[pix])  # [P]
    k = cls.reshape(-1)[roots][comp].astype(np.int64)  # colour of each pixel's component
    # soft coverage from the raw (unsmoothed) pixels; fringe pixels were admitted by _grow
    img = pix // (h * w)
    v = PALETTE[k] - bg[img]  # [P, 3]
    a_k = ((x.reshape(-1, 3)[pix] - bg[img]) * v).sum(-1) / np.maximum((v * v).sum(-1), 1e-6)
    wt = np.clip(a_k, 0.0, 1.0)
    ys, xs = (pix // w) % h + 0.5, pix % w + 0.5
    nc = roots.size
    W = np.bincount(comp, wt, nc) + 1e-9
    mx, my = np.bincount(comp, wt * xs, nc) / W, np.bincount(comp, wt * ys, nc) / W
    X, Y = xs - mx[comp], ys - my[comp]
    cxx, cyy, cxy = (np.bincount(comp, wt * q, nc) for q in (X * X, Y * Y, X * Y))
    h4 = _H4_SCALE * np.bincount(comp, wt * (X**4 - 6 * X * X * Y * Y + Y**4), nc) / W**3
    s3 = _S3_SCALE * np.bincount(comp, wt * Y**3, nc) / W**2.5
    tr, det = cxx + cyy, cxx * cyy - cxy * cxy
    disc = np.sqrt(np.maximum(tr * tr / 4 - det, 0.0))
    elong = np.sqrt((tr / 2 + disc) / np.maximum(tr / 2 - disc, 1e-9))
    # hard-mask bounding boxes
    hp = np.flatnonzero(hard >= 0)
    hc = np.searchsorted(roots, hard[hp])
    order = np.argsort(hc, kind="stable")
    starts = np.concatenate([[0], np.cumsum(area)[:-1]])
    hy, hx = ((hp // w) % h)[order], (hp % w)[order]
    x0, x1 = np.minimum.reduceat(hx, starts), np.maximum.reduceat(hx, starts) + 1
    y0, y1 = np.minimum.reduceat(hy, starts), np.maximum.reduceat(hy, starts) + 1
    side_norm = float(np.sqrt(h * w))
    for c in np.flatnonzero(area >= max(4, MIN_AREA_FRAC * h * w)):
        shape = _shape_of(h4[c], s3[c], elong[c])
        side = np.sqrt(W[c] / FILL.get(shape, 1.0))
        out[int(roots[c] // (h * w))].append(Detection(
            color=COLOR_NAMES[int(cls.reshape(-1)[roots[c]])], shape=shape,
            cx=float(mx[c] / w), cy=float((my[c] - CENTROID_DROP.get(shape, 0.0) * side) / h),
            size=float(side / side_norm), area=int(area[c]),
            bbox=(float(x0[c] / w), float(y0[c] / h), float(x1[c] / w), float(y1[c] / h)),
            h4=float(h4[c]), s3=float(s3[c]), elongation=float(elong[c])))
    return out, bg


def detect_batch(images: torch.Tensor) -> list[list[Detection]]:
    """Detect objects in a Tensor [N,3,H,W] in [0,1] (validated; NaN images -> [])."""
    x, finite = check_images(images)
    dets, _ = detect_arrays(x)
    return [d if ok else [] for d, ok in zip(dets, finite)]


def detect(image) -> list[Detection]:
    """Detect objects in one image: Tensor [3,H,W] in [0,1] or ndarray [H,W,3] (uint8 or float)."""
    return detect_arrays(_as_hwc(image)[None])[0][0]
