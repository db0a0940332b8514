"""The ``geneval`` reward: GenEval's rules on hand-made detections (numbers worked out by hand), the whole judge
on a tiny random Mask2Former and a tiny CLIP (batch = one image at a time), and its one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from rewards.geneval import rules
from rewards.geneval.rules import Detections

# ----------------------------------------------------------------------------------- hand-made detections


def _dets(*objects) -> Detections:
    """objects: (label, score, (x1, y1, x2, y2), colour or None)."""
    return Detections(torch.tensor([o[2] for o in objects], dtype=torch.float32).view(-1, 4),
                      torch.tensor([o[1] for o in objects]), [o[0] for o in objects], None,
                      [o[3] for o in objects])


def _judge(meta, *objects, **kw):
    return rules.judge(meta, _dets(*objects), **kw)


def test_single_object_needs_a_detection_above_0_3():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    assert _judge(meta, ("dog", 0.31, (0, 0, 10, 10), None))["strict"] == 1.0
    miss = _judge(meta, ("dog", 0.29, (0, 0, 10, 10), None), ("cat", 0.9, (0, 0, 10, 10), None))
    assert miss["strict"] == 0.0 and miss["count"] == 0.0 and miss["partial"] == 0.0  # 0.29 is not above 0.3
    assert math.isnan(miss["color"]) and math.isnan(miss["position"]) and math.isnan(miss["exclude"])


def test_counting_uses_the_stricter_threshold():
    meta = {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]}
    two = [("cup", 0.95, (0, 0, 5, 5), None), ("cup", 0.91, (10, 0, 15, 5), None)]
    # a third cup at 0.5 would count under 0.3, not under counting's 0.9: still exactly two
    got = _judge(meta, *two, ("cup", 0.5, (20, 0, 25, 5), None))
    assert (got["strict"], got["count"], got["exclude"], got["partial"], got["flow_grpo"]) == (1.0, 1.0, 1.0, 1.0, 1.0)
    assert math.isnan(got["color"]) and math.isnan(got["position"])
    three = _judge(meta, *two, ("cup", 0.92, (20, 0, 25, 5), None))
    assert three["strict"] == 0.0 and three["count"] == 1.0 and three["exclude"] == 0.0 and three["partial"] == 0.5
    one = _judge(meta, two[0], ("cup", 0.89, (10, 0, 15, 5), None))
    assert one["strict"] == 0.0 and one["count"] == 0.0 and one["exclude"] == 1.0 and one["partial"] == 0.5
    # the same 0.5 cup in a non-counting prompt is kept: 3 cups, the exclude clause fails
    assert _judge({**meta, "tag": "two_object"}, *two, ("cup", 0.5, (20, 0, 25, 5), None))["exclude"] == 0.0


def test_at_most_16_objects_per_class():
    many = [("bird", 0.5 + i / 100, (i, 0, i + 1, 1), None) for i in range(20)]
    kept = rules.select_objects(_dets(*many), "single_object")
    assert kept["bird"] == list(range(19, 3, -1))  # the 16 most confident, most confident first
    meta = {"tag": "single_object", "include": [{"class": "bird", "count": 1}],
            "exclude": [{"class": "bird", "count": 17}]}
    assert _judge(meta, *many)["strict"] == 1.0  # 20 detected, 16 kept: < 17


def test_colour_is_judged_on_the_most_confident_objects():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    assert _judge(meta, ("car", 0.9, (0, 0, 9, 9), "red"), ("car", 0.8, (0, 0, 9, 9), "blue"))["strict"] == 1.0
    got = _judge(meta, ("car", 0.8, (0, 0, 9, 9), "red"), ("car", 0.9, (0, 0, 9, 9), "blue"))
    assert got["strict"] == 0.0 and got["count"] == 1.0 and got["color"] == 0.0
    objects = rules.select_objects(_dets(("car", 0.8, (0, 0, 9, 9), None), ("car", 0.9, (0, 0, 9, 9), None)), "colors")
    assert rules.color_queries(meta, objects) == [1]  # only the top car's colour is asked for


def test_colour_attribute_two_clauses():
    meta = {"tag": "color_attr", "include": [{"class": "bench", "count": 1, "color": "green"},
                                             {"class": "vase", "count": 1, "color": "white"}]}
    got = _judge(meta, ("bench", 0.7, (0, 0, 9, 9), "green"), ("vase", 0.7, (20, 0, 29, 9), "black"))
    assert got["strict"] == 0.0 and got["color"] == 0.5 and got["partial"] == 0.5 and got["count"] == 1.0


def test_two_objects():
    meta = {"tag": "two_object", "include": [{"class": "horse", "count": 1}, {"class": "kite", "count": 1}]}
    assert _judge(meta, ("horse", 0.4, (0, 0, 9, 9), None), ("kite", 0.6, (0, 0, 9, 9), None))["strict"] == 1.0
    got = _judge(meta, ("horse", 0.4, (0, 0, 9, 9), None))
    assert got["strict"] == 0.0 and got["count"] == 0.5 and got["partial"] == 0.5


POSITION = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                           {"class": "dog", "count": 1, "position": ["left of", 0]}]}


@pytest.mark.parametrize("dog_x1, expected", [
    # cat box (100, 0, 120, 20), dog boxes 20 wide on the same row: offset dx = dog_x1 - 100, and the margin
    # 0.1 * (20 + 20) = 4 shrinks it: left of needs (|dx| - 4) / |dx| > 0.5, i.e. |dx| > 8
    (50, 1.0),    # dx = -50: -46 / 50 = -0.92
    (90, 1.0),    # dx = -10: -6 / 10 = -0.6
    (92, 0.0),    # dx = -8: -4 / 8 = -0.5, not below -0.5
    (96, 0.0),    # dx = -4: within the margin on both axes: no relation at all
    (150, 0.0),   # dx = +50: right of
])
def test_position_with_the_margin(dog_x1, expected):
    got = _judge(POSITION, ("cat", 0.9, (100, 0, 120, 20), None), ("dog", 0.9, (dog_x1, 0, dog_x1 + 20, 20), None))
    assert got["strict"] == expected and got["position"] == expected and got["count"] == 1.0


def test_relative_position_by_hand():
    box = lambda x, y: torch.tensor([x, y, x + 10.0, y + 10.0])  # noqa: E731
    assert rules.relative_position(box(0, 0), box(50, 0)) == {"left of"}
    assert rules.relative_position(box(0, 50), box(0, 0)) == {"below"}  # image y points down
    assert rules.relative_position(box(0, 0), box(1, 1)) == set()  # within 0.1 * (10 + 10) = 2 on both axes
    # diagonal (30, 30): shrunk (28, 28) / 42.43 = 0.66 on both axes: right of and below
    assert rules.relative_position(box(30, 30), box(0, 0)) == {"right of", "below"}
    # (30, 10): shrunk (28, 8) / 31.62 = (0.885, 0.253): right of only
    assert rules.relative_position(box(30, 10), box(0, 0)) == {"right of"}


def test_position_needs_its_target_and_every_pair():
    only_dog = _judge(POSITION, ("dog", 0.9, (0, 0, 20, 20), None))
    assert only_dog["strict"] == 0.0 and only_dog["count"] == 0.5 and only_dog["position"] == 0.0
    meta = {"tag": "position", "include": [{"class": "cat", "count": 2},
                                           {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    cats = [("cat", 0.9, (100, 0, 120, 20), None), ("cat", 0.8, (40, 0, 60, 20), None)]
    assert _judge(meta, *cats, ("dog", 0.9, (0, 0, 20, 20), None))["strict"] == 1.0  # left of both
    assert _judge(meta, *cats, ("dog", 0.9, (70, 0, 90, 20), None))["strict"] == 0.0  # right of one


def test_exclude_clauses_are_or_ed():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}],
            "exclude": [{"class": "cat", "count": 1}, {"class": "dog", "count": 2}]}
    dog = ("dog", 0.9, (0, 0, 9, 9), None)
    assert _judge(meta, dog)["strict"] == 1.0
    got = _judge(meta, dog, ("cat", 0.31, (0, 0, 9, 9), None))
    assert got["strict"] == 0.0 and got["exclude"] == 0.5 and got["partial"] == pytest.approx(2 / 3)


def test_overlap_suppression_is_an_option_off_by_default():
    # boxes (0,0,9,9) and (1,0,10,9): GenEval's +1 areas 100 each, intersection 90, IoU 90 / 110 = 0.818
    two = _dets(("cup", 0.9, (0, 0, 9, 9), None), ("cup", 0.8, (1, 0, 10, 9), None))
    assert rules.select_objects(two, "x")["cup"] == [0, 1]
    assert rules.select_objects(two, "x", max_overlap=0.8)["cup"] == [0]
    assert rules.select_objects(two, "x", max_overlap=0.85)["cup"] == [0, 1]


def test_flow_grpo_score_by_hand():
    cups = {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]}
    three = [("cup", 0.95, (i, 0, i + 5, 5), None) for i in (0, 10, 20)]
    assert _judge(cups, *three)["flow_grpo"] == 0.5  # 1 - |2 - 3| / 2; the exclude clause plays no part
    dog = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    assert _judge(dog, *[("dog", 0.9, (i, 0, i + 5, 5), None) for i in (0, 10, 20)])["flow_grpo"] == -1.0  # 1 - 2
    red = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    assert _judge(red, ("car", 0.9, (0, 0, 9, 9), "blue"))["flow_grpo"] == 0.5  # [1, 1 - |1 - 0|]
    assert _judge(red)["flow_grpo"] == 0.0  # [0, 0]: no car, and the colour adds one 0
    cat, left, right = ("cat", 0.9, (100, 0, 120, 20), None), ("dog", 0.9, (0, 0, 20, 20), None), \
        ("dog", 0.9, (200, 0, 220, 20), None)
    assert _judge(POSITION, cat, left)["flow_grpo"] == 1.0  # [1], [1, 1]
    assert _judge(POSITION, cat, right)["flow_grpo"] == 0.75  # [1], [1, 0, 1]: a failed pair adds 0 and then 1
    assert _judge(POSITION, left)["flow_grpo"] == pytest.approx(1 / 3)  # [0], [1, 0]: no target


@pytest.mark.parametrize("meta, words", [
    (None, "has no GenEval metadata"),
    ({"tag": "counting"}, "has no GenEval metadata"),
    ({"include": [{"class": "dog", "count": 1}]}, "'tag'"),
    ({"tag": "x", "include": []}, "non-empty list"),
    ({"tag": "x", "include": [{"class": "dragon", "count": 1}]}, "not one of GenEval's 80"),
    ({"tag": "x", "include": [{"class": "dog", "count": 0}]}, "count >= 1"),
    ({"tag": "x", "include": [{"class": "dog", "count": 1, "color": "teal"}]}, "colour 'teal'"),
    ({"tag": "x", "include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]}, "earlier include"),
])
def test_bad_metadata_is_one_line(meta, words):
    with pytest.raises(ValueError) as info:
        rules.check_metadata("a photo of a dog", meta)
    assert words in str(info.value) and "\n" not in str(info.value) and "a photo of a dog" in str(info.value)


# ------------------------------------------------------------------------------------- tiny models, end to end

DOG = rules.CLASSES.index("dog")
COCO_SPELLING = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}


def tiny_detector(seed: int = 0):
    """A random Mask2Former (tiny Swin backbone) with COCO's 80 labels, its classifier biased toward "dog" so
    that some detections pass GenEval's thresholds and the colour step runs."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                      window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    labels = {i: COCO_SPELLING.get(name, name) for i, name in enumerate(rules.CLASSES)}  # COCO's own spellings
    config = Mask2FormerConfig(backbone_config=swin, hidden_dim=32, mask_feature_size=32, feature_size=32,
                               num_queries=10, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                               dim_feedforward=64, encoder_feedforward_dim=64, num_labels=80, id2label=labels,
                               label2id={v: k for k, v in labels.items()})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Mask2FormerForUniversalSegmentation(config).eval()
    with torch.no_grad():
        model.class_predictor.bias[DOG] += 8.0
    return model


