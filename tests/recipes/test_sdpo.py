"""SDPO in recipe grpo (``train.loss: sdpo``, ``train.credit: sdpo``; flowrl/recipes/sdpo.py): pairs share their
initial noise, the few-step families train with it at 1, 2 and 4 steps, a tiny run resumes bit for bit, the
dense credit scores only the states it must, and the options it cannot take are one-line errors that leave no
run directory."""

import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from flowrl.cli import main
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.recipes.grpo import train
from flowrl.algorithms.credit import SDPO_REWARD_STATES, query_states, sdpo_dense_rewards
from flowrl.algorithms.sdpo import discounted_returns
from flowrl.config.grpo import GRPOTrainConfig
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


# --- the dense reward's timing, against the reference's formula -------------------------------------------------

def toy_score(x: torch.Tensor) -> torch.Tensor:
    """A reward of a 3-d "image": x_0 - x_2 / 2."""
    return x[..., 0] - 0.5 * x[..., 2]


def reference_returns(before: torch.Tensor, gamma: float) -> torch.Tensor:
    """SDPO's returns [B, K] written out from its reference (ZiyiZhang27/sdpo @ fcee34d): ``before`` [B, K, D] is
    the x0 predicted at the state each step starts from (ddim_with_logprob_sdpo.py L81, stacked per step in
    pipeline_with_logprob_sdpo.py L206-211); the first, the least-similar anchor and the last are scored
    (L213-241), the rest mixed by cosine similarity (train_sdpo.py L555-562), then discounted (L631-635)."""
    steps, rows = before.shape[1], torch.arange(len(before))
    sim_first = torch.cosine_similarity(before, before[:, :1].repeat(1, steps, 1), dim=2)  # [B, K]
    sim_last = torch.cosine_similarity(before, before[:, -1:].repeat(1, steps, 1), dim=2)
    anchor = (sim_first + sim_last).argmin(dim=1)  # [B]
    sim_anchor = torch.cosine_similarity(before, before[rows, anchor][:, None].repeat(1, steps, 1), dim=2)
    first, middle, last = toy_score(before[:, 0]), toy_score(before[rows, anchor]), toy_score(before[:, -1])
    rewards = (first[:, None] * sim_first + middle[:, None] * sim_anchor + last[:, None] * sim_last) / (
        sim_first + sim_anchor + sim_last)
    rewards[:, 0], rewards[:, -1] = first, last
    rewards[rows, anchor] = middle
    for t in reversed(range(steps)):
        rewards[:, t] += gamma * (rewards[:, t + 1] if t < steps - 1 else 0.0)
    return rewards


class ToyScorer:
    def submit(self, images, prompts, metadata):
        return SimpleNamespace(result=lambda: {"r": toy_score(images)})


# A 4-step pair sharing its initial noise: x0 predictions [2 rows, 5 states, 3] (state 0 the same, state 4 the sample).
PAIR_X0 = torch.tensor([[[0.6, 0.3, 0.5], [0.4, 0.7, 0.1], [0.9, 0.1, 0.4], [0.6, 0.1, 0.6], [0.9, 0.1, 0.5]],
                        [[0.6, 0.3, 0.5], [0.8, 0.8, 0.1], [0.1, 0.8, 0.8], [0.4, 0.4, 0.7], [0.2, 0.6, 0.5]]],
                       dtype=torch.float64)


def pair_dense_rewards(reward_at: str) -> tuple[torch.Tensor, int]:
    traj = SimpleNamespace(x0_preds=PAIR_X0, seeds=torch.tensor([0, 1]), rewards={"r": toy_score(PAIR_X0[:, -1])},
                           row_prompts=["p", "p"], row_metadata=[{}, {}])
    policy = SimpleNamespace(decode=lambda x: x, device=torch.device("cpu"), local_forward=nullcontext)
    rewards, count = sdpo_dense_rewards(policy, ToyScorer(), traj, ["r"], queries=3, anchor="least_similar",
                                        reward_at=reward_at, batch_size=4)
    return rewards["r"], count


def test_a_steps_dense_reward_scores_the_state_it_starts_from_as_the_reference():
    assert GRPOTrainConfig().sdpo_reward_at == "step_start"
    rewards, count = pair_dense_rewards("step_start")
    # Step 0 scores the shared initial state's x0, [0.6, 0.3, 0.5]: 0.6 - 0.25 = 0.35 for both rows. The last step
    # scores the x0 before it (row 0: [0.6, 0.1, 0.6] -> 0.3; row 1: [0.4, 0.4, 0.7] -> 0.05), not the sample. The
    # anchor of both rows is state 1 (cos to first + cos to last is least there): [0.4, 0.7, 0.1] -> 0.35 and
    # [0.8, 0.8, 0.1] -> 0.75. Three images a row, six in all (state 0 is scored for each row).
    assert rewards[:, 0].tolist() == pytest.approx([0.35, 0.35])
    assert rewards[:, 3].tolist() == pytest.approx([0.3, 0.05])
    assert rewards[:, 1].tolist() == pytest.approx([0.35, 0.75])
    assert count == 6
    returns = discounted_returns(rewards, 0.99)
    expected = reference_returns(PAIR_X0[:, :4], 0.99)
    torch.testing.assert_close(returns, expected)
    # The pair's return difference by step: row 1 ahead at steps 0 and 1 (its anchor scored 0.75), row 0 after.
    assert torch.sign(returns[0] - returns[1]).tolist() == [-1, -1, 1, 1]
    # Rewarding the state each step leads to (step_end) puts row 0 ahead at every step, and gives the pair different
    # step-0 rewards: the two timings disagree on the sign at steps 0 and 1 here.
    after, after_count = pair_dense_rewards("step_end")
    after_returns = discounted_returns(after, 0.99)
    assert torch.sign(after_returns[0] - after_returns[1]).tolist() == [1, 1, 1, 1]
    assert after[0, 0] != after[1, 0] and after_count == 4  # first and anchor a row; the last is the sample's reward
    assert after[:, 3].tolist() == pytest.approx(toy_score(PAIR_X0[:, 4]).tolist())
    assert set(SDPO_REWARD_STATES) == {"step_start", "step_end"}  # the config's Literal


# images scored per row: step_start, the first, the anchor and the last state a step starts from; step_end, the
# first and the anchor (the last is the sample, whose reward the rollout has).
@pytest.mark.parametrize("family,steps,reward_at,scored", [("z_image", 4, "step_start", 3),
                                                           ("flux2_klein", 2, "step_start", 2),
                                                           ("flux", 1, "step_end", 0)])
def test_few_step_families_train_with_sdpo(family, steps, reward_at, scored, tmp_path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    overrides = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0",
                 "log.report_prompts=0", f"sampling.num_steps={steps}", f"train.sdpo_reward_at={reward_at}", *SDPO]
    metrics = train(load_config(Config, f"configs/smoke/{family}_tiny.yaml", overrides))
    assert math.isfinite(metrics["loss/total"]) and metrics["loss/total"] > 0
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    assert metrics["perf/sdpo_queried_images"] == 8 * scored
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
    (["sampling.num_steps=1"], ["sampling.num_steps", "train.sdpo_reward_at=step_end"]),
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
