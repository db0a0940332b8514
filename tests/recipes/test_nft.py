"""DiffusionNFT: the loss against a hand computation, the recipe end to end on the tiny models,
its reproducibility and resume, and the config errors it adds."""

import math

import pytest
import torch

from flowrl.algorithms.losses import nft_loss
from flowrl.algorithms.timesteps import schedule_timesteps
from flowrl.config import Config, ConfigError, load_config
from flowrl.recipes.nft import train
from flowrl.training.ema import LoraEMA
from flowrl.training.metrics import read_metrics
from tools.policy_capture import capture_training_policy

SMOKE = "configs/smoke/sd3_tiny.yaml"


def nft_config(tmp_path, *overrides, path=SMOKE):
    base = [f"run_dir={tmp_path}", "recipe=nft", "train.epochs=2", "log.progress=false", "log.eval_every=1",
            "log.eval_images_per_prompt=2", "train.optimizer_steps_per_epoch=2", "train.learning_rate=1e-3"]
    return load_config(Config, path, base + list(overrides))


def test_nft_loss_matches_a_hand_computation():
    # One sample, two values: v = (1, 2), v_old = (0, 1), target = (1, 0), s = 0.5, r = 0.75.
    # v+ = 0.5 v + 0.5 v_old = (0.5, 1.5)  -> (v+ - target)^2 = (0.25, 2.25), mean 1.25
    # v- = 1.5 v_old - 0.5 v = (-0.5, 0.5) -> (v- - target)^2 = (2.25, 0.25), mean 1.25
    # loss = 0.75 * 1.25 + 0.25 * 1.25 = 1.25; second sample r = 0 with v = v_old = target: loss 0.
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    v_old = torch.tensor([[0.0, 1.0], [3.0, 4.0]])
    target = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    loss = nft_loss(v, v_old, target, torch.tensor([0.75, 0.0]), strength=0.5)
    assert loss.tolist() == pytest.approx([1.25, 0.0])


def test_nft_adaptive_weighting_matches_a_hand_computation():
    # v = (2, 2), v_old = (0, 1), target = (1, 0), s = 0.5, r = 0.75, sigma = 0.5.
    # e+ = v+ - target = (1, 1.5) - (1, 0) = (0, 1.5):  mean e^2 = 1.125, mean |e| = 0.75 -> sigma * 1.5
    # e- = v- - target = (-1, 0.5) - (1, 0) = (-2, 0.5): mean e^2 = 2.125, mean |e| = 1.25 -> sigma * 1.7
    # loss = 0.75 * 0.75 + 0.25 * 0.85 = 0.775
    loss = nft_loss(torch.tensor([[2.0, 2.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]),
                    torch.tensor([0.75]), strength=0.5, sigma=torch.tensor([0.5]))
    assert loss.tolist() == pytest.approx([0.775])


def test_nft_gradient_is_advantage_signed_flow_matching_at_the_old_policy():
    # At v = v_old the gradient is 2 s (2r - 1) (v_old - target) / D: positive samples pull v toward
    # the target, negative ones push it away, r = 1/2 gives no push.
    v_old = torch.tensor([[0.5, -1.0, 2.0]])
    target = torch.tensor([[1.0, 1.0, 1.0]])
    for r, strength in ((1.0, 1.0), (0.0, 1.0), (0.5, 0.3), (0.9, 0.3)):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, target, torch.tensor([r]), strength=strength).sum().backward()
        expected = 2 * strength * (2 * r - 1) * (v_old - target) / 3
        assert torch.allclose(v.grad, expected, atol=1e-7), (r, strength)
        # Adaptive weighting rescales it by sigma / mean|v_old - target| (here 0.4 / (3.5 / 3)).
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, target, torch.tensor([r]), strength=strength, sigma=torch.tensor([0.4])).sum().backward()
        assert torch.allclose(v.grad, expected * 0.4 / (3.5 / 3), atol=1e-7), (r, strength)


@pytest.mark.parametrize("path", [SMOKE, "configs/smoke/flux_tiny.yaml"])
def test_nft_smoke_run_trains_the_lora_and_writes_the_run(tmp_path, monkeypatch, path):
    captured = capture_training_policy(monkeypatch)
    metrics = train(nft_config(tmp_path, "train.beta=0.1", path=path))
    assert math.isfinite(metrics["loss/total"]) and metrics["loss/kl"] >= 0
    assert 0 < metrics["nft/optimality_abs_dev"] <= 0.5
    (lora_before, base_before), after = captured["before"], dict(captured["policy"].transformer.named_parameters())
    assert any(not torch.equal(lora_before[n], after[n]) for n in lora_before)
    assert all(torch.equal(base_before[n], after[n]) for n in base_before)
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [0, 1]
    for name in ("config.yaml", "lora/pytorch_lora_weights.safetensors", "grids/epoch_00001.png", "report.md"):
        assert (tmp_path / name).is_file(), name


