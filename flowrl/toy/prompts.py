"""Prompt grammar of the toy world, and the RL train / held-out split of its prompts.

Why: RL is judged as GenEval judges it. Every object, colour and pairing of the
benchmark was in the base model's pre-training; the benchmark's prompts were
not in RL's training set. So pre-training draws from every prompt of the grammar
and RL trains on a split that holds whole prompts out (`split`): RL sharpens
choices the model can already make, on prompts it was never rewarded on.

Every prompt comes with a JSON-serialisable metadata dict, the spec that both
the renderer (`world.sample_scene`) and the ToyEval reward read:

    {"task": "position",
     "objects": [{"shape": "circle", "color": "red", "count": 1},
                 {"shape": "square", "color": "yellow", "count": 1}],
     "relation": {"relation": "left_of", "a": 0, "b": 1}}   # or None

Tasks: single_object ("a red circle"), counting ("two blue squares"),
two_object ("a red circle and a blue square"), position ("a red circle on the
left of a yellow square", "a blue triangle above a green circle").
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from flowrl.data.prompts import round_robin
from flowrl.toy.world import COLORS, MAX_COUNT, RELATIONS, SHAPES

TASKS: tuple[str, ...] = ("single_object", "counting", "two_object", "position")
NUMBER_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATION_PHRASES = {
    "left_of": "on the left of",
    "right_of": "on the right of",
    "above": "above",
    "below": "below",
}

Combo = tuple[str, str]  # (color, shape)
Item = tuple[str, dict[str, Any]]  # (prompt, metadata)


def _noun_phrase(color: str, shape: str, count: int) -> str:
    if count == 1:
        article = "an" if color[0] in "aeiou" else "a"
        return f"{article} {color} {shape}"
    return f"{NUMBER_WORDS[count]} {color} {shape}s"


def prompt_for(spec: dict[str, Any]) -> str:
    """Render a spec as its natural-language prompt."""
    parts = [_noun_phrase(g["color"], g["shape"], g["count"]) for g in spec["objects"]]
    rel = spec.get("relation")
    if rel:
        return f"{parts[rel['a']]} {RELATION_PHRASES[rel['relation']]} {parts[rel['b']]}"
    return " and ".join(parts)


def _group(combo: Combo, count: int = 1) -> dict[str, Any]:
    return {"shape": combo[1], "color": combo[0], "count": count}


def all_combos(colors: Sequence[str] | None = None, shapes: Sequence[str] | None = None) -> list[Combo]:
    """Every (color, shape) pair, in palette order."""
    return list(itertools.product(colors or list(COLORS), shapes or list(SHAPES)))


def all_specs(colors: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
              max_count: int = MAX_COUNT, tasks: Iterable[str] = TASKS) -> list[dict[str, Any]]:
    """Enumerate every spec of the grammar (deterministic order)."""
    tasks = set(tasks)
    unknown = tasks - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; expected a subset of {TASKS}")
    combos = all_combos(colors, shapes)
    specs: list[dict[str, Any]] = []
    if "single_object" in tasks:
        specs += [{"task": "single_object", "objects": [_group(c)], "relation": None} for c in combos]
    if "counting" in tasks:
        specs += [{"task": "counting", "objects": [_group(c, n)], "relation": None}
                  for c in combos for n in range(2, max_count + 1)]
    if "two_object" in tasks:
        specs += [{"task": "two_object", "objects": [_group(a), _group(b)], "relation": None}
                  for a, b in itertools.combinations(combos, 2)]
    if "position" in tasks:
        specs += [{"task": "position", "objects": [_group(a), _group(b)],
                   "relation": {"relation": r, "a": 0, "b": 1}}
                  for a, b in itertools.permutations(combos, 2) for r in RELATIONS]
    return specs


def all_prompts(**kwargs: Any) -> list[Item]:
    """(prompt, metadata) for every spec; kwargs as in `all_specs`."""
    return [(prompt_for(s), s) for s in all_specs(**kwargs)]


def spec_combos(spec: dict[str, Any]) -> list[Combo]:
    """The (color, shape) combinations a spec mentions."""
    return [(g["color"], g["shape"]) for g in spec["objects"]]


SPLIT: dict[str, Any] = dict(heldout_frac=0.25, min_heldout=32)
"""The toy world's one split, GenEval's protocol: pre-training sees every prompt of the grammar (every binding
and every pair), and RL trains on three quarters of the prompts and is scored on the rest.

