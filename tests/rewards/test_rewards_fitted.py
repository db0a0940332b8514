"""The fitted artifact reward (rewards/fitted.py): its head against a plain logistic regression written here,
its file's one-line errors, and the reward beside another one in a toy config."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowrl.config import Config, load_config
from flowrl.rewards_api import build_reward, build_rewards, score
from rewards.fitted import FittedReward, fit_head, standardise
from tests import REPO
from tools.toy_artifacts import make_toy_artifacts


def irls(x: np.ndarray, y: np.ndarray, l2: float, iterations: int = 50) -> np.ndarray:
    """Textbook IRLS for ``mean log-loss + l2/2 |w|^2`` (bias last, unpenalised): each step solves the weighted
    least squares ``(A'WA + n*Lambda) theta = A'W z`` on the working response ``z = A theta + (y - p) / w``."""
    a = np.hstack([x, np.ones((len(x), 1))])
    penalty = np.diag([l2] * x.shape[1] + [0.0]) * len(x)
    theta = np.zeros(a.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-a @ theta))
        w = p * (1.0 - p)
        z = a @ theta + (y - p) / w
        theta = np.linalg.solve(a.T @ (w[:, None] * a) + penalty, a.T @ (w * z))
    return theta


def test_fit_head_matches_a_plain_irls_logistic_regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2))  # two features; the label follows a line, with 4 labels flipped (noise)
    y = (x @ np.array([1.5, -1.0]) + 0.3 > 0).astype(float)
    y[[3, 11, 22, 35]] = 1 - y[[3, 11, 22, 35]]
    expected = irls(x, y, l2=1e-2)
    weight, bias = fit_head(torch.from_numpy(x), torch.from_numpy(y), l2=1e-2)
    # both solve one strictly convex problem to convergence in float64: they agree to rounding, 1e-8 with room
    np.testing.assert_allclose(np.append(weight.numpy(), bias.item()), expected, atol=1e-8)
    assert expected[0] > 0 > expected[1]  # the fit found the generating direction, not just a fixed point


def test_fit_head_by_hand_on_two_points():
    # x = -1 (artifact) and x = +1 (clean), l2 = 0.5. The loss is (softplus(b - w) + softplus(-w - b)) / 2 + w²/4;
    # d/db = 0 gives b = 0 by symmetry, and d/dw = -sigmoid(-w) + 0.5 w = 0 gives w = 2 / (1 + e^w). Bisecting
    # g(w) = w - 2 / (1 + e^w) by hand: g(0.6748) = 0.6748 - 2 / 2.96364 = -0.000046 < 0 and
    # g(0.6749) = 0.6749 - 2 / 2.96384 = +0.000099 > 0, so w* lies in (0.6748, 0.6749).
    weight, bias = fit_head(torch.tensor([[-1.0], [1.0]]), torch.tensor([0.0, 1.0]), l2=0.5)
    w = weight.item()
    assert abs(bias.item()) < 1e-12
    assert abs(w - 2.0 / (1.0 + np.exp(w))) < 1e-12
    assert 0.6748 < w < 0.6749


def test_fit_head_is_finite_on_separable_data_and_needs_a_penalty():
    x = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]])
    weight, bias = fit_head(x, torch.tensor([0.0, 0.0, 1.0, 1.0]), l2=1e-3)
    assert torch.isfinite(weight).all() and weight.item() > 0 and abs(bias.item()) < 1e-9
    with pytest.raises(ValueError, match="l2 must be > 0"):
        fit_head(x, torch.tensor([0.0, 0.0, 1.0, 1.0]), l2=0.0)


def test_standardise_leaves_a_constant_feature_at_zero():
    features = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    mean, std = standardise(features)
    torch.testing.assert_close(mean, torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(std, torch.tensor([1.0, 1.0]))  # [1, 0] with the 0 replaced by 1


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    """A reward fitted on 24 clean and 24 artifact toy renders."""
    root = tmp_path_factory.mktemp("fitted")
    make_toy_artifacts(root, 24, seed=0)
    FittedReward.fit(root / "clean", root / "artifact", root / "fitted.safetensors", features="toy", device="cpu")
    return root / "fitted.safetensors"


def test_the_file_holds_the_head_and_says_what_it_was_fitted_on(reward_file):
    with safe_open(str(reward_file), framework="pt") as handle:
        meta = handle.metadata()
        shapes = {k: tuple(handle.get_tensor(k).shape) for k in handle.keys()}
    assert shapes == {"weight": (64,), "bias": (1,), "mean": (64,), "std": (64,)}  # ToyFeatures: 64 features
    assert meta["features"] == "toy" and json.loads(meta["feature_kwargs"]) == {}
    assert json.loads(meta["classes"]) == ["clean", "artifact"]
    counts = json.loads(meta["counts"])
    # 20% of 24 is 4.8, held out as 5 per class: 19 + 19 fit, 5 + 5 held out
    assert counts == {"fit": {"clean": 19, "artifact": 19}, "held_out": {"clean": 5, "artifact": 5}}
    assert float(meta["held_out_accuracy"]) == int(meta["held_out_correct"]) / int(meta["held_out_total"])


def test_the_reward_scores_a_batch_in_unit_range_and_nan_for_a_broken_image(reward_file):
    reward = build_reward("fitted", path=str(reward_file), device="cpu")
    images = torch.rand(3, 3, 32, 32)
    images[1, 0, 0, 0] = float("nan")
    out = reward(images, ["a", "b", "c"], [{}, {}, {}])
    assert set(out) == {"fitted"} and out["fitted"].shape == (3,)
    assert torch.isnan(out["fitted"][1]) and ((out["fitted"][[0, 2]] >= 0) & (out["fitted"][[0, 2]] <= 1)).all()


def test_bad_reward_files_are_one_line_each(reward_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*flowrl fit-reward"):
        FittedReward(str(tmp_path / "none.safetensors"))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(reward_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated or corrupt.*flowrl fit-reward"):
        FittedReward(str(truncated))
    with safe_open(str(reward_file), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = handle.metadata()
    save_file(tensors, str(tmp_path / "unknown.safetensors"), metadata={**meta, "features": "resnet"})
    with pytest.raises(ValueError, match="'resnet', which flowrl.features does not know"):
        FittedReward(str(tmp_path / "unknown.safetensors"))
    save_file({"direction": torch.zeros(3)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a fitted reward file"):
        FittedReward(str(tmp_path / "other.safetensors"))
    # through the seam, the message keeps its one line and names the reward
    with pytest.raises(ValueError, match=r"^reward 'fitted': .*not a fitted reward file") as error:
        build_reward("fitted", path=str(tmp_path / "other.safetensors"))
    assert "\n" not in str(error.value)


def test_the_reward_composes_with_the_proxy_in_a_toy_config(reward_file):
    rewards = f"rewards=[{{name: toy_proxy}}, {{name: fitted, kwargs: {{path: {reward_file}}}, weight: 0.5}}]"
    cfg = load_config(Config, REPO / "configs/toy/grpo_proxy.yaml", [rewards])
    assert [(r.name, r.weight) for r in cfg.rewards] == [("toy_proxy", 1.0), ("fitted", 0.5)]
    rewards, weights = build_rewards(cfg.rewards, torch.device("cpu"))  # the run's own builder: nothing trains
    assert weights == {"toy_proxy": 1.0, "fitted": 0.5}
    out = score(rewards, torch.rand(2, 3, 32, 32), ["a red circle", "a red circle"], [{}, {}])
    assert out["fitted"].shape == out["toy_proxy"].shape == (2,)


def test_the_shipped_artifact_config_regularises_the_proxy():
    path = REPO / "configs/toy/grpo_proxy_artifact.yaml"
    cfg = load_config(Config, path)
    assert [(r.name, r.weight) for r in cfg.rewards] == [("toy_proxy", 1.0), ("fitted", 0.5), ("toyeval", 0.0)]
    reward_path = cfg.rewards[1].kwargs["path"]
    assert f"--out {reward_path}" in path.read_text()  # the header's fit-reward command writes the file it loads
