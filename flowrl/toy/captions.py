"""Noisy captions: the image a pre-training caption comes with sometimes shows something else.

Why: web captions are noisy, and a model pre-trained on them draws the wrong thing for a known share
of its samples while still drawing the right thing most of the time. That is the headroom RL has on
real text-to-image models (sharpening toward a mode the base already has), and the toy world's base
model gets it the same way: it is pre-trained on (caption, image) pairs where, with a known probability
per attribute, the image was rendered from a corrupted spec:

* ``color``    a swapped colour: two objects trade colours (an attribute-binding error), or a lone
               group takes its colour's confusion partner (`CONFUSED`);
* ``count``    a count off by one (counting prompts);
* ``relation`` the flipped relation (position prompts);
* ``missing``  the second object left out (two-object and position prompts).

Each corruption is drawn independently. Each has one or two wrong outcomes, not many: classifier-free
guidance sharpens toward the caption, and a wrong outcome spread over many images would all but vanish
under it, where a concentrated one stays a mode the base draws a known share of the time.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

from flowrl.toy.world import MAX_COUNT

NOISE_KINDS: tuple[str, ...] = ("color", "count", "relation", "missing")
CONFUSED: dict[str, str] = {"red": "orange", "orange": "red", "blue": "purple", "purple": "blue",
                            "yellow": "cyan", "cyan": "yellow", "green": "pink", "pink": "green"}
"""Each colour's confusion partner: the colour a noisy caption most often swaps it for."""
FLIPPED = {"left_of": "right_of", "right_of": "left_of", "above": "below", "below": "above"}


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
    """Trade the two groups' colours when they differ, else give one group its partner colour."""
    groups = spec["objects"]
    if len(groups) == 2 and groups[0]["color"] != groups[1]["color"]:
        groups[0]["color"], groups[1]["color"] = groups[1]["color"], groups[0]["color"]
        return
    g = groups[int(rng.integers(len(groups)))]
    g["color"] = CONFUSED[g["color"]]


def _recount(spec: dict[str, Any], rng: np.random.Generator) -> None:
    g = spec["objects"][0]
    options = [n for n in (g["count"] - 1, g["count"] + 1) if 1 <= n <= MAX_COUNT]
    g["count"] = options[int(rng.integers(len(options)))]


def _flip(spec: dict[str, Any], rng: np.random.Generator) -> None:
    spec["relation"]["relation"] = FLIPPED[spec["relation"]["relation"]]


def corrupt(spec: Mapping[str, Any], rates: Mapping[str, float],
            rng: np.random.Generator) -> tuple[dict[str, Any], list[str]]:
    """The spec an image is rendered from, and which corruptions it carries ([] when faithful).

    Corruptions that do not apply to a task (a count for a pair) are skipped. Every corrupted spec is a
    prompt of the grammar: pre-training sees every binding, so noise cannot leak an unseen one.
    """
    out = copy.deepcopy(dict(spec))
    applied: list[str] = []
    task = spec["task"]
    steps = [("color", _recolor, True), ("count", _recount, task == "counting"),
             ("relation", _flip, task == "position")]
    for kind, apply, applies in steps:
        if applies and rng.random() < rates.get(kind, 0.0):
            apply(out, rng)
            applied.append(kind)
    if task in ("two_object", "position") and rng.random() < rates.get("missing", 0.0):
        out["objects"] = out["objects"][:1]
        out["relation"] = None
        applied.append("missing")
    return out, applied
