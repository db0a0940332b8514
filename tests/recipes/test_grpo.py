"""The GRPO recipe end to end on the tiny models: smoke runs, the loss by hand, on-policy ratio,
learning on a task where the reward must rise, async = sync scoring, and tree / window rollouts."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
from functools import partial

import pytest
import torch

from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.config import Config, load_config
from flowrl.models import build_policy
from flowrl.training.stats import StatsAccumulator
from flowrl.recipes.build import make_accelerator
from flowrl.recipes.grpo import train
from flowrl.sampling import RolloutSettings, rollout
from flowrl.training.metrics import read_metrics
from tests.reward_fixtures import RedMinusBlue
from tools.policy_capture import capture_training_policy, lora_and_base

SMOKE = "configs/smoke/sd3_tiny.yaml"


def smoke_config(tmp_path, *overrides, path=SMOKE):
    base = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=1",
            "log.eval_images_per_prompt=2"]
    return load_config(Config, path, base + list(overrides))


@pytest.mark.parametrize("path", ["configs/smoke/sd3_tiny.yaml", "configs/smoke/flux_tiny.yaml"])
def test_smoke_run_trains_only_the_lora(tmp_path, path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    metrics = train(smoke_config(tmp_path, path=path))
    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["reward/brightness_mean"])
    lora_before, base_before = captured["before"]
    lora_after, base_after = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    # The first inner pass is on-policy: the recomputed log-prob equals the recorded one.
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-6
    records = read_metrics(tmp_path)
    assert [r["epoch"] for r in records] == [0, 1]
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (tmp_path / "grids" / "epoch_00001.png").is_file()
    for name in ("before.png", "after.png", "reward_curve.png", "report.json", "report.md", "report.html"):
        assert (tmp_path / name).is_file(), name
    assert metrics["report/after/eval/brightness"] > 0


def test_async_scoring_gives_the_same_run_as_sync(tmp_path):
    runs = []
    for mode in ("true", "false"):
        metrics = train(smoke_config(tmp_path / mode, f"train.async_rewards={mode}", "train.batches_per_epoch=2",
                                     "log.eval_every=0"))
        runs.append({k: v for k, v in metrics.items() if not k.startswith("perf/")})
    assert runs[0] == runs[1]


def _hand_setup(guidance=4.5):
    policy = build_policy("sd3", "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    traj = rollout(policy, ["a red circle"], RolloutSettings(num_steps=3, guidance_scale=guidance, noise_level=0.7),
                   group_size=4, seeds=[1, 2, 3, 4])
    advantages = torch.tensor([[1.5], [-0.5], [2.0], [-3.0]]).expand(4, traj.num_stored_steps).clone()
    # Move the policy off the sampling policy so ratios leave the clip range on some rows.
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy, traj, advantages


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_recipe_loss_matches_a_hand_computation(beta):
    guidance, a, clip = 4.5, 0.7, 0.002
    policy, traj, advantages = _hand_setup(guidance)
    accelerator = make_accelerator(load_config(Config, SMOKE, ["device=cpu"]))
    rows, k = torch.arange(4), 1
    mask = torch.ones(4, traj.num_stored_steps, dtype=torch.bool)
    mask[3, k] = False  # a masked transition must not count
    stats = StatsAccumulator()
    settings = TransitionSettings(policy_loss=partial(grpo_clip_loss, clip_low=clip, clip_high=clip),
                                  guidance=guidance, kind="sde", beta=beta)
    loss_sum = transition_loss(policy, traj, advantages, rows, k, mask, settings=settings, accelerator=accelerator,
                               noise_level=a, stats=stats, on_policy=False)

    # By hand, per row: CFG velocity from two separate transformer passes, the SDE mean from the
    # formula, the Gaussian log-density of the stored next latent, the PPO max, and the KL.
    cond = traj.cond
    x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
    s, s_next = float(traj.sigmas[k]), float(traj.sigmas[k + 1])
    dt = s_next - s
    std_t = a * math.sqrt(s / (1 - s))  # Flow-GRPO's std_dev_t; the transition std adds sqrt(-dt)
    std = std_t * math.sqrt(-dt)

    def velocity(model_cond):
        t = torch.full((1,), s * 1000)
        v_u = policy.transformer(hidden_states=model_cond[0], timestep=t, encoder_hidden_states=cond.negative_prompt_embeds,
                                 pooled_projections=cond.negative_pooled_prompt_embeds, return_dict=False)[0]
        v_c = policy.transformer(hidden_states=model_cond[0], timestep=t, encoder_hidden_states=cond.prompt_embeds,
                                 pooled_projections=cond.pooled_prompt_embeds, return_dict=False)[0]
        return v_u + guidance * (v_c - v_u)

    expected = 0.0
    clipped_seen = unclipped_seen = False
    for row in range(3):
        xi = x[row: row + 1]
        with torch.no_grad():
            v = velocity((xi,))
            with policy.reference():
                v_ref = velocity((xi,))
        mean = xi + (v + a**2 / (1 - s) / 2 * (xi + (1 - s) * v)) * dt  # std_t^2 / (2 s) = a^2 / (2 (1 - s))
        mean_ref = xi + (v_ref + a**2 / (1 - s) / 2 * (xi + (1 - s) * v_ref)) * dt
        logp = (-((x_next[row: row + 1] - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()
        ratio = torch.exp(logp - traj.log_probs[row, k])
        adv = advantages[row, k]
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)
        clipped_seen |= bool(clipped > unclipped)
        unclipped_seen |= bool(unclipped >= clipped)
        kl = ((mean - mean_ref) ** 2).mean() / (2 * std_t**2)  # Flow-GRPO's KL: std_t, not the transition std
        expected += float(torch.maximum(unclipped, clipped) + beta * kl)
    assert clipped_seen and unclipped_seen, "the fixture must exercise both PPO branches"
    assert loss_sum.item() == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_reward_rises_where_it_must(tmp_path, monkeypatch):
    """Red-minus-blue is learnable through the tiny random VAE (its group norms make plain brightness
    nearly latent-independent, but a per-channel latent offset shifts the colour balance by about
    two per-sample standard deviations). Before/after is measured on the same 32 seeds (common
    random numbers), and the rise must exceed 4 standard errors of the paired per-seed differences."""
    captured = capture_training_policy(monkeypatch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    train(smoke_config(tmp_path / "run", f"train.epochs={RED_EPOCHS}", "train.learning_rate=2e-2",
                       "train.clip_range=0.2", "train.beta=0", "sampling.group_size=16", "sampling.prompts_per_batch=1",
                       "train.micro_batch_size=16", "train.inner_epochs=3", f"data.prompts={prompts}",
                       "data.test_fraction=0", "log.eval_every=0", "train.ema=false",
                       "rewards=[{name: tests.reward_fixtures:RedMinusBlue}]"))
    policy, reward = captured["policy"], RedMinusBlue()

    def redness():
        traj = rollout(policy, ["a cat"], RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7),
                       group_size=32, seeds=list(range(1000, 1032)))
        return reward(traj.images, None, None)["redness"]  # [32]

    after = redness()
    with policy.reference():
        before = redness()
    gain = after - before  # [32], paired on the seeds
    standard_error = gain.std() / len(gain) ** 0.5
    print(f"redness {before.mean():.4f} -> {after.mean():.4f}: paired gain {gain.mean() / standard_error:.1f} s.e.")
    assert gain.mean() > 4 * standard_error, (before.mean(), after.mean(), standard_error)


RED_EPOCHS = 12


@pytest.mark.parametrize("overrides", [
    ["sampling.window.size=2", "sampling.window.mode=sliding", "sampling.num_steps=4", "train.clip_range=1e-5"],
    ["sampling.tree.branch_steps=[1]", "sampling.tree.branch_factor=2"],
    ["sampling.kind=cps", "train.timestep_fraction=0.5"],
])
def test_window_tree_and_cps_runs(tmp_path, overrides):
    metrics = train(smoke_config(tmp_path, *overrides, "log.eval_every=0"))
    assert math.isfinite(metrics["loss/total"])
    # The loss recomputes velocities in micro-batches of a different size than the rollout, so float32
    # GEMM blocking differs: CPS ratios deviate by ~2e-6 on some CPUs. A real mismatch (wrong rows,
    # conditioning or noise) deviates by orders of magnitude more.
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5


@pytest.mark.parametrize("layout", ["diffusers", "peft"])
def test_training_starts_from_an_existing_lora(tmp_path, layout, monkeypatch):
    import diffusers
    from peft import get_peft_model_state_dict

    from flowrl.models.lora_io import lora_config_dict, lora_state_dict, save_diffusers_lora

    source = build_policy("sd3", "tiny", seed=0)
    source.add_lora(rank=2, alpha=3, init_seed=5)
    with torch.no_grad():
        for p in source.trainable_parameters():
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    if layout == "diffusers":
        path = save_diffusers_lora(diffusers.StableDiffusion3Pipeline, tmp_path / "lora", lora_state_dict(source.transformer),
                                   lora_config_dict(source.transformer))
    else:
        path = tmp_path / "peft"
        path.mkdir()  # a peft adapter directory, as PeftModel.save_pretrained writes it
        import json
        from safetensors.torch import save_file

        state = {f"base_model.model.{k}": v for k, v in get_peft_model_state_dict(source.transformer).items()}
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(lora_config_dict(source.transformer)))

    captured = capture_training_policy(monkeypatch)
    cfg = smoke_config(tmp_path / "run", f"lora.init_from={path}", "train.epochs=1", "train.learning_rate=1e-12",
                       "log.eval_every=0")
    train(cfg)
    loaded = captured["policy"]
    assert loaded.transformer.peft_config["default"].r == 2
    expected = lora_state_dict(source.transformer)
    got = lora_state_dict(loaded.transformer)
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6)  # lr 1e-12: unchanged


def test_tensorboard_tracking(tmp_path):
    pytest.importorskip("tensorboard")
    train(smoke_config(tmp_path, "train.epochs=1", "log.backend=tensorboard", "log.eval_every=0"))
    event_files = list(tmp_path.rglob("events.out.tfevents.*"))
    assert event_files, "tensorboard wrote no event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(event_files[0].parent))
    accumulator.Reload()
    assert "reward/brightness_mean" in accumulator.Tags()["scalars"]


def test_held_out_curve_is_logged_from_the_base_model_on(tmp_path):
    train(smoke_config(tmp_path, "train.epochs=2", "log.test_every=1", "log.test_prompts=2", "log.eval_every=0"))
    records = read_metrics(tmp_path)
    assert [r["epoch"] for r in records] == [-1, 0, 1]
    assert all(math.isfinite(r["test/brightness"]) for r in records)
    assert [r["perf/rollouts"] for r in records] == [0, 8, 16]
    assert records[0]["perf/train_wall_s"] == 0 < records[1]["perf/train_wall_s"] < records[2]["perf/train_wall_s"]


def test_a_sub_score_can_drive_training(tmp_path):
    metrics = train(smoke_config(tmp_path, "train.epochs=1", "log.eval_every=0", "log.report_prompts=0",
                                 "rewards=[{name: brightness, kwargs: {saturation: true}, key: brightness/saturation}]"))
    assert metrics["reward/combined_mean"] == pytest.approx(metrics["reward/brightness/saturation_mean"])
    assert metrics["reward/combined_mean"] != pytest.approx(metrics["reward/brightness_mean"])
    with pytest.raises(ValueError, match="not one of its outputs"):
        train(smoke_config(tmp_path / "bad", "rewards=[{name: brightness, key: saturation}]"))
