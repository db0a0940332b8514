"""The toy world: coloured shapes on plain backgrounds, rendered procedurally.

Why it exists: the whole RL alignment loop (train a tiny flow model, then raise a
verifiable reward with GRPO) must run on a CPU in minutes, with the reward and
the diversity of the outputs known *exactly*.  A prompt fixes the *bound*
attributes (shape, colour, count, relative position); the renderer samples the
*free* attributes a prompt leaves open (background, exact position, object
size), so preference mode collapse shows up as a measurable loss of entropy
over those free attributes.

Geometry is resolution independent: a `Scene` stores normalised coordinates in
[0, 1] (x to the right, y downwards) and `render` rasterises it at any size
(32 and 64 are tested) with 4x supersampled anti-aliasing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

# Saturated object colours, far apart from each other and from every background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 90, 220),
    "yellow": (230, 200, 30),
    "purple": (150, 50, 200),
    "orange": (240, 130, 20),
    "cyan": (20, 200, 210),
    "pink": (240, 100, 200),
}
# Muted / pastel / dark backgrounds (free attribute), pairwise >= ~60/255 apart.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (240, 240, 240),
    "gray": (128, 128, 128),
    "black": (20, 20, 20),
    "sand": (215, 190, 140),
    "sky": (150, 185, 225),
    "mint": (160, 210, 170),
}
# Each shape fills a known fraction of its (square) bounding box; the detector
# relies on that and on how the mass splits between the top and bottom halves.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# Object side length as a fraction of the image side (free attribute, one bin
# per scene), plus a small per-object jitter that never crosses a bin boundary.
SIZES: dict[str, float] = {"small": 0.26, "medium": 0.31, "large": 0.36}
SIZE_JITTER = 0.01
RELATIONS: tuple[str, ...] = ("left_of", "right_of", "above", "below")
GRID = 3  # position bins: GRID x GRID cells of the object centre
MAX_COUNT = 3

MARGIN = 0.04  # free border around every object (keeps the border = background)
GAP = 0.10  # minimum gap between two objects' boxes (3 px at 32 px: drawn objects must not merge)
CELL_PAD = 0.015  # centres keep off grid lines, so position bins are recoverable from pixels
SUPERSAMPLE = 4
_MAX_TRIES = 2000


@dataclass(frozen=True)
class Obj:
    """One rendered object; cx, cy, size are fractions of the image side."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        """Normalised (x0, y0, x1, y1); multiply by the image size for pixels."""
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


@dataclass(frozen=True)
class Scene:
    """A fully specified image: the prompt's spec plus sampled free attributes."""

    background: str
    size_bin: str
    objects: tuple[Obj, ...]
    spec: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def ground_truth(self) -> dict[str, Any]:
        """JSON-serialisable ground truth (normalised geometry, bins, names)."""
        objs = []
        for o in self.objects:
            d = asdict(o)
            d["bbox"] = list(o.bbox)
            d["cell"] = position_cell(o.cx, o.cy)
            d["size_bin"] = self.size_bin
            objs.append(d)
        return {
            "background": self.background,
            "background_rgb": list(BACKGROUNDS[self.background]),
            "size_bin": self.size_bin,
            "objects": objs,
            "spec": None if self.spec is None else dict(self.spec),
        }


def position_cell(cx: float, cy: float) -> int:
    """Index row * GRID + col of the grid cell holding the point (cx, cy)."""
    col = min(GRID - 1, max(0, int(cx * GRID)))
    row = min(GRID - 1, max(0, int(cy * GRID)))
    return row * GRID + col


def size_bin_index(size: float) -> int:
    """Nearest size bin (index into SIZES) for a normalised object side."""
    centres = np.array(list(SIZES.values()))
    return int(np.argmin(np.abs(centres - size)))


def relation_holds(a: tuple[float, float], b: tuple[float, float], relation: str,
                   cone: float = 0.5, margin: float = 0.0) -> bool:
    """True if point a is `relation` of point b (image coords, y downwards).

    The displacement from a to b must point along the relation's axis: its
    component on that axis must exceed `margin` and `cone` times the
    displacement's length (cone=0.5 is a 60 degree half-angle, 0.71 is 45).
    """
    dx, dy = b[0] - a[0], b[1] - a[1]
    along = {"left_of": dx, "right_of": -dx, "above": dy, "below": -dy}
    if relation not in along:
        raise ValueError(f"unknown relation {relation!r}; expected one of {RELATIONS}")
    length = float(np.hypot(dx, dy))
    return along[relation] > margin and along[relation] >= cone * length


def _as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def expand_spec(spec: Mapping[str, Any]) -> tuple[list[tuple[str, str]], tuple[str, int, int] | None]:
    """Spec -> per-object (shape, color) list and relation over *object* indices.

    Relations name object groups; groups in a relation have count 1, so the
    group index maps to the first object of that group.
    """
    objs: list[tuple[str, str]] = []
    first: list[int] = []
    for g in spec["objects"]:
        if g["shape"] not in SHAPES or g["color"] not in COLORS:
            raise ValueError(f"unknown shape/color in spec: {g}")
        first.append(len(objs))
        objs += [(g["shape"], g["color"])] * int(g.get("count", 1))
    rel = spec.get("relation")
    if rel:
        return objs, (rel["relation"], first[rel["a"]], first[rel["b"]])
    return objs, None


