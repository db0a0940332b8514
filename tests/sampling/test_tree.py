"""Tree rollouts: the advantage backup on a real depth-2 tree, TMPO's dynamic branch schedules,
BranchGRPO's width and depth pruning masks (all by hand), their config checks, and GRPO / TMPO
smoke runs whose branch points move between epochs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch

from flowrl.algorithms.advantages import edge_advantages, grpo_advantages
from flowrl.algorithms.tree import extreme_leaves, prune_mask
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.sampling.epoch_plan import step_plan
from flowrl.sampling import RolloutSettings, StepPlan, rollout
from flowrl.sampling.plan import branch_schedule, depth_pruned_steps
from tools.policy_capture import capture_training_policy, lora_and_base

SMOKE = "configs/smoke/sd3_tiny.yaml"


@pytest.fixture(scope="module")
def depth_two_tree():
    """One root, split before steps 1 and 2 into 2 x 2 = 4 leaves, every step stochastic and stored."""
    policy = build_policy("sd3", "tiny", seed=0)
    settings = RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7,
                               plan=StepPlan(4, branch_steps=(1, 2), branch_factor=2))
    return rollout(policy, ["a red circle"], settings, group_size=4, seeds=[11])


# --- the backup --------------------------------------------------------------------------------------------

def test_backup_on_a_depth_two_tree_by_hand(depth_two_tree):
    traj = depth_two_tree
    # Step 0 is the root's edge (all 4 leaves), step 1 one edge per first-level child ({0,1} and {2,3}),
    # steps 2 and 3 each leaf's own edge.
    assert [len(set(traj.edge_ids[:, k].tolist())) for k in range(4)] == [1, 2, 4, 4]
    assert traj.edge_ids[0, 1] == traj.edge_ids[1, 1] != traj.edge_ids[2, 1] == traj.edge_ids[3, 1]

    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    leaf = grpo_advantages(rewards, traj.group_ids, std_scope="group")
    # By hand: group mean 3, deviations [-2, 0, -1, 3], population std sqrt((4 + 0 + 1 + 9) / 4) = sqrt(3.5)
    # = 1.870829, so A = dev / (1.870829 + 1e-4) = [-1.068977, 0, -0.534488, 1.603465].
    std = math.sqrt(3.5) + 1e-4
    assert leaf.tolist() == pytest.approx([-2 / std, 0.0, -1 / std, 3 / std], rel=1e-6)
    edges = edge_advantages(leaf, traj.edge_ids)  # [4, 4]
    # Root edge: mean of all four = 0 / std = 0.
    assert edges[:, 0].tolist() == pytest.approx([0.0] * 4, abs=1e-7)
    # First-level edges: (-2 + 0) / 2 / std = -0.534488 for leaves 0, 1 and (-1 + 3) / 2 / std = 0.534488 for 2, 3.
    assert edges[:, 1].tolist() == pytest.approx([-1 / std, -1 / std, 1 / std, 1 / std], rel=1e-6)
    # Leaf edges carry the leaf's own advantage.
    for k in (2, 3):
        assert edges[:, k].tolist() == pytest.approx(leaf.tolist(), rel=1e-6)
    # Each edge trains once: on the first row that carries it.
    assert traj.first_visit_mask().int().tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]]


def test_pruning_the_depth_two_tree(depth_two_tree):
    traj = depth_two_tree
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    # Width 2 keeps the best leaf (3, reward 6) and the worst (0, reward 1). Leaves 1 and 2 lose their own
    # edges (steps 2, 3); the shared edges of steps 0 and 1 stay, so leaf 2's first-level edge (the {2, 3}
    # edge, advantage +0.534) still trains, from the row that visits it first.
    width = prune_mask(rewards, traj.group_ids, traj.edge_ids, traj.step_indices, keep_width=2)
    assert width.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert (traj.first_visit_mask() & width).int().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0],
                                                                 [0, 0, 1, 1]]
    # Depth pruning of 1 step, last branch step 2, 4 steps: the window is step num_steps - 2 = 2.
    steps = depth_pruned_steps(0, num_steps=4, last_branch=2, size=1)
    assert steps == (2,)
    both = prune_mask(rewards, traj.group_ids, traj.edge_ids, traj.step_indices, keep_width=2, pruned_steps=steps)
    assert both.int().tolist() == [[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 1]]


# --- the dynamic schedule ------------------------------------------------------------------------------------

def test_random_branch_steps_are_deterministic_distinct_and_in_range():
    draw = lambda epoch, seed=7: branch_schedule(epoch, num_steps=10, steps=(0, 4, 8), schedule="random",  # noqa: E731
                                                 branch_range=(1, 6), seed=seed)
    draws = [draw(epoch) for epoch in range(60)]
    assert draws == [draw(epoch) for epoch in range(60)]  # a function of (seed, epoch)
    for steps in draws:
        assert len(steps) == 3 and len(set(steps)) == 3 and list(steps) == sorted(steps)
        assert all(1 <= s <= 6 for s in steps)
    assert len(set(draws)) > 10  # it moves: C(6, 3) = 20 possible trees
    assert {s for steps in draws for s in steps} == set(range(1, 7))
    assert [draw(epoch, seed=8) for epoch in range(60)] != draws
    # Default range: every step.
    assert all(0 <= s < 4 for e in range(20) for s in branch_schedule(e, num_steps=4, steps=(1, 2), schedule="random"))


def test_sliding_branch_steps_move_one_step_and_wrap_by_hand():
    # Pattern (1, 3) spans 2 steps; in range [1, 5] its first step can be 1, 2 or 3; one shift per 2 epochs.
    steps = [branch_schedule(e, num_steps=10, steps=(1, 3), schedule="sliding", branch_range=(1, 5), shift_every=2)
             for e in range(8)]
    assert steps == [(1, 3), (1, 3), (2, 4), (2, 4), (3, 5), (3, 5), (1, 3), (1, 3)]
    # Starting mid-range: epoch 0 is the configured pattern, each epoch one step later, wrapping to 0.
    steps = [branch_schedule(e, num_steps=10, steps=(2, 3), schedule="sliding", branch_range=(0, 4)) for e in range(5)]
    assert steps == [(2, 3), (3, 4), (0, 1), (1, 2), (2, 3)]
    assert branch_schedule(9, num_steps=10, steps=(4, 2), schedule="fixed") == (2, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=(0, 1, 2), schedule="random", branch_range=(3, 4)), "do not fit"),
    (dict(steps=(0,), schedule="random", branch_range=(2, 10)), "invalid"),
    (dict(steps=(0,), schedule="sliding", branch_range=(2, 5)), "inside the range"),
    (dict(steps=(1,), schedule="shuffle"), "unknown branch schedule"),
])
def test_impossible_branch_schedules_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        branch_schedule(0, num_steps=10, **kwargs)


def test_depth_pruning_window_slides_to_the_last_branch_step_by_hand():
    # 10 steps, 3 pruned: the window ends at step 8 -> [6, 8]; one step earlier every 2 epochs; it stops
    # once its first step reaches the last branch step 4.
    windows = [depth_pruned_steps(e, num_steps=10, last_branch=4, size=3, shift_every=2) for e in range(12)]
    assert windows[:6] == [(6, 7, 8), (6, 7, 8), (5, 6, 7), (5, 6, 7), (4, 5, 6), (4, 5, 6)]
    assert set(windows[6:]) == {(4, 5, 6)}
    assert depth_pruned_steps(50, num_steps=10, last_branch=4, size=3) == (6, 7, 8)  # no sliding
    assert depth_pruned_steps(0, num_steps=10, last_branch=4, size=0) == ()
    with pytest.raises(ValueError, match="does not fit"):
        depth_pruned_steps(0, num_steps=10, last_branch=7, size=3)


def test_step_plan_follows_the_configured_schedule_and_defaults_stay_fixed():
    fixed = load_config(Config, SMOKE, ["sampling.tree.branch_steps=[1]"]).sampling
    assert all(step_plan(fixed, e, 0) == StepPlan(4, branch_steps=(1,), branch_factor=2, split_noise_scale=4.0)
               for e in range(5))
    assert step_plan(load_config(Config, SMOKE).sampling, 3, 0) == StepPlan(4)
    cfg = load_config(Config, SMOKE, ["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=random",
                                      "sampling.tree.branch_range=[0,2]", "sampling.tree.prune_depth=1"]).sampling
    plans = [step_plan(cfg, e, 5) for e in range(20)]
    assert [p.branch_steps for p in plans] == [branch_schedule(e, num_steps=4, steps=(0,), schedule="random",
                                                               branch_range=(0, 2), seed=5) for e in range(20)]
    assert {p.branch_steps for p in plans} == {(0,), (1,), (2,)}
    assert all(p.pruned_steps == (2,) and p.leaves_per_root == 2 for p in plans)


# --- pruning masks -------------------------------------------------------------------------------------------

def test_extreme_leaves_by_hand():
    nan = float("nan")
    rewards = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3, nan, 0.2, 0.4])
    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    # Group 0 keeps 3: the 2 best (0.9 row 1, 0.7 row 3) and the worst (0.1 row 2). Group 1 has only 2 finite
    # rewards (rows 6, 7): both kept; the NaN row 5 could not be ranked and is never kept.
    assert extreme_leaves(rewards, groups, 3).tolist() == [False, True, True, True, False, False, True, True]
    # Keep 2 = best + worst; among ties the worst is the first row, the best the last.
    assert extreme_leaves(torch.ones(4), torch.zeros(4, dtype=torch.long), 2).tolist() == [True, False, False, True]


def test_width_pruning_spares_shared_edges_by_hand():
    # One group, two roots of 2 leaves (one branch before step 1): column 0 (step 0) is each root's edge,
    # shared by a pair; columns 1, 2 (steps 1, 2) are the leaves' own.
    edges = torch.tensor([[0, 2, 6], [0, 3, 7], [1, 4, 8], [1, 5, 9]])
    steps = torch.tensor([0, 1, 2])
    groups = torch.zeros(4, dtype=torch.long)
    rewards = torch.tensor([0.2, 0.8, 0.5, 0.1])
    # Keep 2: best row 1 (0.8), worst row 3 (0.1); rows 0 and 2 keep only their shared root edges.
    mask = prune_mask(rewards, groups, edges, steps, keep_width=2)
    assert mask.int().tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    # Depth pruning step 2 removes that column for every row; a step outside the stored ones changes nothing.
    mask = prune_mask(rewards, groups, edges, steps, keep_width=2, pruned_steps=(2, 7))
    assert mask.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert prune_mask(rewards, groups, edges, steps).all()  # nothing configured: nothing pruned


# --- config checks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["sampling.tree.schedule=random"], "sampling.tree.schedule"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=random", "sampling.tree.branch_range=[1,4]"],
     "sampling.tree.branch_range"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=random", "sampling.tree.branch_range=[2,1]"],
     "sampling.tree.branch_range"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.branch_range=[0,2]"], "sampling.tree.branch_range"),
    (["sampling.tree.branch_steps=[0,1]", "sampling.tree.schedule=random", "sampling.tree.branch_range=[2,2]"],
     "sampling.tree.branch_steps"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=sliding", "sampling.tree.branch_range=[1,2]"],
     "sampling.tree.branch_steps"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=sliding", "sampling.tree.shift_every=0"],
     "sampling.tree.shift_every"),
    (["sampling.tree.branch_steps=[1]", "sampling.tree.prune_width=8"], "sampling.tree.prune_width"),
    (["sampling.tree.branch_steps=[1]", "sampling.tree.prune_width=1"], "sampling.tree.prune_width"),
    (["sampling.tree.prune_width=2"], "sampling.tree.prune_width"),
    (["sampling.tree.prune_depth=1"], "sampling.tree.prune_depth"),
    (["sampling.tree.branch_steps=[1]", "sampling.tree.prune_depth=3"], "sampling.tree.prune_depth"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=random", "sampling.tree.branch_range=[0,2]",
      "sampling.tree.prune_depth=2"], "sampling.tree.prune_depth"),  # a branch at step 2 leaves room for 1
    (["sampling.tree.branch_steps=[1]", "sampling.tree.prune_depth=1", "sampling.tree.prune_depth_shift_every=-1"],
     "sampling.tree.prune_depth_shift_every"),
    (["sampling.tree.branch_steps=[1]", "sampling.tree.prune_depth_shift_every=2"],
     "sampling.tree.prune_depth_shift_every"),
    (["sampling.tree.branch_steps=[0]", "sampling.tree.schedule=random", "sampling.window.size=2",
      "sampling.window.mode=fixed", "sampling.window.start_range=[1,1]"], "sampling.tree.branch_steps"),
])
def test_bad_tree_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(Config, SMOKE, overrides)
    assert "\n" not in str(error.value) and key in str(error.value)


def test_good_tree_settings_load():
    cfg = load_config(Config, SMOKE, ["sampling.tree.branch_steps=[1]", "sampling.tree.schedule=sliding",
                                      "sampling.tree.branch_range=[0,2]", "sampling.tree.shift_every=3",
                                      "sampling.tree.prune_width=4", "sampling.tree.prune_depth=1",
                                      "sampling.tree.prune_depth_shift_every=5"])
    assert cfg.sampling.tree.schedule == "sliding" and cfg.sampling.tree.prune_width == 4


# --- the recipe ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["train.loss=tmpo", "train.beta=0"]])
def test_grpo_trains_on_a_random_tree_schedule(tmp_path, monkeypatch, extra):
    """Two epochs whose trees branch at different steps (seed 0 draws step 2, then step 0)."""
    import sys

    from flowrl.recipes.grpo import train

    seen = []
    # the recipe samples through chunked_rollout, which calls its own module's rollout
    sampling = sys.modules["flowrl.sampling.rollout"]
    real_rollout = sampling.rollout

    def recording_rollout(policy, prompts, settings, **kwargs):
        seen.append(settings.plan.branch_steps)
        return real_rollout(policy, prompts, settings, **kwargs)

    monkeypatch.setattr(sampling, "rollout", recording_rollout)
    captured = capture_training_policy(monkeypatch)
    cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false",
                                      "log.eval_every=0", "log.report_prompts=0", "train.export_lora=false",
                                      "sampling.tree.branch_steps=[0]", "sampling.tree.branch_factor=2",
                                      "sampling.tree.schedule=random", "sampling.tree.branch_range=[0,2]", *extra])
    metrics = train(cfg)
    expected = [branch_schedule(e, num_steps=4, steps=(0,), schedule="random", branch_range=(0, 2), seed=cfg.seed)
                for e in range(2)]
    assert seen == expected and expected[0] != expected[1]  # the tree moved between the epochs
    assert math.isfinite(metrics["loss/total"])
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    lora_before, _ = captured["before"]
    lora_after, _ = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)


def test_width_pruning_trains_fewer_transitions_in_a_real_run(tmp_path):
    """4 leaves per root, 2 roots per group of 8: keeping 2 leaves of each group drops the own (last-level)
    edges of the other 6 leaves, so fewer of the stored transitions train than without pruning."""
    from flowrl.recipes.grpo import train

    fractions = {}
    for width in (0, 2):
        cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path / str(width)}", "train.epochs=1", "log.progress=false",
                                          "log.eval_every=0", "log.report_prompts=0", "train.export_lora=false",
                                          "sampling.group_size=8", "sampling.tree.branch_steps=[0,2]",
                                          "sampling.tree.branch_factor=2", f"sampling.tree.prune_width={width}"])
        fractions[width] = train(cfg)["policy/trained_fraction"]
    assert 0 < fractions[2] < fractions[0]
