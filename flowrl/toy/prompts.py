"""Prompt grammar of the toy world, and a train / held-out split of combinations.

Why: RL on a verifiable reward should be judged on prompts whose attribute
*bindings* were never trained on (GenEval-style compositional generalisation),
so the split is over combinations, not over random prompts.

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

from flowrl.data import round_robin
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


SPLIT: dict[str, Any] = dict(n_combos=16, pair_frac=0.1, pair_base=16)
"""The toy world's one split: the shipped base was pre-trained on its train prompts and RL trains on them
too, so a held-out binding appears in no pre-training image or caption (noise included) and in no RL batch.

16 of the 32 colour-shape bindings are held out, each colour with two of the four shapes and each shape with
four of the eight colours (a balanced half), and 10% of the pairs of trained bindings."""

def combo_order(seed: int = 0, colors: Sequence[str] | None = None,
                shapes: Sequence[str] | None = None) -> list[Combo]:
    """Every (color, shape) pair in the order `heldout_rule` holds them out, drawn from `seed`.

    Shape-major diagonals of a random colour x shape grid: combo k has shape k % S and colour
    (k // S + (k % S) * max(1, C // S)) % C (after shuffling both). So the first min(C, S) combos
    have distinct colours and distinct shapes, each shape is held out at most ceil(n / S) times, and
    colours nearly as evenly: with 8 colours x 4 shapes the first 8 hold each colour once and the
    first 16 each colour twice (with 5 x 4, at most twice each in the first 8).
    """
    return _draw_combo_order(seed, list(colors or COLORS), list(shapes or SHAPES))[0]


def _draw_combo_order(seed: int, colors: list[str], shapes: list[str]) -> tuple[list[Combo], np.random.Generator]:
    """`combo_order`, and the generator after its draws (the held-out pairs are drawn next)."""
    rng = np.random.default_rng(seed)
    pc, ps = rng.permutation(len(colors)), rng.permutation(len(shapes))
    nc, ns = len(colors), len(shapes)
    step = max(1, nc // ns)  # spreads each round's shapes over the colours evenly
    return [(colors[pc[(k // ns + (k % ns) * step) % nc]], shapes[ps[k % ns]]) for k in range(nc * ns)], rng


def heldout_rule(seed: int = 0, n_combos: int = SPLIT["n_combos"], pair_frac: float = SPLIT["pair_frac"],
                 colors: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
                 pair_base: int = SPLIT["pair_base"]) -> dict[str, list]:
    """Which combinations are held out, drawn deterministically from `seed`.

    * the first `n_combos` (color, shape) bindings of `combo_order`; every colour and every shape
      must still be seen in training;
    * a fraction `pair_frac` of the unordered pairs of the bindings after the first `pair_base` of
      `combo_order`, so bindings are trained but some pairings are new (novel composition). Pairs
      with a held-out binding add nothing and are dropped. `pair_base` fixes the draw, so a rule
      holds out everything the rule with n_combos = pair_base (same seed) holds out.
    """
    colors, shapes = list(colors or COLORS), list(shapes or SHAPES)
    order, rng = _draw_combo_order(seed, colors, shapes)
    if not 0 <= n_combos <= len(order) or not 0 <= pair_base <= len(order):
        raise ValueError(f"n_combos and pair_base must be in [0, {len(order)}], got {n_combos}, {pair_base}")
    held = order[:n_combos]
    seen = set(order[n_combos:])
    unseen = sorted(set(colors) - {c for c, _ in seen}) + sorted(set(shapes) - {s for _, s in seen})
    if unseen:
        raise ValueError(f"n_combos={n_combos} holds out every combination of {unseen}")
    pairs = list(itertools.combinations([c for c in all_combos(colors, shapes) if c not in order[:pair_base]], 2))
    pick = rng.choice(len(pairs), size=int(round(pair_frac * len(pairs))), replace=False)
    held_pairs = [pairs[i] for i in sorted(pick) if not set(pairs[i]) & set(held)]
    return {"combos": [list(c) for c in held], "pairs": [[list(a), list(b)] for a, b in held_pairs]}


def is_heldout(spec: dict[str, Any], rule: dict[str, list]) -> bool:
    """True if the spec uses a held-out binding or a held-out pairing of bindings."""
    held = {tuple(c) for c in rule["combos"]}
    combos = spec_combos(spec)
    if any(c in held for c in combos):
        return True
    pairs = {frozenset((tuple(a), tuple(b))) for a, b in rule["pairs"]}
    return len(combos) == 2 and frozenset(combos) in pairs


def split(seed: int = 0, n_combos: int = SPLIT["n_combos"], pair_frac: float = SPLIT["pair_frac"],
          pair_base: int = SPLIT["pair_base"],
          tasks: Iterable[str] = TASKS, **kwargs: Any) -> tuple[list[Item], list[Item]]:
    """Deterministic (train, heldout) lists of (prompt, metadata); disjoint by construction.

    Each list takes its tasks in turn (see `interleave_tasks`), so any prefix is a task-stratified
    subset: recipes score the first N held-out prompts, and position prompts outnumber the others.
    """
    rule = heldout_rule(seed, n_combos, pair_frac, kwargs.get("colors"), kwargs.get("shapes"), pair_base)
    train: list[Item] = []
    held: list[Item] = []
    for spec in all_specs(tasks=tasks, **kwargs):
        (held if is_heldout(spec, rule) else train).append((prompt_for(spec), spec))
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
    """Write train.jsonl, heldout.jsonl and heldout_rule.json under `out_dir`."""
    out = Path(out_dir)
    train, held = split(seed, **kwargs)
    rule_kw = {k: kwargs[k] for k in ("n_combos", "pair_frac", "colors", "shapes", "pair_base") if k in kwargs}
    out.mkdir(parents=True, exist_ok=True)
    rule_path = out / "heldout_rule.json"
    rule_path.write_text(json.dumps(heldout_rule(seed, **rule_kw), indent=1) + "\n", encoding="utf-8")
    return {"train": write_jsonl(train, out / "train.jsonl"),
            "heldout": write_jsonl(held, out / "heldout.jsonl"), "rule": rule_path}
