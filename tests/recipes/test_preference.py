"""ParetoSlider in the recipes: each prompt group's w drawn from Dirichlet(1) and its reward w . r, by hand
numbers; both recipes train the preference embedding with the LoRA, export it beside the LoRA, and a resumed run
is the uninterrupted one bit for bit; and the config's one-line refusals."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.preference import PREFERENCE_STREAM, draw_preferences, row_weights
from flowrl.config import Config, ConfigError, load_config
from flowrl.models.preference import PREFERENCE_WEIGHT_NAME
from flowrl.recipes import grpo, nft

SMOKE = "configs/smoke/sd3_tiny.yaml"
REWARDS = "rewards=[{name: brightness}, {name: color_target, kwargs: {target: [0, 0, 0]}}]"  # bright against black
SLIDER = ["model.preference.rewards=[brightness, color_target]", "model.preference.hidden=8", "train.combine=preference"]


def slider_config(tmp_path, *overrides):
    base = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
            "train.learning_rate=1e-2", REWARDS, *SLIDER]
    return load_config(Config, SMOKE, base + list(overrides))


def test_each_group_draws_dirichlet_one_from_its_own_seed():
    # Dirichlet(1, 1, 1) is three Exp(1) = Gamma(1) draws over their sum; numpy draws them in that order.
    w = draw_preferences(7, torch.tensor([3, 5, 3]), 3)
    for row, group in zip(w, (3, 5, 3)):
        gammas = np.random.default_rng([7, PREFERENCE_STREAM, group]).standard_gamma(1.0, 3)
        assert row.tolist() == pytest.approx((gammas / gammas.sum()).tolist(), abs=1e-7)
    assert torch.equal(w[0], w[2])  # one w per group, whoever asks
    assert not torch.equal(w[0], w[1])
    assert torch.allclose(w.sum(1), torch.ones(3)) and (w >= 0).all()


def test_the_group_reward_is_w_dot_r():
    # Group 0 has w = (0.25, 0.75), group 1 w = (1, 0); a third reward keeps its fixed weight 0 (logged only).
    rewards = {"a": torch.tensor([1.0, 0.0, 0.5, 0.5]), "b": torch.tensor([0.0, 1.0, 1.0, 0.0]),
               "logged": torch.tensor([9.0, 9.0, 9.0, 9.0])}
    groups = torch.tensor([0, 0, 1, 1])
    w = torch.tensor([[0.25, 0.75], [0.25, 0.75], [1.0, 0.0], [1.0, 0.0]])
    weights = row_weights(w, ["a", "b"], {"a": 1.0, "b": 1.0, "logged": 0.0})
    advantages, combined = COMBINERS["preference"](rewards, weights, groups, lambda r, g: r - 1)
    # 0.25*1 + 0.75*0 = 0.25; 0.25*0 + 0.75*1 = 0.75; 1*0.5 + 0*1 = 0.5; 1*0.5 + 0*0 = 0.5
    assert combined.tolist() == pytest.approx([0.25, 0.75, 0.5, 0.5])
    assert advantages.tolist() == pytest.approx([-0.75, -0.25, -0.5, -0.5])
    _, fixed = COMBINERS["preference"](rewards, {"a": 1.0, "b": 1.0}, groups, lambda r, g: r)  # floats: weighted
    assert fixed.tolist() == pytest.approx([1.0, 1.0, 1.5, 0.5])


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_a_slider_run_trains_the_embedding_exports_it_and_resumes_exactly(recipe, tmp_path):
    train = {"grpo": grpo.train, "nft": nft.train}[recipe]
    extra = [f"recipe={recipe}", "train.epochs=3", *(["train.clip_range=0.2"] if recipe == "grpo" else [])]
    full = train(slider_config(tmp_path / "full", *extra))
    assert "reward/brightness_mean" in full and "reward/color_target_mean" in full  # per-reward means
    exported = load_file(tmp_path / "full" / "lora" / PREFERENCE_WEIGHT_NAME)
    assert exported["preference.out.weight"].abs().sum() > 0  # trained from its zero start
    assert not any("preference" in k for k in load_file(tmp_path / "full" / "lora" / "pytorch_lora_weights.safetensors"))
    train(slider_config(tmp_path / "resumed", *extra[:1], *extra[2:], "train.epochs=2", "train.checkpoint_every=1"))
    resumed = train(slider_config(tmp_path / "resumed", *extra, "train.resume=latest"))
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert strip(resumed) == strip(full)
    again = load_file(tmp_path / "resumed" / "lora" / PREFERENCE_WEIGHT_NAME)
    assert all(torch.equal(exported[k], again[k]) for k in exported)
    latest = tmp_path / "resumed" / "checkpoints"
    step = sorted(p for p in latest.iterdir() if p.name.startswith("step_"))[-1]
    assert any(k.startswith("flowrl_preference.") for k in load_file(step / "lora.safetensors"))
    assert any(k.startswith("flowrl_preference.") for k in load_file(step / "ema.safetensors"))


def test_slider_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.combine"):
        slider_config(tmp_path, "train.combine=weighted")
    with pytest.raises(ConfigError, match="model.preference.rewards"):
        slider_config(tmp_path, "model.preference.rewards=[brightness, aesthetic]")
    with pytest.raises(ConfigError, match="model.preference.rewards"):
        slider_config(tmp_path, "model.preference.rewards=[brightness]")
    with pytest.raises(ConfigError, match="train.combine"):
        load_config(Config, SMOKE, ["train.combine=preference"])


def test_dense_ode_credit_is_refused_with_a_slider(tmp_path):
    with pytest.raises(ConfigError, match="train.credit"):
        slider_config(tmp_path, "train.credit=dense_ode")