def _separated(a: Obj, b: Obj) -> bool:
    need = (a.size + b.size) / 2 + GAP
    return abs(a.cx - b.cx) >= need or abs(a.cy - b.cy) >= need


def sample_scene(spec: Mapping[str, Any], rng: np.random.Generator | int | None = None,
                 background: str | None = None, size_bin: str | None = None) -> Scene:
    """Fill the free attributes of `spec` (background, positions, size) at random.

    Each object's grid cell is drawn uniformly, then its centre uniformly inside
    the part of that cell where it fits (CELL_PAD off the grid lines), so
    position bins are ~uniform and unambiguous.  Layouts
    with overlapping objects or a relation that is not clearly satisfied
    (45 degree cone) are rejected and redrawn.  `background` / `size_bin` pin
    a free attribute (used by tests and by diversity baselines).
    """
    rng = _as_rng(rng)
    wanted, rel = expand_spec(spec)
    bg = background or list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    sb = size_bin or list(SIZES)[rng.integers(len(SIZES))]
    n = len(wanted)
    for _ in range(_MAX_TRIES):
        sizes = SIZES[sb] + rng.uniform(-SIZE_JITTER, SIZE_JITTER, n)
        cells = rng.integers(GRID * GRID, size=n)
        objs: list[Obj] = []
        for (shape, color), s, cell in zip(wanted, sizes, cells):
            lo, hi = MARGIN + s / 2, 1 - MARGIN - s / 2
            c0, r0 = (cell % GRID) / GRID, (cell // GRID) / GRID
            xl, xh = max(lo, c0 + CELL_PAD), min(hi, c0 + 1 / GRID - CELL_PAD)
            yl, yh = max(lo, r0 + CELL_PAD), min(hi, r0 + 1 / GRID - CELL_PAD)
            if xl >= xh or yl >= yh:
                break
            objs.append(Obj(shape, color, float(rng.uniform(xl, xh)), float(rng.uniform(yl, yh)), float(s)))
        if len(objs) < n:
            continue
        if not all(_separated(objs[i], objs[j]) for i in range(n) for j in range(i + 1, n)):
            continue
        if rel is not None:
            r, ia, ib = rel
            a, b = objs[ia], objs[ib]
            if not relation_holds((a.cx, a.cy), (b.cx, b.cy), r, cone=0.71, margin=0.1):
                continue
        return Scene(bg, sb, tuple(objs), dict(spec))
    raise RuntimeError(f"could not place objects for spec {dict(spec)}")


def _shape_mask(o: Obj, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean coverage of `o` at points (xs [1,W], ys [H,1]) -> [H, W]."""
    h = o.size / 2
    dx, dy = xs - o.cx, ys - o.cy
    if o.shape == "circle":
        return dx * dx + dy * dy <= h * h
    if o.shape == "square":
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    if o.shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= h
    if o.shape == "triangle":  # apex up, base at the bottom, width == height
        return (dy <= h) & (np.abs(dx) <= (dy + h) / 2)
    raise ValueError(f"unknown shape {o.shape!r}")


def render(scene: Scene, size: int = 64) -> np.ndarray:
    """Rasterise `scene` -> uint8 [size, size, 3], anti-aliased by supersampling."""
    hi = size * SUPERSAMPLE
    coords = (np.arange(hi, dtype=np.float32) + 0.5) / hi
    xs, ys = coords[None, :], coords[:, None]
    canvas = np.empty((hi, hi, 3), np.float32)  # [H*ss, W*ss, 3]
    canvas[:] = BACKGROUNDS[scene.background]
    for o in scene.objects:
        canvas[_shape_mask(o, xs, ys)] = COLORS[o.color]
    small = canvas.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE, 3).mean(axis=(1, 3))
    return np.clip(np.rint(small), 0, 255).astype(np.uint8)


def to_tensor(images: Sequence[np.ndarray] | np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] (or list of [H, W, 3]) -> float Tensor [N, 3, H, W] in [0, 1]."""
    arr = np.stack(list(images)) if not isinstance(images, np.ndarray) else images
    return torch.from_numpy(arr.astype(np.float32) / 255.0).permute(0, 3, 1, 2).contiguous()


def render_batch(specs: Sequence[Mapping[str, Any]], rng: np.random.Generator | int | None = None,
                 size: int = 64) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Sample and render one scene per spec -> (images [N, 3, H, W] in [0, 1], ground truths)."""
    rng = _as_rng(rng)
    scenes = [sample_scene(s, rng) for s in specs]
    images = to_tensor([render(sc, size) for sc in scenes])
    return images, [sc.ground_truth() for sc in scenes]
