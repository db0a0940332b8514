"""TMPO against its authors' release (github.com/MAIR-Lab-HUST/TMPO, commit af2fa6c): the Softmax-TB residual
advantage, the path-level ratio (group-centred, clipped, RatioNorm-weighted), the reference term, the count of a
shared tree edge once per leaf, the reward-adaptive Beta split scheduler and its resume, and the presets.

Expected numbers are worked out by hand in the comments, or computed by the release's formulas written out
directly in the test (per leaf, as the release recomputes every leaf's path)."""

import json
import math
import os
from contextlib import contextmanager
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from flowrl.algorithms.tmpo import (
    cps_log_prob, path_surrogate, ratio_norm_weights, reference_term, softmax_tb_advantages,
)
from flowrl.config import Config, ConfigError, load_config
from flowrl.sampling.epoch_plan import step_plan
from flowrl.sampling.split_schedule import BetaSplitScheduler
from flowrl.training.row_shards import RowShards

SMOKE = "configs/smoke/sd3_tiny.yaml"


# --- advantage ---------------------------------------------------------------------------------------------------

def test_softmax_tb_advantage_for_four_paths_by_hand():
    # log P = ln(1, 2, 3, 4) -> softmax = (1, 2, 3, 4) / 10; beta = ln 2, R = (0, 1, 2, 3) -> exp(beta R) =
    # (1, 2, 4, 8) -> softmax = (1, 2, 4, 8) / 15. A = log q - log p = ln(10/15), ln(20/30), ln(40/45), ln(80/60).
    log_p = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    out = softmax_tb_advantages(log_p, rewards, torch.zeros(4, dtype=torch.long), beta=math.log(2))
    expected = [math.log(2 / 3), math.log(2 / 3), math.log(8 / 9), math.log(4 / 3)]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)


def test_softmax_tb_advantage_per_group_leaves_nan_rows_out():
    log_p = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0])
    rewards = torch.tensor([0.0, 1.0, float("nan"), 1.0, 1.0])
    out = softmax_tb_advantages(log_p, rewards, torch.tensor([0, 0, 0, 1, 1]), beta=math.log(3))
    # group 0 without its NaN row: p = (1/2, 1/2), q = (1, 3) / 4 -> A = (ln(1/2), ln(3/2)); group 1: p = q -> 0.
    assert out.tolist() == pytest.approx([math.log(0.5), math.log(1.5), 0.0, 0.0, 0.0], abs=1e-6)


# --- path-level ratio, RatioNorm weights, reference term -------------------------------------------------------------

def test_path_ratio_is_centred_by_the_group_mean_clipped_and_weighted():
    # log r = (0.1, 0.5, -0.3) - 0 has mean 0.1 -> centred (0, 0.4, -0.4) -> r = (1, e^0.4, e^-0.4)
    # = (1, 1.4918, 0.6703) -> clipped at 0.2: (1, 1.2, 0.8). A = (2, 1, -1), w = (1, 1.1, 0.9):
    # path 0: -2; path 1: max(-1.4918 * 1.1, -1.2 * 1.1) = -1.32; path 2: max(0.6703 * 0.9, 0.8 * 0.9) = 0.72.
    log_p = torch.tensor([0.1, 0.5, -0.3], requires_grad=True)
    loss, stats = path_surrogate(log_p, torch.zeros(3), torch.tensor([2.0, 1.0, -1.0]), torch.tensor([1.0, 1.1, 0.9]),
                                 clip=0.2)
    assert loss.tolist() == pytest.approx([-2.0, -1.32, 0.72], abs=1e-6)
    assert stats["ratio"].tolist() == pytest.approx([1.0, math.exp(0.4), math.exp(-0.4)], abs=1e-6)
    assert stats["clipped"].tolist() == [0.0, 1.0, 1.0]
    loss.sum().backward()
    # the centring mean is detached: only path 0 (unclipped) has a gradient, -A r w = -2
    assert log_p.grad.tolist() == pytest.approx([-2.0, 0.0, 0.0], abs=1e-6)


