"""train.drop_zero_advantage: Flow-GRPO's filter of rows whose advantage is exactly zero (saturated groups)."""

import math
import os
import signal
import subprocess
import warnings
from functools import partial

import pytest
import torch

import flowrl.recipes.grpo as grpo
from flowrl.algorithms.credit import zero_advantage_kept
from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.config import Config, ConfigError, load_config
from flowrl.recipes.grpo import train
from flowrl.training.metrics import read_metrics
from flowrl.training.stats import StatsAccumulator
from tests import REPO
from tests.two_processes import TWO_PROCESSES, launch_failure
from tools.policy_capture import capture_training_policy, lora_and_base

REWARD = "rewards=[{name: 'tests.reward_fixtures:FlatOnSomePrompts'}]"
COMMON = ["train.epochs=1", "log.progress=false", "log.eval_every=0", "train.drop_zero_advantage=true",
          "sampling.num_steps=3", "train.skip_last_step=false", "train.beta=0.04", "train.ema=false", REWARD,
          "train.micro_batch_size=3", "train.export_lora=false", "log.report_prompts=0"]


def _config(tmp_path, prompts: list[str], *overrides):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n")
    return load_config(Config, "configs/smoke/sd3_tiny.yaml",
                       [f"run_dir={tmp_path / 'run'}", f"data.prompts={prompt_file}",
                        f"data.test_prompts={prompt_file}", *COMMON, *overrides])


def test_the_rule_is_exact_zero_on_every_trained_step():
    advantages = torch.tensor([[0.0, 0.0], [0.0, 1e-30], [2.0, 0.0], [-1.0, 1.0], [float("nan"), 0.0]])  # [N, K]
    mask = torch.tensor([[True, True], [True, True], [False, True], [True, True], [False, True]])
    assert zero_advantage_kept(advantages, mask).tolist() == [False, True, False, True, False]