Held out per task: a quarter of its prompts, at least `min_heldout` and at most half (single objects have 32
prompts in all, so 16 / 16). Every colour-shape binding appears in both sets wherever the task has room."""


def combo_order(seed: int = 0, colors: Sequence[str] | None = None,
                shapes: Sequence[str] | None = None) -> list[Combo]:
    """Every (color, shape) pair in a balanced order drawn from `seed`.

    Shape-major diagonals of a random colour x shape grid: combo k has shape k % S and colour
    (k // S + (k % S) * max(1, C // S)) % C (after shuffling both). So the first min(C, S) combos
    have distinct colours and distinct shapes, and any prefix spreads over colours and shapes nearly
    evenly: with 8 colours x 4 shapes the first 16 hold each colour twice and each shape four times.
    """
    colors, shapes = list(colors or COLORS), list(shapes or SHAPES)
    rng = np.random.default_rng(seed)
    pc, ps = rng.permutation(len(colors)), rng.permutation(len(shapes))
    nc, ns = len(colors), len(shapes)
    step = max(1, nc // ns)  # spreads each round's shapes over the colours evenly
    return [(colors[pc[(k // ns + (k % ns) * step) % nc]], shapes[ps[k % ns]]) for k in range(nc * ns)]


def heldout_count(n: int, heldout_frac: float = SPLIT["heldout_frac"],
                  min_heldout: int = SPLIT["min_heldout"]) -> int:
    """How many of a task's `n` prompts are held out: the fraction, at least `min_heldout`, at most half."""
    return min(max(min_heldout, int(round(heldout_frac * n))), n // 2)


def _heldout_of_task(task: str, specs: list[dict[str, Any]], n_held: int, order: list[Combo],
                     rng: np.random.Generator) -> set[int]:
    """Indices into `specs` (one task's) to hold out.

    Single objects: a balanced prefix of `combo_order`, so each colour and each shape is held out equally.
    Counting: per binding one of its counts, so every binding is trained and scored. Pairs and relations:
    a uniform random draw (with hundreds of prompts every binding lands in both sets)."""
    if task == "single_object":
        held = set(order[:n_held])
        return {i for i, s in enumerate(specs) if spec_combos(s)[0] in held}
    if task == "counting":
        by_combo: dict[Combo, list[int]] = {}
        for i, s in enumerate(specs):
            by_combo.setdefault(spec_combos(s)[0], []).append(i)
        combos = list(by_combo)
        # the k-th binding of a random order holds out its (k mod #counts)-th count: counts held out evenly
        picks = [by_combo[combos[c]][k % len(by_combo[combos[c]])] for k, c in enumerate(rng.permutation(len(combos)))]
        return set(picks[:n_held])
    return set(rng.choice(len(specs), size=n_held, replace=False).tolist())


def split(seed: int = 0, heldout_frac: float = SPLIT["heldout_frac"], min_heldout: int = SPLIT["min_heldout"],
          tasks: Iterable[str] = TASKS, **kwargs: Any) -> tuple[list[Item], list[Item]]:
    """Deterministic (rl_train, heldout) lists of (prompt, metadata): disjoint prompts of the full grammar.

    Pre-training uses every prompt (`all_prompts`); the split only decides what RL trains on. Each list
    takes its tasks in turn (see `interleave_tasks`), so any prefix is a task-stratified subset: recipes
    score the first N held-out prompts, and position prompts outnumber the others.
    """
    rng = np.random.default_rng(seed)
    order = combo_order(seed, kwargs.get("colors"), kwargs.get("shapes"))
    train: list[Item] = []
    held: list[Item] = []
    for task in TASKS:
        if task not in set(tasks):
            continue
        specs = all_specs(tasks=[task], **kwargs)
        out = _heldout_of_task(task, specs, heldout_count(len(specs), heldout_frac, min_heldout), order, rng)
        for i, spec in enumerate(specs):
            (held if i in out else train).append((prompt_for(spec), spec))
    return interleave_tasks(train), interleave_tasks(held)


def interleave_tasks(items: Sequence[Item]) -> list[Item]:
    """Round-robin over tasks (in TASKS order), keeping each task's own order; exhausted tasks drop out."""
    return [items[i] for i in round_robin([item[1]["task"] for item in items], order=TASKS)]


def train_prompts(seed: int = 0, **kwargs: Any) -> list[Item]:
    """Training (prompt, metadata) pairs of `split(seed)`."""
    return split(seed, **kwargs)[0]


def heldout_prompts(seed: int = 0, **kwargs: Any) -> list[Item]:
    """Held-out (prompt, metadata) pairs of `split(seed)`."""
    return split(seed, **kwargs)[1]


def write_jsonl(items: Iterable[Item], path: str | Path) -> Path:
    """Write {"prompt": ..., "metadata": {...}} lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for prompt, meta in items:
            f.write(json.dumps({"prompt": prompt, "metadata": meta}, sort_keys=True) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Item]:
    """Inverse of `write_jsonl`."""
    with Path(path).open(encoding="utf-8") as f:
        return [(d["prompt"], d["metadata"]) for d in map(json.loads, f) if d]


def write_split(out_dir: str | Path, seed: int = 0, **kwargs: Any) -> dict[str, Path]:
    """Write train.jsonl (RL's prompts) and heldout.jsonl (the report's) under `out_dir`."""
    train, held = split(seed, **kwargs)
    return {"train": write_jsonl(train, Path(out_dir) / "train.jsonl"),
            "heldout": write_jsonl(held, Path(out_dir) / "heldout.jsonl")}