def test_ratio_norm_weights_by_the_release_formula():
    # Per step: (dlogp + |dmu|^2 / (2 s^2)) * s; mean over steps; exp; clip to [0.8, 1.2].
    # path 0: step 0 (0.02 + 0.001 / 0.5) * 0.5 = 0.011, step 1 (-0.01 + 0) * 0.2 = -0.002 -> exp(0.0045)
    # path 1: step 0 (0 + 0.002 / 0.5) * 0.5 = 0.002, step 1 (0.03 + 0.004 / 0.08) * 0.2 = 0.016 -> exp(0.009)
    # path 2: step 0 (1.0 + 0) * 0.5 = 0.5, step 1 0 -> exp(0.25) = 1.284 -> clipped to 1.2
    log_ratios = torch.tensor([[0.02, -0.01], [0.0, 0.03], [1.0, 0.0]])
    shifts = torch.tensor([[0.001, 0.0], [0.002, 0.004], [0.0, 0.0]])
    out = ratio_norm_weights(log_ratios, shifts, torch.tensor([0.5, 0.2]), clip=0.2)
    assert out.tolist() == pytest.approx([math.exp(0.0045), math.exp(0.009), 1.2], abs=1e-6)
    assert not out.requires_grad


def test_reference_term_is_the_squared_gap_of_length_normalised_path_log_probs():
    # S = 3: ((-3 + 3.3) / 3)^2 = 0.01, ((-6 + 5.4) / 3)^2 = 0.04
    out = reference_term(torch.tensor([-3.0, -6.0]), torch.tensor([-3.3, -5.4]), 3)
    assert out.tolist() == pytest.approx([0.01, 0.04], abs=1e-7)


def test_cps_log_prob_is_the_releases_negative_mean_squared_error():
    sample, mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.5, -0.5]])
    assert cps_log_prob(sample, mean).tolist() == pytest.approx([-2.5, -0.25])


# --- the path update on a depth-2 tree: shared edges count once per leaf -------------------------------------------

class LinearPolicy:
    """A one-parameter 'model': v = w * x + c (cond), enough for the update's bookkeeping."""

    def __init__(self, w: float):
        self.w = torch.nn.Parameter(torch.tensor(w))
        self.forward_module = None
        self.base = False

    def velocity(self, x, sigma, cond, guidance):
        return (0.0 if self.base else self.w) * x + cond

    @contextmanager
    def local_forward(self):
        yield

    @contextmanager
    def reference(self):
        self.base = True
        try:
            yield
        finally:
            self.base = False


def tree_trajectory():
    """4 leaves of one root, split 2 ways before stored steps 0 and 1 (CPS at eta 0.4 and 1.0). Rows 0-1 share
    their step-0 edge, rows 2-3 theirs; each row owns its step-1 edge."""
    g = torch.Generator().manual_seed(0)
    root = torch.randn(1, 6, generator=g).expand(4, 6)
    mid = torch.randn(2, 6, generator=g).repeat_interleave(2, dim=0)
    leaves = torch.randn(4, 6, generator=g)
    cond = torch.randn(1, 6, generator=g)
    return SimpleNamespace(
        latents=torch.stack([root, mid, leaves], dim=1), sigmas=torch.tensor([0.9, 0.6, 0.3]),
        edge_ids=torch.tensor([[0, 2], [0, 3], [1, 4], [1, 5]]), group_ids=torch.zeros(4, dtype=torch.long),
        prompt_ids=torch.zeros(4, dtype=torch.long), num_rows=4, means=None,
        cond=SimpleNamespace(select=lambda ids: cond.expand(len(ids), 6)))


def sampling_means(traj, w, etas):
    """[4, 2, 6] the CPS step means at weight ``w``, as a rollout with ``store_means`` keeps them."""
    from flowrl.sampling import transition

    cond = traj.cond.select([0] * 4)
    return torch.stack([transition(w * traj.latents[:, k] + cond, traj.latents[:, k], float(traj.sigmas[k]),
                                   float(traj.sigmas[k + 1]), noise_level=etas[k], kind="cps")[0]
                        for k in range(2)], dim=1)


