"""D²-Align: ToyClip's embeddings by hand, the direction fit against a dummy-variable regression, the
correction's arithmetic and errors, and the fit finding ToyClip's built-in background bias."""

import json

import numpy as np
import pytest
import torch

from flowrl.rewards_api import build_reward
from flowrl.toy.world import Obj, Scene, render, to_tensor
from rewards.directional import DirectionalCorrection, fit_direction, load_direction, save_direction
from rewards.toy_clip import SLOTS, ToyClip
from tests import REPO
from tools import d2align_fit


def scene_image(background: str, objects: list[tuple[str, str]]) -> torch.Tensor:
    placed = tuple(Obj(shape, color, cx, 0.5, 0.26) for (color, shape), cx in zip(objects, (0.3, 0.7)))
    return to_tensor([render(Scene(background, "medium", placed), 64)])


def test_toy_clip_embeddings_and_score_by_hand():
    reward = ToyClip(bias=1.0)
    image = torch.cat([scene_image("black", [("red", "circle")]), scene_image("white", [("red", "circle")])])
    embedding = reward.embed_images(image)
    # Slots red, circle and the background are 1, then the row is normalised: 1/sqrt(3) each.
    for row, bg in enumerate(("black", "white")):
        expected = torch.zeros(len(SLOTS))
        expected[[SLOTS.index("red"), SLOTS.index("circle"), SLOTS.index(f"bg:{bg}")]] = 3 ** -0.5
        torch.testing.assert_close(embedding[row], expected)
    meta = {"objects": [{"color": "red", "shape": "circle", "count": 1}]}
    out = reward(image, ["a red circle"] * 2, [meta] * 2)
    # Text: red, circle, bg:black (bias 1) -> 1/sqrt(3) each; cos with black image 1, with white 2/3.
    torch.testing.assert_close(out["toy_clip"], torch.tensor([1.0, 2 / 3]))
    assert out["toy_clip/background"].tolist() == [1.0, 0.0]
    assert torch.isnan(reward(image[:1], ["x"], [{}])["toy_clip"]).all()  # no toy metadata: cannot score


def test_fit_direction_equals_a_regression_with_one_dummy_per_group():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(24, 3))
    groups = np.repeat(np.arange(4), 6)
    r = e @ np.array([0.5, -1.0, 2.0]) + np.array([3.0, -2.0, 0.0, 1.0])[groups] + 0.1 * rng.normal(size=24)
    ridge = 1e-2
    # Reference: least squares on [e | group dummies], the ridge on the e coefficients only (augmented rows).
    dummies = np.eye(4)[groups]
    design = np.vstack([np.hstack([e, dummies]), np.hstack([np.sqrt(ridge * 24) * np.eye(3), np.zeros((3, 4))])])
    target = np.concatenate([r, np.zeros(3)])
    reference = np.linalg.lstsq(design, target, rcond=None)[0][:3]
    fitted = fit_direction(torch.tensor(e, dtype=torch.float32), torch.tensor(r, dtype=torch.float32),
                           torch.tensor(groups), ridge=ridge)
    np.testing.assert_allclose(fitted.numpy(), reference, atol=1e-4)
    r[0] = np.nan  # a NaN row is left out, not propagated
    assert torch.isfinite(fit_direction(torch.tensor(e), torch.tensor(r), torch.tensor(groups))).all()


def test_correction_subtracts_the_shared_part_and_checks_its_inputs(tmp_path):
    direction = torch.zeros(len(SLOTS))
    direction[SLOTS.index("bg:black")] = 0.6
    path = tmp_path / "d.safetensors"
    save_direction(path, direction, reward="toy_clip", metadata={"prompts": 1})
    assert load_direction(path)[1]["reward"] == "toy_clip"
    corrected = build_reward("d2align", reward="toy_clip", direction=str(path), strength=0.5)
    image = torch.cat([scene_image("black", [("red", "circle")]), scene_image("white", [("red", "circle")])])
    meta = {"objects": [{"color": "red", "shape": "circle", "count": 1}]}
    out = corrected(image, ["a red circle"] * 2, [meta] * 2)
    shared = torch.tensor([0.6 * 3 ** -0.5, 0.0])
    torch.testing.assert_close(out["toy_clip_d2/shared"], shared)
    torch.testing.assert_close(out["toy_clip_d2"], torch.tensor([1.0, 2 / 3]) - 0.5 * shared)
    torch.testing.assert_close(out["toy_clip_d2/raw"], torch.tensor([1.0, 2 / 3]))
    with pytest.raises(ValueError, match="has no image embedding"):
        DirectionalCorrection("toyeval", str(path))
    other = tmp_path / "other.safetensors"
    save_direction(other, direction, reward="clipscore", metadata={})
    with pytest.raises(ValueError, match="fitted for reward 'clipscore', not 'toy_clip'"):
        DirectionalCorrection("toy_clip", str(other))
    with pytest.raises(FileNotFoundError, match="tools.d2align_fit"):
        DirectionalCorrection("toy_clip", str(tmp_path / "missing.safetensors"))


def background_contrast(direction: torch.Tensor) -> float:
    """The fitted weight of a black background over the mean of the other five."""
    backgrounds = {s: float(direction[i]) for i, s in enumerate(SLOTS) if s.startswith("bg:")}
    black = backgrounds.pop("bg:black")
    return black - sum(backgrounds.values()) / len(backgrounds)


def fit_toy_clip(tmp_path, bias: float) -> tuple[torch.Tensor, dict]:
    """tools.d2align_fit's direction for ToyClip with ``bias`` on 16 prompts x 4 images of the toy base, run in this
    process (the command's own argument parsing; a launch would add seconds of imports)."""
    out = tmp_path / f"toy_clip_{bias}.safetensors"
    d2align_fit.main(["configs/toy/grpo_clip.yaml", "--reward", "toy_clip", "--reward-kwargs",
                      json.dumps({"bias": bias}), "--prompts", "16", "--images", "4", "--out", str(out)])
    return load_direction(out)


@pytest.mark.slow  # two fits, each sampling 64 images of the toy base
def test_the_fit_finds_toy_clips_background_bias_and_only_it(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's relative paths, as the command run from the repository root
    biased, meta = fit_toy_clip(tmp_path, 1.0)
    unbiased, _ = fit_toy_clip(tmp_path, 0.0)
    # The same base images, scored with and without the bias: the black background's fitted weight rises by
    # what the bias adds (measured +0.44 on the third edition's base: 0.23 against -0.21), and no other slot
    # moves as much. Without the bias the base's own images make black a little worse than the others.
    rise = background_contrast(biased) - background_contrast(unbiased)
    assert 0.3 < rise < 0.8, rise
    others = (biased - unbiased).abs()
    black = SLOTS.index("bg:black")
    assert others[black] == others.max(), others
    assert json.loads(meta["prompts"]) == 16
