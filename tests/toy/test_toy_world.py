"""Toy world: renderer, prompt grammar/split, detector-based rewards and diversity (CPU, fast)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from flowrl.toy import diversity as dv
from flowrl.toy import prompts as P
from flowrl.toy import world as W
from flowrl.toy.detect import detect
from rewards.toy_proxy import ToyProxy
from rewards.toyeval import ToyEval
from tests import REPO
from tools.toy_runs import COUNTING_PROMPTS, FOUR_PROMPTS

RED_CIRCLE = {"task": "single_object", "objects": [{"shape": "circle", "color": "red", "count": 1}], "relation": None}


def _spec(prompt: str) -> dict:
    return dict(P.all_prompts())[prompt]


def _score(scenes, prompts, size=64):
    imgs = W.to_tensor([W.render(s, size) for s in scenes])
    return ToyEval()(imgs, prompts, [_spec(p) for p in prompts])


# ---------------------------------------------------------------- world


def test_render_is_deterministic_and_well_formed():
    spec = _spec("a red circle on the left of a yellow square")
    a, b = W.sample_scene(spec, 7), W.sample_scene(spec, np.random.default_rng(7))
    assert a == b
    for size in (32, 64):
        img = W.render(a, size)
        assert img.shape == (size, size, 3) and img.dtype == np.uint8
        assert np.array_equal(img, W.render(b, size))
    gt = a.ground_truth()
    json.dumps(gt)  # JSON-serialisable
    assert gt["background"] in W.BACKGROUNDS and len(gt["objects"]) == 2
    assert {"shape", "color", "cx", "cy", "size", "bbox", "cell", "size_bin"} <= set(gt["objects"][0])
    seed = 3
    imgs, gts = W.render_batch([spec, RED_CIRCLE], seed, size=32)
    assert imgs.shape == (2, 3, 32, 32) and imgs.dtype == torch.float32
    assert 0 <= imgs.min() and imgs.max() <= 1 and len(gts) == 2
    assert torch.equal(imgs, W.render_batch([spec, RED_CIRCLE], seed, size=32)[0])


def test_layouts_are_separated_inside_and_satisfy_relations():
    rng = np.random.default_rng(0)
    items = P.all_prompts()
    for i in rng.choice(len(items), 150, replace=False):
        spec = items[i][1]
        sc = W.sample_scene(spec, rng)
        objs = sc.objects
        assert len(objs) == sum(g["count"] for g in spec["objects"])
        for o in objs:
            x0, y0, x1, y1 = o.bbox
            assert min(x0, y0) >= W.MARGIN - 1e-9 and max(x1, y1) <= 1 - W.MARGIN + 1e-9
        for j in range(len(objs)):
            for k in range(j + 1, len(objs)):
                assert W._separated(objs[j], objs[k])
        if spec["relation"]:
            a, b = objs[0], objs[1]
            assert W.relation_holds((a.cx, a.cy), (b.cx, b.cy), spec["relation"]["relation"])


# ---------------------------------------------------------------- ToyEval


@pytest.mark.parametrize("size", [64, 32])
def test_toyeval_on_ground_truth_renders(size):
    items = P.all_prompts()
    rng = np.random.default_rng(size)
    pick = [items[i] for i in rng.choice(len(items), 200, replace=False)]
    imgs, _ = W.render_batch([m for _, m in pick], rng, size=size)
    out = ToyEval()(imgs, [p for p, _ in pick], [m for _, m in pick])
    assert set(out) == {"toyeval", "toyeval/color", "toyeval/shape", "toyeval/object", "toyeval/count",
                        "toyeval/clean", "toyeval/position", "toyeval/partial"}
    assert all(v.shape == (200,) for v in out.values())
    assert out["toyeval"].mean() >= 0.98
    for k in ("color", "shape", "object", "count", "clean", "partial"):
        assert out[f"toyeval/{k}"].mean() >= 0.98, k
    has_rel = torch.tensor([m["relation"] is not None for _, m in pick])
    assert torch.equal(torch.isnan(out["toyeval/position"]), ~has_rel)
    assert out["toyeval/position"][has_rel].mean() >= 0.98


def _degrade(imgs: torch.Tensor, sigma: float, noise: float, seed: int = 0) -> torch.Tensor:
    """Gaussian blur + pixel noise, a stand-in for a small generative model's outputs."""
    r = int(math.ceil(3 * sigma))
    k = torch.exp(-0.5 * (torch.arange(-r, r + 1, dtype=torch.float32) / sigma) ** 2)
    k = k / k.sum()
    x = torch.nn.functional.pad(imgs, (r, r, r, r), mode="replicate")
    x = torch.nn.functional.conv2d(x, k.view(1, 1, 1, -1).repeat(3, 1, 1, 1), groups=3)
    x = torch.nn.functional.conv2d(x, k.view(1, 1, -1, 1).repeat(3, 1, 1, 1), groups=3)
    g = torch.Generator().manual_seed(seed)
    return (x + noise * torch.randn(x.shape, generator=g)).clamp(0, 1)


