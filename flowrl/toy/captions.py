"""Noisy captions: the image a pre-training caption comes with sometimes shows something else.

Why: web captions are noisy, and a model pre-trained on them draws the wrong thing for a known share
of its samples while still drawing the right thing most of the time. That is the headroom RL has on
real text-to-image models (sharpening toward a mode the base already has), and the toy world's base
model gets it the same way: it is pre-trained on (caption, image) pairs where, with a known probability
per attribute, the image was rendered from a corrupted spec:

* ``color``    a swapped colour: two objects trade colours (an attribute-binding error), or a lone
               group's colour is replaced;
* ``count``    a count off by one (counting prompts);
* ``relation`` another relation, drawn from the other three (position prompts);
* ``missing``  the second object left out (two-object and position prompts).

Each corruption is drawn independently. A corrupted spec never shows a held-out binding or pairing
(``heldout`` rule of `flowrl.toy.prompts`), so held-out prompts stay new to the model, noise included.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

from flowrl.toy.prompts import is_heldout
from flowrl.toy.world import COLORS, MAX_COUNT, RELATIONS

NOISE_KINDS: tuple[str, ...] = ("color", "count", "relation", "missing")
_TRIES = 20


def parse_noise(text: str) -> dict[str, float]:
    """"color=0.5,count=0.4" -> {"color": 0.5, "count": 0.4, ...} (unnamed kinds 0); one-line errors."""
    rates = dict.fromkeys(NOISE_KINDS, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in rates:
            raise ValueError(f"unknown caption noise {name!r}; expected some of {', '.join(NOISE_KINDS)}")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(f"caption noise {name} needs a probability, got {value!r}") from None
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"caption noise {name} must lie in [0, 1], got {rate}")
        rates[name] = rate
    return rates


def _recolor(spec: dict[str, Any], rng: np.random.Generator) -> None:
    groups = spec["objects"]
    if len(groups) == 2 and groups[0]["color"] != groups[1]["color"] and rng.random() < 0.5:
        groups[0]["color"], groups[1]["color"] = groups[1]["color"], groups[0]["color"]
        return
    g = groups[int(rng.integers(len(groups)))]
    others = [c for c in COLORS if c != g["color"]]
    g["color"] = others[int(rng.integers(len(others)))]


def _recount(spec: dict[str, Any], rng: np.random.Generator) -> None:
    g = spec["objects"][0]
    options = [n for n in (g["count"] - 1, g["count"] + 1) if 1 <= n <= MAX_COUNT]
    g["count"] = options[int(rng.integers(len(options)))]


def _rerelate(spec: dict[str, Any], rng: np.random.Generator) -> None:
    rel = spec["relation"]
    others = [r for r in RELATIONS if r != rel["relation"]]
    rel["relation"] = others[int(rng.integers(len(others)))]


def corrupt(spec: Mapping[str, Any], rates: Mapping[str, float], rng: np.random.Generator,
            rule: Mapping[str, list]) -> tuple[dict[str, Any], list[str]]:
    """The spec an image is rendered from, and which corruptions it carries ([] when faithful).

    Corruptions that do not apply to a task (a count for a pair) are skipped. A draw that would show a
    held-out binding or pairing under `rule` is redrawn; after a few tries that corruption is dropped.
    """
    out = copy.deepcopy(dict(spec))
    applied: list[str] = []
    task = spec["task"]
    steps = [("color", _recolor, True), ("count", _recount, task == "counting"),
             ("relation", _rerelate, task == "position")]
    for kind, apply, applies in steps:
        if not applies or rng.random() >= rates.get(kind, 0.0):
            continue
        for _ in range(_TRIES):
            trial = copy.deepcopy(out)
            apply(trial, rng)
            if not is_heldout(trial, rule):
                out = trial
                applied.append(kind)
                break
    if task in ("two_object", "position") and rng.random() < rates.get("missing", 0.0):
        out["objects"] = out["objects"][:1]
        out["relation"] = None
        applied.append("missing")
    return out, applied