def release_loss(policy, traj, old_w, rewards, *, beta, clip, ref_weight, etas, ref_w=None):
    """The release's total loss, every leaf's path recomputed on its own (tmpo/losses/*.py, tree_sampler.py)."""
    def step(w, row, k):
        x, x_next = traj.latents[row, k], traj.latents[row, k + 1]
        s, s_next = float(traj.sigmas[k]), float(traj.sigmas[k + 1])
        v = w * x + traj.cond.select([0])[0]
        std = s_next * math.sin(etas[k] * math.pi / 2)
        mean = (x - s * v) * (1 - s_next) + (x + v * (1 - s)) * math.sqrt(s_next**2 - std**2)
        return -((x_next - mean) ** 2).mean(), mean, std

    steps = [[step(policy.w, row, k) for k in range(2)] for row in range(4)]
    old = [[step(torch.tensor(old_w), row, k) for k in range(2)] for row in range(4)]
    current = torch.stack([steps[r][0][0] + steps[r][1][0] for r in range(4)])
    old_paths = torch.stack([old[r][0][0] + old[r][1][0] for r in range(4)])
    ref_paths = old_paths if ref_w is None else torch.stack(
        [step(torch.tensor(ref_w), r, 0)[0] + step(torch.tensor(ref_w), r, 1)[0] for r in range(4)])
    advantage = torch.log_softmax(beta * rewards, 0) - torch.log_softmax(current.detach(), 0)
    log_w = torch.stack([torch.stack([
        (steps[r][k][0].detach() - old[r][k][0] + ((steps[r][k][1].detach() - old[r][k][1]) ** 2).mean()
         / (2 * steps[r][k][2] ** 2)) * steps[r][k][2] for k in range(2)]).mean() for r in range(4)])
    weights = torch.exp(log_w).clamp(1 - clip, 1 + clip)
    log_ratio = current - old_paths
    ratio = torch.exp((log_ratio - log_ratio.detach().mean()).clamp(-10, 10))
    surrogate = torch.maximum(-advantage * ratio * weights, -advantage * ratio.clamp(1 - clip, 1 + clip) * weights)
    return surrogate.mean() + ref_weight * ((current / 2 - ref_paths / 2) ** 2).mean()


@pytest.mark.parametrize("new_w, reference, stored", [(0.55, "rollout", False), (0.9, "rollout", False),
                                                      (0.55, "base", False), (0.9, "rollout", True)])
def test_path_update_counts_a_shared_edge_once_per_leaf_like_the_release(new_w, reference, stored):
    # rollout at w = 0.5, then an update to new_w (0.9 is far enough to clip); reference "base" is w = 0;
    # stored: the rollout kept its step means (store_means), else they are recomputed before the update
    from accelerate import Accelerator

    from flowrl.recipes.tmpo_paths import TmpoPaths
    from flowrl.training.stats import StatsAccumulator

    traj, rewards, etas = tree_trajectory(), torch.tensor([0.1, -0.3, 0.7, 0.2]), [0.4, 1.0]
    if stored:
        traj.means = sampling_means(traj, 0.5, etas)
    train = SimpleNamespace(micro_batch_size=3, tmpo_target="residual", tmpo_beta=2.0, tmpo_clip_range=0.2,
                            tmpo_ref_weight=0.5, tmpo_reference=reference)
    policy = LinearPolicy(0.5)
    accelerator = Accelerator(cpu=True)
    run = SimpleNamespace(cfg=SimpleNamespace(sampling=SimpleNamespace(kind="cps"), train=train), policy=policy,
                          accelerator=accelerator, shards=RowShards(accelerator), guidance=1.0)
    paths = TmpoPaths(run, traj, [0, 1], etas, rewards)  # the rollout pass at w = 0.5
    with torch.no_grad():
        policy.w.fill_(new_w)  # an update happened: the next chunk is off-policy
    paths.backward(torch.arange(4), StatsAccumulator(), on_policy=False)
    ours = policy.w.grad.clone()
    policy.w.grad = None
    release_loss(policy, traj, 0.5, rewards, beta=2.0, clip=0.2, ref_weight=0.5, etas=etas,
                 ref_w=0.0 if reference == "base" else None).backward()
    assert float(policy.w.grad) != 0
    assert float(ours) == pytest.approx(float(policy.w.grad), rel=1e-5, abs=1e-8)


# --- the Beta split scheduler ------------------------------------------------------------------------------------

def scheduler(**kwargs):
    return BetaSplitScheduler(first_steps=(7, 14, 21), base_noise_levels=(0.4, 0.7, 1.0), low=2, high=24, **kwargs)


def test_first_epoch_keeps_the_configured_splits_and_levels():
    assert scheduler().schedule(0, seed=0) == ((7, 14, 21), (0.4, 0.7, 1.0))