@pytest.mark.parametrize("size,sigma,noise", [(64, 1.0, 0.03), (32, 0.5, 0.02)])
def test_toyeval_robust_to_blur_and_noise(size, sigma, noise):
    items = P.all_prompts()
    rng = np.random.default_rng(1)
    pick = [items[i] for i in rng.choice(len(items), 128, replace=False)]
    imgs, _ = W.render_batch([m for _, m in pick], rng, size=size)
    out = ToyEval()(_degrade(imgs, sigma, noise), [p for p, _ in pick], [m for _, m in pick])
    assert out["toyeval"].mean() >= 0.95


def O(shape, color, cx, cy, size=0.26):  # noqa: E743 - short helper for hand-built scenes
    return W.Obj(shape, color, cx, cy, size)


@pytest.mark.parametrize("size", [64, 32])
def test_toyeval_hand_built_cases(size):
    bg = "gray"
    cases = [  # (prompt, objects, expected strict, {sub-score: expected})
        ("a red circle", [O("circle", "red", .5, .5)], 1, {"partial": 1}),
        ("a red circle", [O("circle", "blue", .5, .5)], 0, {"color": 0, "object": 0, "shape": 1}),
        ("a green triangle", [O("square", "green", .3, .6)], 0, {"shape": 0, "color": 1, "object": 0}),
        ("two blue squares", [O("square", "blue", x, .5) for x in (.18, .5, .82)], 0, {"count": 0, "object": 1}),
        ("two blue squares", [O("square", "blue", .3, .3)], 0, {"count": 0, "object": 1}),
        ("two blue squares", [O("square", "blue", .25, .7), O("square", "blue", .7, .3)], 1, {"count": 1}),
        ("a red circle", [O("circle", "red", .3, .5), O("square", "blue", .7, .5)], 0, {"clean": 0, "count": 1}),
        ("a red circle on the left of a yellow square",
         [O("circle", "red", .25, .5), O("square", "yellow", .75, .45)], 1, {"position": 1}),
        ("a red circle on the left of a yellow square",  # swapped
         [O("circle", "red", .75, .5), O("square", "yellow", .25, .45)], 0, {"position": 0, "count": 1}),
        ("a blue triangle above a green circle",
         [O("triangle", "blue", .4, .25), O("circle", "green", .5, .75)], 1, {"position": 1}),
        ("a blue triangle above a green circle",  # below instead
         [O("triangle", "blue", .4, .75), O("circle", "green", .5, .25)], 0, {"position": 0, "object": 1}),
        ("a blue triangle above a green circle",  # side by side is not "above"
         [O("triangle", "blue", .25, .48), O("circle", "green", .75, .52)], 0, {"position": 0}),
        ("a yellow circle and a purple diamond",
         [O("diamond", "purple", .3, .3), O("circle", "yellow", .7, .7)], 1, {"partial": 1}),
    ]
    scenes = [W.Scene(bg, "medium", tuple(objs)) for _, objs, _, _ in cases]
    out = _score(scenes, [c[0] for c in cases], size)
    for i, (prompt, _, strict, subs) in enumerate(cases):
        assert out["toyeval"][i] == strict, (i, prompt)
        for k, v in subs.items():
            assert out[f"toyeval/{k}"][i] == v, (i, prompt, k)


def test_toyeval_nan_means_could_not_score():
    sc = W.sample_scene(RED_CIRCLE, 0)
    imgs = W.to_tensor([W.render(sc), W.render(sc), W.render(sc)])
    imgs[2, 0, 0, 0] = float("nan")
    out = ToyEval()(imgs, ["a red circle", "an unparseable prompt", "a red circle"], [{}, {}, RED_CIRCLE])
    assert out["toyeval"][0] == 1  # spec recovered from the grammar
    assert torch.isnan(out["toyeval"][1:]).all() and torch.isnan(out["toyeval/partial"][1:]).all()


