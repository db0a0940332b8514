"""ParetoSlider in the recipes: the preference draw (the reference's mixture, per (group, subgroup) seed) and the
advantage (each reward's z-score within its (prompt, preference) subgroup, weighted by w), against numbers written
out from the reference's formulas; both recipes train the preference embedding with the LoRA, export it beside the
LoRA, and a resumed run is the uninterrupted one bit for bit; and the config's one-line refusals."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.preference import PREFERENCE_STREAM, draw_preferences, row_weights, subgroup_ids
from flowrl.config import Config, ConfigError, load_config
from flowrl.models.preference import PREFERENCE_WEIGHT_NAME
from flowrl.recipes import grpo, nft

SMOKE = "configs/smoke/sd3_tiny.yaml"
REWARDS = "rewards=[{name: brightness}, {name: color_target, kwargs: {target: [0, 0, 0]}}]"  # bright against black
SLIDER = ["model.preference.rewards=[brightness, color_target]", "model.preference.hidden=8",
          "model.preference.per_prompt=2", "train.combine=preference"]  # the smoke group of 4: 2 subgroups of 2


def slider_config(tmp_path, *overrides):
    base = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
            "train.learning_rate=1e-2", REWARDS, *SLIDER]
    return load_config(Config, SMOKE, base + list(overrides))


def test_each_subgroup_draws_the_reference_mixture_from_its_own_seed():
    # Two rewards: u < 0.1 -> a one-hot corner at integers(0, 2), else Dirichlet(1, 1) (two Exp(1) draws over
    # their sum, in numpy's order); the generator is seeded by (seed, stream, group, subgroup).
    w = draw_preferences(7, torch.tensor([3, 5, 3, 3]), 2, torch.tensor([0, 0, 0, 1]))
    for row, group, sub in zip(w, (3, 5, 3, 3), (0, 0, 0, 1)):
        rng = np.random.default_rng([7, PREFERENCE_STREAM, group, sub])
        if rng.random() < 0.1:
            expected = np.eye(2)[rng.integers(0, 2)]
        else:
            gammas = rng.standard_gamma(1.0, 2)
            expected = gammas / gammas.sum()
        assert row.tolist() == pytest.approx(expected.tolist(), abs=1e-7)
    assert torch.equal(w[0], w[2])  # one w per (group, subgroup), whoever asks
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], w[3])
    assert torch.allclose(w.sum(1), torch.ones(4)) and (w >= 0).all()


def test_the_draws_follow_the_reference_mixture_frequencies():
    # Over 8000 (group, subgroup) draws each frequency is within 0.02 of the reference's (4 standard errors or more).
    groups, subs = torch.arange(4000).repeat_interleave(2), torch.tensor([0, 1]).repeat(4000)
    two = draw_preferences(0, groups, 2, subs).double()
    corner = (two == 1).any(1)
    assert corner.double().mean().item() == pytest.approx(0.10, abs=0.02)
    interior = two[~corner, 0]  # Dirichlet(1, 1): w_1 uniform on [0, 1]
    assert interior.mean().item() == pytest.approx(0.5, abs=0.02)
    assert interior.var().item() == pytest.approx(1 / 12, abs=0.01)
    three = draw_preferences(0, groups, 3, subs)
    nonzero = (three > 0).sum(1)
    for count, share in ((1, 0.50), (2, 0.35), (3, 0.15)):  # vertex, edge, interior
        assert (nonzero == count).double().mean().item() == pytest.approx(share, abs=0.02)
    assert torch.allclose(three.sum(1), torch.ones(len(three)))


def test_the_advantage_is_w_times_each_rewards_subgroup_z_score():
    # One prompt group, two subgroups of two rows, w = (0.25, 0.75) then (1, 0); a logged reward (weight 0).
    # Subgroup 0: a = (1, 3): mean 2, std 1; b = (0.1, 0.3): mean 0.2, std 0.1. Subgroup 1: a = (2, 2): std 0,
    # z = 0; b = (5, 1): mean 3, std 2. z = (r - mean) / (std + 1e-4).
    rewards = {"a": torch.tensor([1.0, 3.0, 2.0, 2.0]), "b": torch.tensor([0.1, 0.3, 5.0, 1.0]),
               "logged": torch.tensor([9.0, 9.0, 9.0, 9.0])}
    ids = subgroup_ids(torch.tensor([4, 4, 4, 4]), torch.tensor([0, 0, 1, 1]), 2)
    assert ids.tolist() == [8, 8, 9, 9]
    w = torch.tensor([[0.25, 0.75], [0.25, 0.75], [1.0, 0.0], [1.0, 0.0]])
    weights = row_weights(w, ["a", "b"], {"a": 1.0, "b": 1.0, "logged": 0.0})
    advantages, combined = COMBINERS["preference"](rewards, weights, ids, None)
    za, zb = 1 / (1 + 1e-4), 0.1 / (0.1 + 1e-4)
    expected = [-0.25 * za - 0.75 * zb, 0.25 * za + 0.75 * zb, 0.0, 0.0]  # subgroup 1 weighs a only, a flat there
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert combined.tolist() == pytest.approx([0.325, 0.975, 2.0, 2.0])  # w . r, what the run logs
    nan = {**rewards, "b": torch.tensor([0.1, float("nan"), 5.0, 1.0])}
    advantages, _ = COMBINERS["preference"](nan, weights, ids, None)
    assert advantages[:2].tolist() == [0.0, 0.0]  # a lone finite row: no spread; the NaN row: 0


def test_w_acts_on_normalised_rewards_not_on_raw_units():
    # Reward spreads 10 and 0.1 at w = (0.5, 0.5): weighting raw rewards would follow the wide one alone (correlation
    # 1.00 with it); weighting subgroup z-scores of two independent rewards gives each 1/sqrt(2).
    g = torch.Generator().manual_seed(0)
    n = 8 * 400
    rewards = {"a": 10 * torch.randn(n, generator=g), "b": 0.1 * torch.randn(n, generator=g)}
    ids = torch.arange(n) // 8
    weights = row_weights(torch.full((n, 2), 0.5), ["a", "b"], {"a": 1.0, "b": 1.0})
    advantages, _ = COMBINERS["preference"](rewards, weights, ids, None)
    corr = [np.corrcoef(advantages.numpy(), rewards[k].numpy())[0, 1] for k in ("a", "b")]
    assert corr[0] == pytest.approx(corr[1], abs=0.06)
    assert min(corr) > 0.6


def test_a_rollout_batch_carries_one_w_per_subgroup(tmp_path):
    from types import SimpleNamespace

    from flowrl.data.prompts import PromptSet
    from flowrl.models import build_policy
    from flowrl.recipes.rollouts import preference_cond

    cfg = slider_config(tmp_path, "model.preference.per_prompt=2")
    run = SimpleNamespace(cfg=cfg, policy=build_policy("sd3", "tiny", seed=0))
    cond = preference_cond(run, PromptSet(["p", "q"], [{}, {}]), torch.tensor([10, 11]))
    expected = draw_preferences(cfg.seed, torch.tensor([10, 10, 11, 11]), 2, torch.tensor([0, 1, 0, 1]))
    assert torch.equal(cond.preference.cpu(), expected)  # entries (p, 0), (p, 1), (q, 0), (q, 1)
    assert cond.prompt_embeds.shape[0] == 4


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


def test_preferences_per_prompt_must_split_the_group(tmp_path):
    with pytest.raises(ConfigError, match="model.preference.per_prompt") as error:
        slider_config(tmp_path, "model.preference.per_prompt=3")  # 3 does not divide the smoke group of 4
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="model.preference.per_prompt"):
        slider_config(tmp_path, "model.preference.per_prompt=4")  # subgroups of one row: no spread to normalise
    assert slider_config(tmp_path, "model.preference.per_prompt=1").model.preference.per_prompt == 1


def test_dense_ode_credit_is_refused_with_a_slider(tmp_path):
    with pytest.raises(ConfigError, match="train.credit"):
        slider_config(tmp_path, "train.credit=dense_ode")