def test_nft_runs_are_reproducible_and_resume_exactly(tmp_path):
    # The old policy's decay ramp depends on the step count that a resume must restore.
    common = ["log.eval_every=0", "log.report_prompts=0", "nft.timesteps_per_sample=2", "nft.old_decay=[0,0,0.3,0.5]"]
    full = train(nft_config(tmp_path / "full", *common, "train.epochs=3"))
    again = train(nft_config(tmp_path / "again", *common, "train.epochs=3"))
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert strip(full) == strip(again)
    train(nft_config(tmp_path / "resumed", *common, "train.epochs=2", "train.checkpoint_every=1"))
    resumed = train(nft_config(tmp_path / "resumed", *common, "train.epochs=3", "train.resume=latest"))
    assert strip(resumed) == strip(full)


def test_nft_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="nft.sampler_decay"):  # only CRD keeps a sampler apart from the old adapter
        nft_config(tmp_path, "nft.sampler_decay=2")
    with pytest.raises(ConfigError, match="nft.strength"):
        nft_config(tmp_path, "nft.strength=0")
    with pytest.raises(ConfigError, match="nft"):
        nft_config(tmp_path, "nft.unknown_key=1")
    with pytest.raises(ConfigError, match="nft.timesteps_per_sample"):  # the smoke schedule has 4 sigmas
        nft_config(tmp_path, "sampling.num_steps=4", "nft.timesteps_per_sample=5")
    with pytest.raises(ConfigError, match="nft.old_decay"):
        nft_config(tmp_path, "nft.old_decay=[0,0,0.001,1.5]")
    with pytest.raises(ConfigError, match="nft.old_decay"):
        nft_config(tmp_path, "nft.old_decay=3")


def test_schedule_timesteps_give_each_sample_its_own_order_of_the_schedule():
    schedule = torch.tensor([1.0, 0.75, 0.5, 0.25])
    table = schedule_timesteps(schedule, 64, seed=[0, 1])  # [64, 4]
    assert table.shape == (64, 4)
    assert all(sorted(row.tolist()) == sorted(schedule.tolist()) for row in table)  # no sigma twice
    assert len({tuple(row.tolist()) for row in table}) > 10  # orders differ between samples
    assert torch.equal(table, schedule_timesteps(schedule, 64, seed=[0, 1]))
    assert not torch.equal(table, schedule_timesteps(schedule, 64, seed=[0, 2]))
    first = table[:, 0]  # the first timestep of each sample covers the schedule evenly (16 each +- noise)
    assert all(4 <= int((first == value).sum()) <= 28 for value in schedule)


def test_old_policy_decay_can_be_set_per_step():
    # diffusers' EMA copies the weights at its first step; later steps average with the decay given:
    # p = 1 -> shadow 1; p = 3, decay 0.25 -> 0.25 * 1 + 0.75 * 3 = 2.5; p = 5, decay 0.5 -> 3.75.
    weight = torch.nn.Parameter(torch.zeros(1))
    ema = LoraEMA([("w.lora_A.default.weight", weight)], decay=0.9)
    for value, decay in ((1.0, 0.25), (3.0, 0.25), (5.0, 0.5)):
        weight.data.fill_(value)
        ema.step(decay)
    assert ema.state_tensors()["w.lora_A.weight"].item() == pytest.approx(3.75)


def test_crd_weights_match_the_reward_matching_loss_gradient_by_hand():
    from flowrl.algorithms.crd import crd_weights
    from flowrl.training.stats import StatsAccumulator

    # Two groups of two rows, one timestep slot; row 3 has no reward.
    ratios = torch.tensor([0.3, 0.1, -0.2, 0.5])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    groups, keep = torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, True, False])
    weights = crd_weights(ratios, advantages, torch.arange(4), groups, keep, num_rows=4, beta=2.0,
                          stats=StatsAccumulator())
    # Group 0: r = (1, 0), centred +-0.5; centred log-ratios +-0.1, residuals e = 2 * 0.1 - 0.5 = -0.3 and +0.3;
    # weights -2 beta e = (1.2, -1.2).
    torch.testing.assert_close(weights, torch.tensor([1.2, -1.2, 0.0, 0.0]))
    # The weight multiplies err(v_theta) = -l + const, so it is -dL/dl: check with autograd on
    # L = sum (beta (l - lbar) - (r - rbar))^2, with advantages off-centre as a clip leaves them.
    off_centre = torch.tensor([1.0, -0.4, 0.5, -0.5])
    weights = crd_weights(ratios, off_centre, torch.arange(4), groups, keep, num_rows=4, beta=2.0,
                          stats=StatsAccumulator())
    l = ratios[:2].clone().requires_grad_(True)
    r = 0.5 + 0.5 * off_centre[:2]
    loss = ((2.0 * (l - l.mean()) - (r - r.mean())) ** 2).sum()
    loss.backward()
    torch.testing.assert_close(weights[:2], -l.grad)


def test_crd_trains_and_is_refused_with_marble(tmp_path):
    metrics = train(nft_config(tmp_path, "nft.loss=crd", "train.epochs=2"))
    assert math.isfinite(metrics["loss/total"]) and metrics["crd/residual_abs"] > 0
    with pytest.raises(ConfigError, match="marble balances advantage-weighted"):
        nft_config(tmp_path, "nft.loss=crd", "train.combine=marble",
                   "rewards=[{name: brightness}, {name: 'tests.reward_fixtures:RedMinusBlue'}]")