def test_beta_scheduler_update_by_hand():
    s = scheduler()
    s.observe(torch.tensor([0.2, 0.3, 0.31, float("nan")]))
    # bounds: r_min = 0.99 * 0.2 + 0.01 * 0.2 = 0.2, r_max = 0.99 * 0.35 + 0.01 * 0.31 = 0.3496; mean 0.27
    assert (s.r_min, s.r_max, s.mean_reward) == pytest.approx((0.2, 0.3496, 0.27))
    raw1 = (0.27 - 0.2) / (0.3496 - 0.2)  # 0.4679
    steps, levels = s.schedule(1, seed=5)
    # first smoothing takes raw1 as is; the Beta(1 + (1 - a) 4, 1 + a 4) draws come from the (seed, epoch) rng
    a = raw1
    fractions = np.sort(np.random.default_rng([5, 1, 0xBE7A]).beta(1 + (1 - a) * 4, 1 + a * 4, size=3))
    expected = [math.floor(f * 22 + 2) for f in fractions]
    for i in (1, 2):
        expected[i] = max(expected[i], expected[i - 1] + 3)
    assert steps == tuple(expected)
    scale = 1 + 0.3 * (1 - a) - 0.2 * a
    assert levels == pytest.approx([0.4 * scale, 0.7 * scale, 1.0])  # 1.0 * scale > 1 is clipped to 1
    # second rollout: lower rewards; alpha is smoothed three times per schedule, the splits use the first value
    s.observe(torch.tensor([0.1, 0.2]))
    r_min, r_max = 0.99 * 0.2 + 0.01 * 0.1, 0.99 * 0.3496 + 0.01 * 0.2
    raw2 = max(0.1, (0.15 - r_min) / (r_max - r_min))  # below the floor: 0.1
    assert raw2 == 0.1
    alpha1 = 0.85 * raw1 + 0.15 * raw2
    alpha2 = 0.85 * alpha1 + 0.15 * raw2
    _, levels = s.schedule(2, seed=5)
    scale = 1 + 0.3 * (1 - alpha2) - 0.2 * alpha2
    assert levels == pytest.approx([0.4 * scale, 0.7 * scale, min(1.0, scale)])
    assert s.alpha == pytest.approx(0.85 * alpha2 + 0.15 * raw2)


def test_splits_keep_their_gap_where_the_releases_clamp_would_merge_them():
    s = scheduler()
    assert s._spread([2, 9, 15]) == (2, 9, 15)  # no clamp: the release's rule
    assert s._spread([5, 5, 6]) == (5, 8, 11)  # pushed apart by min_gap 3
    assert s._spread([23, 23, 24]) == (18, 21, 24)  # the release gives [23, 24, 24]: a merged split


def test_beta_schedule_config_checks_name_the_key():
    base = ["sampling.tree.branch_steps=[0,2]", "sampling.tree.branch_factor=2", "sampling.tree.schedule=beta"]
    for overrides, key in ((base, "sampling.tree.split_noise_levels"),
                           (base + ["sampling.tree.split_noise_levels=[0.4]"], "sampling.tree.split_noise_levels"),
                           (base + ["sampling.tree.split_noise_levels=[0.4,1.0]", "sampling.tree.beta.min_gap=4"],
                            "sampling.tree.beta.min_gap"),
                           (["train.loss=tmpo"], "train.beta")):
        with pytest.raises(ConfigError) as error:
            load_config(Config, SMOKE, overrides)
        assert key in str(error.value) and "\n" not in str(error.value)


def test_split_noise_levels_make_the_sde_run_at_the_splits_only():
    cfg = load_config(Config, SMOKE, ["sampling.num_steps=8", "sampling.tree.branch_steps=[1,3,5]",
                                      "sampling.tree.branch_factor=2", "sampling.group_size=8",
                                      "sampling.tree.split_noise_levels=[0.4,0.7,1.0]"])
    plan = step_plan(cfg.sampling, 0, 0)
    assert list(plan.sde_steps) == [1, 2, 3, 4, 5] and plan.branch_steps == (1, 3, 5)
    assert [plan.noise_level_at(step, 0.7) for step in range(8)] == [0.7, 0.4, 0, 0.7, 0, 1.0, 0.7, 0.7]


