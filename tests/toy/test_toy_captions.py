"""Noisy captions (flowrl.toy.captions): each corruption does what its name says, at its rate, and draws a
prompt of the grammar."""

import numpy as np
import pytest

from flowrl.toy import captions as C
from flowrl.toy import prompts as P

TRAIN = dict(P.all_prompts())
GRAMMAR = {prompt for prompt, _ in P.all_prompts()}


def in_grammar(spec):
    """The spec's prompt, or its two groups' in the other order (the grammar lists each pair once)."""
    flipped = dict(spec, objects=spec["objects"][::-1], relation=None)
    return P.prompt_for(spec) in GRAMMAR or (spec["relation"] is None and P.prompt_for(flipped) in GRAMMAR)


def corrupt(prompt, seed=0, **rates):
    return C.corrupt(TRAIN[prompt], C.parse_noise(",".join(f"{k}={v}" for k, v in rates.items())),
                     np.random.default_rng(seed))


def test_each_corruption_by_hand():
    assert corrupt("a red square", color=0) == (TRAIN["a red square"], [])
    spec, kinds = corrupt("a red square", color=1)
    assert kinds == ["color"] and spec["objects"][0]["color"] == "orange"  # red's confusion partner
    spec, kinds = corrupt("a red square and an orange diamond", color=1)
    assert kinds == ["color"] and [g["color"] for g in spec["objects"]] == ["orange", "red"]  # binding swap
    spec, _ = corrupt("a red square and a green triangle", color=1)
    assert [g["color"] for g in spec["objects"]] == ["green", "red"]
    spec, kinds = corrupt("a red square and a red triangle", color=1)  # equal colours: one takes its partner
    assert kinds == ["color"] and sorted(g["color"] for g in spec["objects"]) == ["orange", "red"]
    spec, _ = corrupt("three blue circles", count=1)
    assert spec["objects"][0]["count"] == 2
    counts = {corrupt("two blue circles", seed=s, count=1)[0]["objects"][0]["count"] for s in range(20)}
    assert counts == {1, 3}
    spec, _ = corrupt("a red square on the left of a green triangle", relation=1)
    assert spec["relation"]["relation"] == "right_of"
    spec, kinds = corrupt("a red square above a green triangle", missing=1)
    assert kinds == ["missing"] and len(spec["objects"]) == 1 and spec["relation"] is None
    assert corrupt("a red square", count=1, relation=1, missing=1)[1] == []  # nothing applies to a single object


def test_rates_hold_and_every_corruption_is_a_prompt_of_the_grammar():
    rng = np.random.default_rng(0)
    rates = C.parse_noise("color=0.4,count=0.3,relation=0.5,missing=0.2")
    kinds = {k: [] for k in C.NOISE_KINDS}
    for _, spec in P.all_prompts() * 2:
        drawn, applied = C.corrupt(spec, rates, rng)
        assert in_grammar(drawn), drawn
        for k, applies in (("color", True), ("count", spec["task"] == "counting"),
                           ("relation", spec["task"] == "position"),
                           ("missing", spec["task"] in ("two_object", "position"))):
            if applies:
                kinds[k].append(k in applied)
    for k, rate in rates.items():
        n = len(kinds[k])
        assert abs(np.mean(kinds[k]) - rate) < 4 * (rate * (1 - rate) / n) ** 0.5 + 0.01, k


@pytest.mark.parametrize("text, message", [("colour=0.5", "unknown caption noise 'colour'"),
                                           ("color=high", "needs a probability"), ("count=1.5", r"in \[0, 1\]")])
def test_bad_noise_is_one_line(text, message):
    with pytest.raises(ValueError, match=message):
        C.parse_noise(text)