@pytest.mark.parametrize("fn", [
    lambda x: ToyEval()(x, ["a red circle"] * len(x), [RED_CIRCLE] * len(x)),
    lambda x: ToyProxy()(x, ["a red circle"] * len(x), [RED_CIRCLE] * len(x)),
    lambda x: dv.diversity(x),
])
def test_bad_input_raises_value_error(fn):
    good = torch.rand(2, 3, 32, 32)
    fn(good)
    fn(good * (1 + 5e-5))  # rounding overshoot is tolerated
    bads = (good * 1.5, good - 0.5, good[0], good[:, :1], torch.rand(2, 32, 32, 3), good.numpy(),
            (good * 255).to(torch.uint8))
    for bad in bads:
        with pytest.raises(ValueError):
            fn(bad)
    with pytest.raises(ValueError):
        ToyEval()(good, ["a red circle"], [RED_CIRCLE])  # length mismatch


# ---------------------------------------------------------------- prompts


def test_prompt_grammar_examples():
    assert P.prompt_for(RED_CIRCLE) == "a red circle"
    spec = {"objects": [{"shape": "square", "color": "blue", "count": 2}], "relation": None}
    assert P.prompt_for(spec) == "two blue squares"
    prompts = {p for p, _ in P.all_prompts()}
    for p in ("three green triangles", "a red circle on the left of a yellow square",
              "a blue triangle above a green circle", "a red circle and a blue square"):
        assert p in prompts


def test_split_is_disjoint_unique_and_covers_the_grammar(tmp_path):
    train, held = P.split(0)
    tp, hp = [p for p, _ in train], [p for p, _ in held]
    assert len(set(tp)) == len(tp) and len(set(hp)) == len(hp) and not set(tp) & set(hp)
    assert set(tp) | set(hp) == {p for p, _ in P.all_prompts()}  # pre-training's prompts, split for RL only
    assert P.split(0) == (train, held) and P.split(1) != (train, held)
    assert P.train_prompts() == train and P.heldout_prompts() == held
    paths = P.write_split(tmp_path, seed=0)
    assert P.read_jsonl(paths["train"]) == train and P.read_jsonl(paths["heldout"]) == held
    line = json.loads(paths["train"].read_text().splitlines()[0])
    assert set(line) == {"prompt", "metadata"}


def test_default_split_holds_out_prompts_not_bindings():
    train, held = P.split(0)
    counts = {t: sum(m["task"] == t for _, m in held) for t in P.TASKS}
    # a quarter of each task, at least 32, at most half: single objects 16 of 32, counts 32 of 64
    assert counts == {"single_object": 16, "counting": 32, "two_object": 124, "position": 992}
    assert P.heldout_count(3968) == 992 and P.heldout_count(64) == 32 and P.heldout_count(32) == 16
    for task in P.TASKS[1:]:  # every binding is trained and scored in every task with room for it
        for items in (train, held):
            combos = {c for _, m in items if m["task"] == task for c in P.spec_combos(m)}
            assert combos == set(P.all_combos()), task
    single = [P.spec_combos(m)[0] for _, m in held if m["task"] == "single_object"]
    assert set(Counter(c for c, _ in single).values()) == {2}  # each colour with two of four shapes
    assert set(Counter(s for _, s in single).values()) == {4}  # each shape with four of eight colours
    counted = Counter(m["objects"][0]["count"] for _, m in held if m["task"] == "counting")
    assert counted == {2: 16, 3: 16}
    for prompt in (*COUNTING_PROMPTS, *FOUR_PROMPTS):
        assert prompt in dict(train)  # tests/toy/test_toy_rl.py and the measured short runs train on them
    assert P.read_jsonl(REPO / "assets/prompts/toy/heldout.jsonl") == held
    assert P.read_jsonl(REPO / "assets/prompts/toy/train.jsonl") == train


# ---------------------------------------------------------------- diversity


def test_entropy_and_coverage_by_hand():
    nb = len(W.BACKGROUNDS)
    assert dv.normalized_entropy([3, 3, 3], nb) == 0
    assert dv.normalized_entropy([0, 1, 0, 1], nb) == pytest.approx(math.log(2) / math.log(nb))
    assert dv.normalized_entropy(list(range(nb)), nb) == pytest.approx(1.0)
    assert dv.coverage([0, 1, 0, 1], nb) == pytest.approx(2 / nb)
    assert math.isnan(dv.normalized_entropy([], nb))


