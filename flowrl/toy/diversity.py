"""Ground-truth diversity over the toy world's *free* attributes.

Why: preference optimisation tends to collapse whatever a prompt leaves open.
In the toy world those free attributes are known and discrete, so diversity
is measured exactly: for each group of images generated from one prompt,
the normalised entropy (entropy / log(#possible values), in [0, 1]) and the
coverage (fraction of possible values seen) of

* background - border-pixel colour quantised to `world.BACKGROUNDS`;
* position   - grid cell (GRID x GRID) of each detected object's centre,
               pooled over the objects of the group;
* size       - nearest `world.SIZES` bin of each detected object, pooled.

Everything is computable from pixels through `flowrl.toy.detect`, so it
measures a trained model's samples as well as the renderer's ground truth.
Note the small-sample bias: a group of n images cannot exceed
log(n) / log(#values) for the per-image background entropy.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import torch

from flowrl.toy.detect import background_index, check_images, detect_arrays
from flowrl.toy.world import BACKGROUNDS, GRID, SIZES, Scene, position_cell, size_bin_index

ATTRIBUTES: tuple[str, ...] = ("background", "position", "size")
N_VALUES: dict[str, int] = {"background": len(BACKGROUNDS), "position": GRID * GRID, "size": len(SIZES)}


@dataclass(frozen=True)
class FreeAttrs:
    """Discrete free attributes of one image (indices into the world's lists)."""

    background: int
    positions: tuple[int, ...]  # one grid cell per object
    sizes: tuple[int, ...]  # one size bin per object


def free_attributes(images: torch.Tensor) -> list[FreeAttrs]:
    """Measure free attributes from pixels: Tensor [N,3,H,W] in [0,1] -> N FreeAttrs."""
    x, _ = check_images(images)
    dets, bg = detect_arrays(x)
    bgi = background_index(bg)  # [N]
    return [FreeAttrs(int(b), tuple(position_cell(d.cx, d.cy) for d in ds),
                      tuple(size_bin_index(d.size) for d in ds)) for b, ds in zip(bgi, dets)]


def scene_free_attributes(scene: Scene | Mapping[str, Any]) -> FreeAttrs:
    """Ground-truth free attributes of a Scene or of `Scene.ground_truth()`."""
    gt = scene.ground_truth() if isinstance(scene, Scene) else scene
    objs = gt["objects"]
    return FreeAttrs(list(BACKGROUNDS).index(gt["background"]),
                     tuple(position_cell(o["cx"], o["cy"]) for o in objs),
                     tuple(size_bin_index(o["size"]) for o in objs))


def normalized_entropy(values: Sequence[Hashable], n_values: int) -> float:
    """Entropy of the empirical distribution / log(n_values); NaN if no values."""
    if len(values) == 0:
        return float("nan")
    if n_values <= 1:
        return 0.0
    p = np.array(list(Counter(values).values()), np.float64) / len(values)
    return float(-(p * np.log(p)).sum() / math.log(n_values))


def coverage(values: Sequence[Hashable], n_values: int) -> float:
    """Fraction of the n_values possible values that occur; NaN if no values."""
    return float(len(set(values)) / n_values) if len(values) else float("nan")


def _pooled(attrs: Sequence[FreeAttrs]) -> dict[str, list[int]]:
    return {"background": [a.background for a in attrs],
            "position": [p for a in attrs for p in a.positions],
            "size": [s for a in attrs for s in a.sizes]}


def group_diversity(attrs: Sequence[FreeAttrs]) -> dict[str, float]:
    """Diversity of one group (e.g. all samples of one prompt)."""
    vals = _pooled(attrs)
    out: dict[str, float] = {}
    for k in ATTRIBUTES:
        out[f"diversity/{k}"] = normalized_entropy(vals[k], N_VALUES[k])
        out[f"diversity/coverage_{k}"] = coverage(vals[k], N_VALUES[k])
    out["diversity/gt_mean"] = _nanmean([out[f"diversity/{k}"] for k in ATTRIBUTES])
    out["diversity/coverage_mean"] = _nanmean([out[f"diversity/coverage_{k}"] for k in ATTRIBUTES])
    return out


def _nanmean(xs: Sequence[float]) -> float:
    arr = np.asarray(xs, np.float64)
    return float(np.nanmean(arr)) if np.isfinite(arr).any() else float("nan")


def diversity_by_group(attrs: Sequence[FreeAttrs],
                       group_ids: Sequence[Hashable] | None = None) -> dict[Hashable, dict[str, float]]:
    """{group id: group_diversity}; all images form one group when group_ids is None.

    A tensor of ids becomes Python ints: 0-d tensors hash by identity, so each image would
    otherwise form its own group (and a group of one has no diversity).
    """
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    ids = list(group_ids) if group_ids is not None else [0] * len(attrs)
    if len(ids) != len(attrs):
        raise ValueError(f"got {len(ids)} group ids for {len(attrs)} images")
    groups: dict[Hashable, list[FreeAttrs]] = {}
    for g, a in zip(ids, attrs):
        groups.setdefault(g, []).append(a)
    return {g: group_diversity(v) for g, v in groups.items()}


def attribute_diversity(attrs: Sequence[FreeAttrs],
                        group_ids: Sequence[Hashable] | None = None) -> dict[str, float]:
    """Per-group diversity averaged over groups (NaN groups are skipped per key)."""
    per = list(diversity_by_group(attrs, group_ids).values())
    return {k: _nanmean([d[k] for d in per]) for k in per[0]} if per else {}


def diversity(images: torch.Tensor, group_ids: Sequence[Hashable] | None = None) -> dict[str, float]:
    """Diversity measured from pixels: Tensor [N,3,H,W] in [0,1], one group id per image."""
    return attribute_diversity(free_attributes(images), group_ids)
