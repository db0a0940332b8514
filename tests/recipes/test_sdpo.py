"""SDPO in recipe grpo (``train.loss: sdpo``, ``train.credit: sdpo``; flowrl/recipes/sdpo.py): pairs share their
initial noise, the few-step families train with it at 1, 2 and 4 steps, a tiny run resumes bit for bit, the
dense credit scores only the states it must, and the options it cannot take are one-line errors that leave no
run directory."""

import math

import pytest
import torch

from flowrl.cli import main
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.recipes.grpo import train
from flowrl.algorithms.credit import query_states
from flowrl.recipes.sdpo import group_pairs
from flowrl.sampling import RolloutSettings, rollout
from flowrl.sampling.rollout import chunked_rollout
from flowrl.training.metrics import read_metrics
from tests.fault_helpers import TINY_TRAIN
from tools.policy_capture import capture_training_policy, lora_and_base

SDPO = ["train.loss=sdpo", "train.credit=sdpo", "train.beta=0"]


def test_pair_members_share_their_initial_noise_and_pairs_do_not():
    policy = build_policy("sd3", "tiny", seed=0)
    settings = RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.7, same_noise_in_pairs=True,
                               decode=False)
    rows = dict(group_size=4, seeds=[1, 2, 3, 4, 5, 6, 7, 8])
    traj = rollout(policy, ["a", "b"], settings, **rows)
    start = traj.latents[:, 0]  # [8, C, h, w]
    for first in range(0, 8, 2):
        assert torch.equal(start[first], start[first + 1])
    assert not torch.equal(start[1], start[2]) and not torch.equal(start[3], start[4])
    assert not torch.equal(traj.latents[0, -1], traj.latents[1, -1])  # the SDE steps draw their own noise
    chunked = chunked_rollout(policy, ["a", "b"], settings, chunk=2, **rows)
    torch.testing.assert_close(chunked.latents, traj.latents)
    assert group_pairs(traj.group_ids).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="whole pairs"):
        chunked_rollout(policy, ["a", "b"], settings, chunk=1, **rows)


def test_query_states_are_first_last_and_the_anchors():
    x0 = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [-1.0, 1.0], [0.0, 1.0]]])  # anchor: state 2 (least similar)
    seeds = torch.tensor([7])
    assert query_states(x0, 3, "least_similar", seeds).tolist() == [[0, 3, 2]]
    assert query_states(x0, 2, "least_similar", seeds).tolist() == [[0, 3]]
    assert query_states(x0, 9, "least_similar", seeds).tolist() == [[0, 3, 1, 2]]  # more queries than states: all
    assert query_states(x0, 3, "random", seeds)[0, 2].item() in (1, 2)
    assert query_states(x0[:, :1], 3, "least_similar", seeds).tolist() == [[0, 0]]  # one step: the sample only


@pytest.mark.parametrize("family,steps", [("z_image", 4), ("flux2_klein", 2), ("flux", 1)])
def test_few_step_families_train_with_sdpo(family, steps, tmp_path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    overrides = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0",
                 "log.report_prompts=0", f"sampling.num_steps={steps}", *SDPO]
    metrics = train(load_config(Config, f"configs/smoke/{family}_tiny.yaml", overrides))
    assert math.isfinite(metrics["loss/total"]) and metrics["loss/total"] > 0
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    assert metrics["perf/sdpo_queried_images"] == 8 * min(2, steps - 1)  # first + anchor per row; last: its reward
    lora_before, base_before = captured["before"]
    lora_after, base_after = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)


def test_sdpo_credit_trains_the_per_transition_loss_too(tmp_path):
    overrides = [f"run_dir={tmp_path}", *TINY_TRAIN[1:], "train.epochs=1", "train.credit=sdpo"]
    metrics = train(load_config(Config, TINY_TRAIN[0], overrides))
    assert math.isfinite(metrics["loss/total"]) and metrics["advantages/dense_abs_mean"] > 0


def test_sdpo_run_resumes_exactly(tmp_path):
    common = ["configs/smoke/sd3_tiny.yaml", "log.eval_every=0", "log.report_prompts=0", "log.progress=false",
              "sampling.num_steps=3", "train.optimizer_steps_per_epoch=2", *SDPO]

    def run(name, *extra):
        return train(load_config(Config, common[0], [f"run_dir={tmp_path / name}", *common[1:], *extra]))

    full = run("full", "train.epochs=3")
    run("resumed", "train.epochs=2", "train.checkpoint_every=1")
    resumed = run("resumed", "train.epochs=3", "train.resume=latest")
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert strip(resumed) == strip(full)
    assert [r["epoch"] for r in read_metrics(tmp_path / "resumed")][-1] == 2


@pytest.mark.parametrize("overrides,words", [
    (["sampling.group_size=3"], ["sampling.group_size", "even group size"]),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.branch_factor=2"], ["sampling.tree.branch_steps"]),
    (["sampling.window.size=1"], ["sampling.window.size", "full-SDE"]),
    (["train.beta=0.04"], ["train.beta", "no KL"]),
    (["train.sdpo_queries=1"], ["sdpo_queries", ">= 2"]),
])
def test_sdpo_bad_input_is_one_line_and_leaves_no_run_dir(overrides, words, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", *TINY_TRAIN, f"run_dir={run}", *SDPO, *overrides])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and all(word in errors[0] for word in words), err[-2000:]
    assert not run.exists()


def test_sdpo_credit_refuses_windows_but_pairs_with_any_credit(tmp_path):
    with pytest.raises(ConfigError, match="train.credit=sdpo"):
        load_config(Config, "configs/smoke/sd3_tiny.yaml", ["train.credit=sdpo", "sampling.window.size=2"])
    config = load_config(Config, "configs/toy/grpo_sdpo.yaml", [f"run_dir={tmp_path}"])
    assert (config.train.loss, config.train.credit, config.sampling.num_steps) == ("sdpo", "sdpo", 4)
    load_config(Config, "configs/smoke/sd3_tiny.yaml", ["train.loss=sdpo", "train.beta=0"])  # terminal credit