def _renders(bgs, size_bin="medium", seed=0, size=64):
    rng = np.random.default_rng(seed)
    scenes = [W.sample_scene(RED_CIRCLE, rng, background=b, size_bin=size_bin) for b in bgs]
    return W.to_tensor([W.render(s, size) for s in scenes]), scenes


def test_diversity_from_pixels():
    nb = len(W.BACKGROUNDS)
    img, _ = _renders(["sky"])
    same = img.repeat(8, 1, 1, 1)
    d = dv.diversity(same)
    assert d["diversity/background"] == 0 and d["diversity/position"] == 0 and d["diversity/size"] == 0
    assert d["diversity/gt_mean"] == 0 and d["diversity/coverage_background"] == pytest.approx(1 / nb)

    varied, _ = _renders(list(W.BACKGROUNDS) * 4)
    assert dv.diversity(varied)["diversity/background"] == pytest.approx(1.0)

    two, _ = _renders(["white", "black"] * 4)
    expect = math.log(2) / math.log(nb)
    assert dv.diversity(two)["diversity/background"] == pytest.approx(expect)
    # group ids: a collapsed group and a two-background group average
    both = torch.cat([same, two])
    d = dv.diversity(both, group_ids=[0] * 8 + [1] * 8)
    assert d["diversity/background"] == pytest.approx(expect / 2)
    # a tensor of group ids (what the recipe's report passes) groups the same way
    assert dv.diversity(both, group_ids=torch.tensor([0] * 8 + [1] * 8)) == d
    per = dv.diversity_by_group(dv.free_attributes(both), [0] * 8 + [1] * 8)
    assert per[0]["diversity/background"] == 0 and per[1]["diversity/background"] == pytest.approx(expect)


def test_detected_free_attributes_match_ground_truth():
    rng = np.random.default_rng(1)
    items = P.all_prompts()
    specs = [items[i][1] for i in rng.choice(len(items), 40, replace=False)]
    imgs, gts = W.render_batch(specs, rng, size=64)
    measured = dv.free_attributes(imgs)
    truth = [dv.scene_free_attributes(g) for g in gts]
    for m, t in zip(measured, truth):
        assert m.background == t.background
        assert sorted(m.positions) == sorted(t.positions) and sorted(m.sizes) == sorted(t.sizes)


# ---------------------------------------------------------------- ToyProxy


def test_toy_proxy_prefers_centred_large_saturated_and_is_deterministic():
    big = W.Scene("black", "large", (O("circle", "red", .5, .5, .32),))
    small = W.Scene("black", "small", (O("circle", "red", .14, .14, .2),))
    dull = W.Scene("white", "small", (O("circle", "red", .14, .86, .2),))
    imgs = W.to_tensor([W.render(s) for s in (big, small, dull)])
    proxy = ToyProxy()
    out = proxy(imgs, ["a red circle"] * 3, [RED_CIRCLE] * 3)
    s = out["toy_proxy"]
    assert s[0] > s[1] > s[2] and ((s >= 0) & (s <= 1)).all()
    assert out["toy_proxy/centre"][0] > out["toy_proxy/centre"][1]
    assert out["toy_proxy/size"][0] > out["toy_proxy/size"][1]
    assert out["toy_proxy/background"][1] > out["toy_proxy/background"][2]
    again = proxy(imgs.clone(), ["a red circle"] * 3, [RED_CIRCLE] * 3)
    assert all(torch.equal(out[k], again[k]) for k in out)
    # its optimum over a free attribute is a single mode: the preferred background
    varied, scenes = _renders(list(W.BACKGROUNDS))
    best = int(proxy(varied, [""] * len(scenes), [{}] * len(scenes))["toy_proxy"].argmax())
    assert scenes[best].background == "black"


def test_detect_single_image_inputs():
    sc = W.Scene("mint", "medium", (O("triangle", "yellow", .5, .5),))
    img = W.render(sc)
    for x in (img, img.astype(np.float32) / 255, W.to_tensor([img])[0]):
        (d,) = detect(x)
        assert (d.color, d.shape) == ("yellow", "triangle")
        assert abs(d.cx - .5) < .02 and abs(d.cy - .5) < .02 and abs(d.size - .26) < .02