def test_rollout_uses_each_steps_noise_level_and_zero_is_an_ode_step():
    from flowrl.models import build_policy
    from flowrl.sampling import RolloutSettings, StepPlan, rollout, sde_step

    policy = build_policy("sd3", "tiny", seed=0)
    plan = StepPlan(4, sde_start=1, sde_size=3, branch_steps=(1, 3), branch_factor=2,
                    noise_levels=((1, 0.4), (2, 0.0), (3, 1.0)))
    settings = RolloutSettings(num_steps=4, guidance_scale=1.0, noise_level=0.7, kind="cps", plan=plan, decode=False)
    traj = rollout(policy, ["a red cube"], settings, group_size=4, seeds=[3])
    assert traj.log_probs[:, 1].abs().max() == 0  # the level-0 step has no density
    cond = policy.encode(["a red cube"]).select(torch.zeros(4, dtype=torch.long))
    for column, level in ((0, 0.4), (1, 0.0), (2, 1.0)):  # each stored step rescored at its own level
        x, sigma, sigma_next = traj.latents[:, column], float(traj.sigmas[column]), float(traj.sigmas[column + 1])
        with torch.no_grad():
            velocity = policy.velocity(x, sigma, cond, 1.0)
        step = sde_step(velocity, x, sigma, sigma_next, noise_level=level, kind="cps",
                        prev_sample=traj.latents[:, column + 1])
        assert torch.allclose(step.log_prob, traj.log_probs[:, column], atol=1e-5)
        if level == 0:  # the CPS step without noise is the Euler step
            torch.testing.assert_close(traj.latents[:, column + 1], x + (sigma_next - sigma) * velocity,
                                       atol=1e-5, rtol=0)


# --- a real run: the tree moves with the rewards, and resume restores the scheduler exactly ---------------------------

TMPO_TREE = ["train.loss=tmpo", "train.beta=0", "sampling.kind=cps", "sampling.tree.branch_steps=[0,2]",
             "sampling.tree.branch_factor=2", "sampling.tree.schedule=beta", "sampling.tree.branch_range=[0,2]",
             "sampling.tree.split_noise_levels=[0.4,1.0]", "sampling.tree.beta.min_gap=1",
             "sampling.tree.beta.kappa=4", "train.std_scope=group", "log.progress=false", "log.eval_every=0",
             "log.report_prompts=0", "train.export_lora=false", "train.checkpoint_every=1"]


def run_plans(tmp_path, monkeypatch, overrides):
    import sys

    from flowrl.recipes.grpo import train

    seen = []
    sampling = sys.modules["flowrl.sampling.rollout"]
    real_rollout = sampling.rollout

    def recording_rollout(policy, prompts, settings, **kwargs):
        plan = settings.plan
        if plan is not None and plan.branch_steps:  # training rollouts (held-out ones have no tree)
            seen.append((plan.branch_steps, plan.noise_levels))
        return real_rollout(policy, prompts, settings, **kwargs)

    with monkeypatch.context() as patch:  # undone on return, so the next run records into its own list
        patch.setattr(sampling, "rollout", recording_rollout)
        metrics = train(load_config(Config, SMOKE, [f"run_dir={tmp_path}", *TMPO_TREE, *overrides]))
    from flowrl.training.checkpoint import resolve_checkpoint

    state = json.loads((resolve_checkpoint(tmp_path) / "trainer_state.json").read_text())
    return seen, state["split_scheduler"], metrics


def test_beta_scheduler_state_resumes_exactly(tmp_path, monkeypatch):
    whole, whole_state, metrics = run_plans(tmp_path / "whole", monkeypatch, ["train.epochs=3"])
    assert math.isfinite(metrics["loss/total"]) and metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    assert "tree/alpha" in metrics
    first, _, _ = run_plans(tmp_path / "split", monkeypatch, ["train.epochs=2"])
    resumed, resumed_state, _ = run_plans(tmp_path / "split", monkeypatch, ["train.epochs=3", "train.resume=latest"])
    assert first + resumed == whole
    assert resumed_state == whole_state and whole_state["alpha"] is not None
    assert whole[0][0] == (0, 2)  # the first epoch, no reward yet: the configured splits


# --- presets -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["configs/toy/tmpo.yaml", "configs/sd35_medium/tmpo.yaml"])
def test_presets_carry_the_releases_settings(path):
    cfg = load_config(Config, path)
    t, tree = cfg.train, cfg.sampling.tree
    assert (t.loss, t.tmpo_beta, t.tmpo_clip_range, t.tmpo_ref_weight, t.beta) == ("tmpo", 15.0, 0.2, 0.1, 0)
    assert (cfg.sampling.kind, tree.branch_factor, tree.schedule) == ("cps", 3, "beta")
    assert tree.split_noise_levels == [0.4, 0.7, 1.0] and cfg.sampling.group_size % 27 == 0
    plan = step_plan(cfg.sampling, 0, cfg.seed, None)
    assert plan.leaves_per_root == 27