def test_a_saturated_group_is_dropped_and_the_gradient_is_that_of_the_kept_rows(tmp_path, monkeypatch):
    """One step on two groups, one of them flat: the accumulated gradient (policy loss and KL) equals the mean
    transition loss of the other group's rows alone, recomputed by hand from the run's own rollouts."""
    import flowrl.recipes.start as start

    real_build = start.build_training_policy

    def build_off_base(cfg, device):  # a LoRA away from the base, so the flat rows' KL is not 0
        policy = real_build(cfg, device)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in policy.trainable_parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        return policy

    monkeypatch.setattr(start, "build_training_policy", build_off_base)
    captured, seen = capture_training_policy(monkeypatch), {}
    real_sample, real_step, real_update = grpo.sample_and_score, grpo.optimizer_step, grpo.update_policy

    def sample(*args, **kwargs):
        seen["traj"], *rest = real_sample(*args, **kwargs)
        return (seen["traj"], *rest)

    def step(run, stats):
        seen["grads"] = {n: p.grad.clone() for n, p in run.policy.transformer.named_parameters() if p.grad is not None}
        seen["accelerator"] = run.accelerator
        real_step(run, stats)

    def update(run, epoch, objective, traj, advantages, *args):
        seen["advantages"] = advantages  # [N, K] what each stored step trained on
        real_update(run, epoch, objective, traj, advantages, *args)

    monkeypatch.setattr(grpo, "sample_and_score", sample)
    monkeypatch.setattr(grpo, "update_policy", update)
    monkeypatch.setattr(grpo, "optimizer_step", step)
    metrics = train(_config(tmp_path, ["a flat square", "a varied square"]))
    assert metrics["policy/dropped_rows"] == 4  # the flat prompt's group of 4

    traj, policy = seen["traj"], captured["policy"]
    flat = torch.tensor(["flat" in p for p in traj.row_prompts])
    advantages = seen["advantages"]
    assert torch.all(advantages[flat] == 0) and torch.all(advantages[~flat] != 0)
    lora_before, _ = captured["before"]
    with torch.no_grad():  # back to the weights the step's gradient was taken at
        for name, param in policy.transformer.named_parameters():
            if name in lora_before:
                param.copy_(lora_before[name])

    def mean_loss_gradient(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        policy.transformer.zero_grad(set_to_none=True)
        mask = torch.ones(traj.log_probs.shape, dtype=torch.bool)  # [N, K]
        settings = TransitionSettings(policy_loss=partial(grpo_clip_loss, clip_low=1e-4, clip_high=1e-4),
                                      guidance=4.5, kind="sde", beta=0.04)
        total = sum(transition_loss(policy, traj, seen["advantages"], rows, k, mask, settings=settings,
                                    accelerator=seen["accelerator"], noise_level=0.7, stats=StatsAccumulator(),
                                    on_policy=False)
                    for k in range(traj.num_stored_steps))
        (total / (len(rows) * traj.num_stored_steps)).backward()
        return {n: p.grad.clone() for n, p in policy.transformer.named_parameters() if p.grad is not None}

    expected = mean_loss_gradient((~flat).nonzero()[:, 0])
    assert expected.keys() == seen["grads"].keys()
    for name, grad in expected.items():
        torch.testing.assert_close(seen["grads"][name], grad, rtol=1e-4, atol=1e-9)
    # Kept, the flat rows would count in the mean and pull by their KL: another gradient.
    every_row = mean_loss_gradient(torch.arange(traj.num_rows))
    assert max(float((every_row[n] - expected[n]).norm() / expected[n].norm()) for n in expected) > 0.05


def test_an_all_saturated_batch_takes_no_step(tmp_path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        metrics = train(_config(tmp_path, ["a flat square", "another flat square"]))
    assert not [w for w in seen if "lr_scheduler" in str(w.message)]  # the skipped first step says nothing
    assert metrics["policy/dropped_rows"] == 8
    lora_after, _ = lora_and_base(captured["policy"])
    lora_before, _ = captured["before"]
    assert all(torch.equal(lora_before[n], lora_after[n]) for n in lora_before)  # AdamW's decay did not act either


@pytest.mark.parametrize("overrides, message", [
    (["train.loss=tmpo", "train.beta=0"], "train.loss=tmpo"),
    (["train.loss=sdpo", "train.beta=0"], "train.loss=sdpo"),
])
def test_objectives_of_other_targets_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match="drop_zero_advantage") as error:
        load_config(Config, "configs/smoke/sd3_tiny.yaml", ["train.drop_zero_advantage=true", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_two_processes_one_with_every_row_dropped_complete(tmp_path):
    """Rank 1's rewards are all flat: it keeps no row, yet runs zero-weighted passes, so DDP's gradient all-reduce
    of rank 0's kept rows completes instead of hanging."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    accelerate = TWO_PROCESSES
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [*accelerate, "-m", "flowrl", "train", "configs/smoke/sd3_tiny.yaml", f"run_dir={tmp_path / 'run'}",
               f"data.prompts={prompts}", f"data.test_prompts={prompts}", "sampling.prompts_per_batch=1", *COMMON]
    # Its own process group: a hang (the failure this test is for) must not leave the workers behind.
    launch = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        _, stderr = launch.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()
        pytest.fail("the 2-process run hung: a process with no kept row left the all-reduce waiting")
    assert launch.returncode == 0, launch_failure(stderr)
    (record,) = read_metrics(tmp_path / "run")
    assert record["policy/dropped_rows"] == 4  # rank 1's group; rank 0's trained
    assert math.isfinite(record["loss/total"]) and record["optim/grad_norm"] > 0


@pytest.mark.parametrize("overrides", [
    ["sampling.window.size=2", "sampling.window.mode=random", "sampling.num_steps=4"],  # rows of their own windows
    ["sampling.tree.branch_steps=[1]", "sampling.tree.branch_factor=2", "sampling.group_size=4"],
    ["train.credit=dense_cosine"],
], ids=["window", "tree", "dense_cosine"])
def test_window_tree_and_dense_credit_drop_the_flat_group(tmp_path, overrides):
    metrics = train(_config(tmp_path, ["a flat square", "a varied square"], *overrides))
    assert metrics["policy/dropped_rows"] == 4 and math.isfinite(metrics["loss/total"])
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5  # the kept rows, recomputed on their own steps
