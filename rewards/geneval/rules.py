"""GenEval's decision rules on one image's detections: which objects count, and whether the image is right.

Why apart from the models: the rules are what makes a score "GenEval", and they can be checked by hand on
made-up detections (boxes, scores, class names, colours) without a detector or a CLIP.

Reimplemented from GenEval's evaluation code, github.com/djghosh13/geneval at commit
af4902f24d3ca90ebbb446dd9891a59e0f82725f: evaluation/evaluate_images.py (``evaluate_image``, ``evaluate``,
``relative_position``, ``compute_iou`` and the option defaults at the bottom), evaluation/object_names.txt
(the 80 class names) and evaluation/summary_scores.py (the aggregation, done in flowrl by
:func:`flowrl.data.tasks.by_task`). The rules, as that code applies them:

* **Which detections count.** Per class, detections scoring strictly above 0.3 (0.9 for every class when the
  prompt's ``tag`` is ``counting``), most confident first, at most 16 per class. Overlap suppression exists as
  an option (``max_overlap``, IoU with the +1 pixel convention) and is off by default (1.0), as in GenEval.
* **Include clauses, AND-ed, in order.** A clause ``{class, count}`` takes the ``count`` most confident
  objects of its class; fewer than ``count`` fails it. With a ``color``, those objects' colours are
  classified and fewer than ``count`` of them in that colour fails it. With ``position: [relation, j]`` (and
  everything above passed), every one of those objects must stand in ``relation`` to every object that
  clause ``j`` took; a failed clause ``j`` fails it too.
* **Position.** With box centres c and sizes (w, h), offset = c_A - c_B; each axis of the offset shrinks
  toward zero by 0.1 x (size_A + size_B) on that axis; if both shrunk axes are below 1e-3 there is no
  relation, else the shrunk offset divided by the length of the unshrunk offset gives (dx, dy), and
  dx < -0.5 is "left of", dx > 0.5 "right of", dy < -0.5 "above", dy > 0.5 "below" (image y points down).
* **Exclude clauses, OR-ed.** ``{class, count}`` fails the image when at least ``count`` objects of that
  class were kept (so "exactly n" is include n plus exclude n + 1).
* **Strict correctness** is 1 when every clause passes (GenEval's ``correct``); the per-task mean over images
  and the overall score as the mean of the task means are summary_scores.py's "Overall score".

Partial sub-scores (flowrl's, for a denser RL signal; the fraction of the clauses of each kind that pass,
NaN when the prompt has none of that kind):
  geneval/count     include clauses with at least ``count`` objects of their class
  geneval/color     include clauses with a colour whose objects all have it
  geneval/position  include clauses with a position that pass (colour included)
  geneval/exclude   exclude clauses that hold
  geneval/partial   all include and exclude clauses that pass; strict is 1 exactly when this is 1
  geneval/flow_grpo the dense score Flow-GRPO trains on (its reward server's partial credit, read
                    :func:`flow_grpo_score`); it can be negative
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torchvision.ops import box_iou

# GenEval's 80 class names (COCO's, with mouse, remote and keyboard renamed) in COCO order, and its ten colours,
# are the prompt generator's: flowrl.data.geneval.CLASSES and COLORS.
from flowrl.data.geneval import CLASSES, COLORS

COLOR_TEMPLATES = ("a photo of a {color} {cls}", "a photo of a {color}-colored {cls}", "a photo of a {color} object")
RELATIONS = ("left of", "right of", "above", "below")
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
MAX_OVERLAP = 1.0  # 1.0: no overlap suppression
POSITION_THRESHOLD = 0.1
SUBSCORES = ("count", "color", "position", "exclude", "partial", "flow_grpo")


@dataclass
class Detections:
    """One image's detections: ``boxes [K, 4]`` (x1, y1, x2, y2 in pixels, x2/y2 one past the last pixel, as
    mmdetection's mask-to-box gives), ``scores [K]``, ``labels`` (K GenEval class names), ``masks [K, H, W]``
    bool (None when the colour step needs no pixels, e.g. hand-made detections) and ``colors`` (K colour
    names or None: filled by the colour classifier for the objects a colour clause looks at)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: list[str]
    masks: torch.Tensor | None = None
    colors: list[str | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.colors:
            self.colors = [None] * len(self.labels)
        if not (len(self.boxes) == len(self.scores) == len(self.labels) == len(self.colors)):
            raise ValueError(f"detections disagree in length: {len(self.boxes)} boxes, {len(self.scores)} scores, "
                             f"{len(self.labels)} labels, {len(self.colors)} colours")


def check_metadata(prompt: str, meta: Any) -> Mapping[str, Any]:
    """GenEval metadata (``tag``, ``include``, optional ``exclude``) or a one-line ValueError naming the prompt."""
    where = f"geneval: prompt {prompt!r}"
    if not isinstance(meta, Mapping) or "include" not in meta:
        raise ValueError(f"{where} has no GenEval metadata ({{'tag', 'include': [...], 'exclude'?: [...]}}); "
                         "score a GenEval prompt file (e.g. assets/prompts/geneval_train.jsonl)")
    if not isinstance(meta.get("tag"), str):
        raise ValueError(f"{where}: metadata needs a string 'tag' (single_object, counting, ...)")
    include, exclude = meta["include"], meta.get("exclude", [])
    if not isinstance(include, list) or not include or not isinstance(exclude, list):
        raise ValueError(f"{where}: 'include' must be a non-empty list and 'exclude' a list")
    for kind, clauses in (("include", include), ("exclude", exclude)):
        for i, clause in enumerate(clauses):
            bad = _clause_problem(clause, i, kind)
            if bad:
                raise ValueError(f"{where}: {kind}[{i}] {bad}")
    return meta


def _clause_problem(clause: Any, index: int, kind: str) -> str | None:
    if not isinstance(clause, Mapping):
        return "must be an object {class, count, ...}"
    if clause.get("class") not in CLASSES:
        return f"names class {clause.get('class')!r}, not one of GenEval's 80 COCO classes"
    count = clause.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return f"needs an integer count >= 1, got {count!r}"
    if "color" in clause and clause["color"] not in COLORS:
        return f"names colour {clause['color']!r}; GenEval's are {', '.join(COLORS)}"
    if "position" in clause:
        pos = clause["position"]
        if kind != "include" or not (isinstance(pos, list) and len(pos) == 2 and pos[0] in RELATIONS
                                     and isinstance(pos[1], int) and 0 <= pos[1] < index):
            return (f"has position {pos!r}; expected [relation, j] on an include clause, relation one of "
                    f"{list(RELATIONS)} and j an earlier include clause")
    return None


def select_objects(det: Detections, tag: str, *, threshold: float = THRESHOLD,
                   counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                   max_overlap: float = MAX_OVERLAP) -> dict[str, list[int]]:
    """{class: indices into ``det`` of the kept objects, most confident first} (classes with none left out)."""
    cut = counting_threshold if tag == "counting" else threshold
    kept: dict[str, list[int]] = {}
    for name in dict.fromkeys(det.labels):
        rows = [i for i, label in enumerate(det.labels) if label == name and float(det.scores[i]) > cut]
        rows = sorted(rows, key=lambda i: -float(det.scores[i]))[:max_objects]  # stable: ties keep their order
        if max_overlap < 1 and rows:
            closed = det.boxes[rows].double() + torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
            iou = box_iou(closed, closed)  # [R, R]: the +1 pixel convention of GenEval's compute_iou
            chosen: list[int] = []
            for r in range(len(rows)):
                if all(iou[r, c] < max_overlap for c in chosen):
                    chosen.append(r)
            rows = [rows[r] for r in chosen]
        if rows:
            kept[name] = rows
    return kept


def relative_position(box_a: torch.Tensor, box_b: torch.Tensor, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """The relations in which box A stands to box B (each ``[4]``: x1, y1, x2, y2)."""
    a, b = box_a.double().view(2, 2), box_b.double().view(2, 2)  # [[x1, y1], [x2, y2]]
    offset = a.mean(0) - b.mean(0)  # [2]: centre of A minus centre of B
    size = (a[1] - a[0]).abs() + (b[1] - b[0]).abs()  # [2]: summed widths, summed heights
    shrunk = (offset.abs() - threshold * size).clamp_min(0) * offset.sign()
    if bool((shrunk.abs() < 1e-3).all()):
        return set()
    dx, dy = (shrunk / offset.norm()).tolist()
    found = {"left of": dx < -0.5, "right of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}
    return {name for name, holds in found.items() if holds}


def color_queries(meta: Mapping[str, Any], objects: Mapping[str, list[int]]) -> list[int]:
    """Indices of the detections whose colour GenEval classifies: a colour clause's objects, when it has enough."""
    wanted: list[int] = []
    for clause in meta["include"]:
        found = objects.get(clause["class"], [])[:clause["count"]]
        if "color" in clause and len(found) >= clause["count"]:
            wanted += [i for i in found if i not in wanted]
    return wanted


def judge(meta: Mapping[str, Any], det: Detections, objects: Mapping[str, list[int]] | None = None,
          *, position_threshold: float = POSITION_THRESHOLD, **select: Any) -> dict[str, float]:
    """Strict score (key ``strict``) and the sub-scores of one image; colours come from ``det.colors``."""
    objects = select_objects(det, meta["tag"], **select) if objects is None else objects
    passed: list[bool] = []
    counts, colors, positions = [], [], []
    matched: list[list[int] | None] = []
    for clause in meta["include"]:
        found = objects.get(clause["class"], [])[:clause["count"]]
        ok = len(found) >= clause["count"]
        counts.append(ok)
        if "color" in clause:
            if ok:
                missing = [i for i in found if det.colors[i] is None]
                if missing:
                    raise ValueError(f"geneval: detection {missing[0]} ({clause['class']}) has no colour")
                ok = sum(det.colors[i] == clause["color"] for i in found) >= clause["count"]
            colors.append(ok)
        if "position" in clause:
            relation, target = clause["position"]
            if ok:
                others = matched[target]
                ok = others is not None and all(
                    relation in relative_position(det.boxes[i], det.boxes[j], position_threshold)
                    for i in found for j in others)
            positions.append(ok)
        passed.append(ok)
        matched.append(found if ok else None)
    excluded = [len(objects.get(clause["class"], [])) < clause["count"] for clause in meta.get("exclude", [])]
    every = passed + excluded
    return {"strict": float(all(every)), "count": _share(counts), "color": _share(colors),
            "position": _share(positions), "exclude": _share(excluded), "partial": _share(every),
            "flow_grpo": flow_grpo_score(meta, det, objects, position_threshold)}


def flow_grpo_score(meta: Mapping[str, Any], det: Detections, objects: Mapping[str, list[int]],
                    position_threshold: float = POSITION_THRESHOLD) -> float:
    """The dense score Flow-GRPO trains on (its reward server's ``evaluate_reward``), as that code computes it.

    Reimplemented from github.com/yifan123/reward-server at 92ac29fb322c028f8840db8f93c950422931710d,
    reward_server/gen_eval.py. It averages terms over the include clauses (exclude clauses play no part):
    every clause adds 1 - |count - n| / count for its n kept objects (negative past 2 x count); when n is not
    the count, a clause with a colour or a position adds one 0; otherwise a colour adds
    1 - |count - m| / count for m objects of that colour, and a position (only if the colour matched)
    adds 0 for a missing target, else a 0 at the first pair out of relation and then, always, a 1."""
    terms: list[float] = []
    matched: list[list[int] | None] = []
    for clause in meta["include"]:
        count, found = clause["count"], objects.get(clause["class"], [])
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            if "color" in clause or "position" in clause:
                terms.append(0.0)
        else:
            if "color" in clause:
                hits = sum(det.colors[i] == clause["color"] for i in found)
                terms.append(1 - abs(count - hits) / count)
                ok = hits == count
            if "position" in clause and ok:
                others = matched[clause["position"][1]]
                if others is None:
                    ok = False
                    terms.append(0.0)
                else:
                    ok = all(clause["position"][0] in relative_position(det.boxes[i], det.boxes[j], position_threshold)
                             for i in found for j in others)
                    terms += [1.0] if ok else [0.0, 1.0]
        matched.append(found if ok else None)
    return sum(terms) / len(terms)


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan
