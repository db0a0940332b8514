"""ToyEval: a GenEval-like verifiable reward for the toy world, computed on CPU.

Why: RL needs a reward whose correctness is not in doubt.  ToyEval detects
the coloured shapes in each image (`flowrl.toy.detect`) and checks them
against the prompt's spec (`flowrl.toy.prompts` metadata).

Strict correctness ("toyeval", 0 or 1).  An image scores 1 iff
  * for every required (colour, shape) the number of detected objects with
    exactly that colour and shape equals the requested count, and
  * nothing else is detected (no object of another colour/shape binding and
    no unrecognisable blob above the noise area), and
  * for a relation "A <rel> B": the centre of the largest detected A lies
    in the direction <rel> of the centre of the largest detected B: the
    displacement has a component along the axis > POSITION_MARGIN (fraction
    of the image side) and within a 60 degree cone of the axis (image y
    points down, so "above" means a smaller y).
This is GenEval's counting/position semantics with "exactly these objects".

Partial sub-scores (dense signal for RL, each in [0, 1]):
  toyeval/color     fraction of required groups whose colour is detected (any shape)
  toyeval/shape     fraction of required groups whose shape is detected (any colour)
  toyeval/object    fraction of required (colour, shape) groups detected at least once
  toyeval/count     fraction of required groups detected with exactly the requested count
  toyeval/clean     1 if no detection outside the required bindings, else 0
  toyeval/position  relation check above; NaN for prompts without a relation
  toyeval/partial   mean of the sub-scores above (ignoring NaN)
NaN means "could not score": images holding NaN/inf, or metadata without a
spec whose prompt is not in the toy grammar either.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from flowrl.toy.detect import Detection, check_images, detect_arrays
from flowrl.toy.prompts import all_prompts
from flowrl.toy.world import relation_holds

POSITION_MARGIN = 0.05
POSITION_CONE = 0.5  # cos(60 deg)
SUBSCORES = ("color", "shape", "object", "count", "clean", "position")

_GRAMMAR: dict[str, dict[str, Any]] | None = None


def _spec_for(prompt: str, meta: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The spec in metadata, else the spec of a known grammar prompt, else None."""
    if meta and "objects" in meta:
        return meta
    global _GRAMMAR
    if _GRAMMAR is None:
        _GRAMMAR = dict(all_prompts())
    return _GRAMMAR.get(prompt.strip().lower())


def score_detections(dets: Sequence[Detection], spec: Mapping[str, Any]) -> dict[str, float]:
    """Strict score and sub-scores of one image's detections against one spec."""
    groups = spec["objects"]
    req: Counter = Counter()
    for g in groups:
        req[(g["color"], g["shape"])] += int(g.get("count", 1))
    seen = Counter((d.color, d.shape) for d in dets)
    colors, shapes = {d.color for d in dets}, {d.shape for d in dets}
    s = {
        "color": sum(c in colors for c, _ in req) / len(req),
        "shape": sum(sh in shapes for _, sh in req) / len(req),
        "object": sum(seen[k] >= 1 for k in req) / len(req),
        "count": sum(seen[k] == n for k, n in req.items()) / len(req),
        "clean": float(all(k in req for k in seen)),
        "position": math.nan,
    }
    rel = spec.get("relation")
    if rel:
        def largest(g: Mapping[str, Any]) -> Detection | None:
            hits = [d for d in dets if (d.color, d.shape) == (g["color"], g["shape"])]
            return max(hits, key=lambda d: d.area) if hits else None

        a, b = largest(groups[rel["a"]]), largest(groups[rel["b"]])
        s["position"] = float(a is not None and b is not None and relation_holds(
            (a.cx, a.cy), (b.cx, b.cy), rel["relation"], cone=POSITION_CONE, margin=POSITION_MARGIN))
    strict = s["count"] == 1.0 and s["clean"] == 1.0 and (not rel or s["position"] == 1.0)
    vals = [v for v in s.values() if not math.isnan(v)]
    return {"strict": float(strict), **s, "partial": sum(vals) / len(vals)}


class ToyEval:
    """Reward protocol: ToyEval()(images [N,3,H,W] in [0,1], prompts, metadata) -> {key: Tensor[N]}."""

    name = "toyeval"

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x, finite = check_images(images)  # [N, H, W, 3], [N]
        n = x.shape[0]
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(f"got {n} images, {len(prompts)} prompts, {len(metadata)} metadata")
        dets, _ = detect_arrays(x)
        keys = ["strict", *SUBSCORES, "partial"]
        rows = []
        for i in range(n):
            spec = _spec_for(prompts[i], metadata[i])
            if spec is None or not finite[i]:
                rows.append({k: math.nan for k in keys})
            else:
                rows.append(score_detections(dets[i], spec))
        out = {}
        for k in keys:
            name = self.name if k == "strict" else f"{self.name}/{k}"
            out[name] = torch.tensor([r[k] for r in rows], dtype=torch.float32)  # [N]
        return out