def tiny_geneval(**kwargs):
    """The geneval reward on a tiny random detector and CLIP (also the eval test's reward, by dotted path)."""
    from transformers import Mask2FormerImageProcessor

    from flowrl.models.clip import tiny_open_clip
    from rewards.geneval import GenEval

    clip, tokenizer = tiny_open_clip(seed=0, quick_gelu=True)
    processor = Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}, size_divisor=32)
    return GenEval(device="cpu", model=tiny_detector(), processor=processor, clip_model=clip, clip_tokenizer=tokenizer,
                   **kwargs)


PROMPTS = [
    ("a photo of a dog", {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}),
    ("a photo of a red dog", {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}),
    ("a photo of two dogs", {"tag": "counting", "include": [{"class": "dog", "count": 2}],
                             "exclude": [{"class": "dog", "count": 3}]}),
    ("a photo of a blue dog and a green cat", {"tag": "color_attr", "include": [
        {"class": "dog", "count": 1, "color": "blue"}, {"class": "cat", "count": 1, "color": "green"}]}),
    ("a photo of a cat left of a dog", {"tag": "position", "include": [
        {"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]}),
    ("a photo of two dogs, red", {"tag": "colors", "include": [{"class": "dog", "count": 2, "color": "red"}]}),
]


@pytest.fixture(scope="module")
def judge():
    return tiny_geneval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(len(PROMPTS), 3, 48, 48, generator=g)  # [6, 3, 48, 48]
    images[:, :, 10:30, 5:25] = torch.tensor([0.9, 0.1, 0.1])[:, None, None]  # a red block
    return images, [p for p, _ in PROMPTS], [m for _, m in PROMPTS]


def test_tiny_judge_end_to_end_and_one_image_equals_the_batch(judge, batch, monkeypatch):
    images, prompts, metadata = batch
    calls = []
    original = type(judge.colors).__call__
    monkeypatch.setattr(type(judge.colors), "__call__",
                        lambda self, x, q: calls.append(len(q)) or original(self, x, q))
    out = judge(images, prompts, metadata)
    assert set(out) == {"geneval", *(f"geneval/{k}" for k in rules.SUBSCORES)}
    assert all(v.shape == (len(PROMPTS),) and v.dtype == torch.float32 for v in out.values())
    assert set(out["geneval"].tolist()) <= {0.0, 1.0}
    assert len(calls) == 1 and calls[0] > 0  # every colour query of the call in one CLIP batch
    strict = out["geneval"] == 1
    assert torch.equal(strict, out["geneval/partial"] == 1)
    assert math.isnan(out["geneval/color"][0]) and not math.isnan(out["geneval/color"][1])
    for i in range(len(PROMPTS)):
        one = judge(images[i:i + 1], prompts[i:i + 1], metadata[i:i + 1])
        for key, value in out.items():
            assert torch.equal(one[key], value[i:i + 1]) or (one[key].isnan().all() and value[i].isnan()), key


def test_tiny_judge_agrees_with_the_rules_on_its_own_detections(judge, batch):
    images, prompts, metadata = batch
    pixels = (images * 255).round() / 255
    dets = judge.detector(pixels)
    assert all(d.masks.shape[-2:] == (48, 48) for d in dets)
    assert any(label == "dog" and score > 0.3 for d in dets for label, score in zip(d.labels, d.scores.tolist()))
    kept = [rules.select_objects(d, m["tag"]) for d, m in zip(dets, metadata)]
    for i, (det, objects) in enumerate(zip(dets, kept)):
        wanted = rules.color_queries(metadata[i], objects)
        colors = judge.colors(pixels, [(i, det.boxes[k], det.masks[k], det.labels[k]) for k in wanted])
        for k, c in zip(wanted, colors):
            det.colors[k] = c
    expected = torch.tensor([judge.score_detections(m, d)["strict"] for m, d in zip(metadata, dets)])
    assert torch.equal(judge(images, prompts, metadata)["geneval"], expected)


def test_nan_images_score_nan_and_the_rest_are_unchanged(judge, batch):
    images, prompts, metadata = batch
    broken = images[:2].clone()
    broken[0, 0, 0, 0] = float("nan")
    out = judge(broken, prompts[:2], metadata[:2])
    assert all(math.isnan(v[0]) for v in out.values())
    assert out["geneval"][1] == judge(images[1:2], prompts[1:2], metadata[1:2])["geneval"][0]


def test_a_prompt_without_metadata_is_one_line(judge, batch):
    images, prompts, metadata = batch
    with pytest.raises(ValueError, match=r"^geneval: prompt 'a photo of a red dog' has no GenEval metadata"):
        judge(images[:2], prompts[:2], [metadata[0], {}])


def test_missing_weights_offline_name_the_hub_ids(monkeypatch, tmp_path):
    from rewards.geneval import GenEval
    from rewards.geneval.models import CLIP_HUB_ID, DETECTOR_ID

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as info:  # a local folder that is not there
        GenEval(detector=str(tmp_path / "nowhere"), clip_model=tiny_geneval().colors.backbone.model,
                device="cpu")
    message = str(info.value)
    assert "\n" not in message and DETECTOR_ID in message and "kwargs.detector=" in message
    with pytest.raises(FileNotFoundError) as info:  # open_clip's tag with no file to be had
        GenEval(clip_pretrained=str(tmp_path / "clip.bin"), model=tiny_detector(), device="cpu")
    message = str(info.value)
    assert "\n" not in message and CLIP_HUB_ID in message and "kwargs.clip_pretrained=" in message


def test_without_scipy_the_reward_names_the_extra(monkeypatch, tmp_path):
    import sys

    from flowrl.rewards_api import build_reward

    weights = tmp_path / "clip.bin"
    weights.write_bytes(b"")  # a file is enough: the detector is checked before the CLIP is built
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if uninstalled
    with pytest.raises(ValueError) as info:
        build_reward("geneval", clip_pretrained=str(weights), device="cpu")
    assert str(info.value) == "reward 'geneval': scipy is not installed: pip install 'flowrl[rewards]'"
