"""Pilot-Commit rollout allocation: the pure choice by hand, the seed layout, and GRPO / NFT runs whose
batches are piloted (groups of full size, unique ids and seeds, the highest-variance candidates
committed, their pilot rollouts kept), plus the config errors."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch

from flowrl.algorithms.advantages import group_variances
from flowrl.config import Config, ConfigError, load_config
from flowrl.sampling import root_seeds
from flowrl.sampling.pilot import commit_candidates, slot_seeds
from tools.policy_capture import capture_training_policy, lora_and_base

SMOKE = "configs/smoke/sd3_tiny.yaml"
# The smoke config has group_size 4 and 2 prompts per batch: pilot 4 candidates with 2 rollouts each.
PILOT = ["sampling.pilot.candidates=4", "sampling.pilot.group_size=2"]
FLAT_WORD = "on"


class BrightUnlessOn:
    """Brightness, except a constant 0.5 for prompts with the word 'on': those candidates' pilot
    rewards never vary, so Pilot-Commit must skip them whenever enough others vary."""

    name = "bright_unless_on"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        bright = images.float().mean(dim=(1, 2, 3))  # [N]
        flat = torch.tensor([FLAT_WORD in p.split() for p in prompts])
        return {self.name: torch.where(flat, torch.full_like(bright, 0.5), bright)}


def smoke_config(tmp_path, *overrides):
    base = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0",
            "log.report_prompts=0", "train.export_lora=false",
            "rewards=[{name: 'tests.sampling.test_pilot:BrightUnlessOn'}]"]
    return load_config(Config, SMOKE, base + PILOT + list(overrides))


# -- the pure allocation ------------------------------------------------------------------------------------

def test_pilot_variances_by_hand():
    rewards = torch.tensor([1.0, 1.0,  # candidate 0: equal -> exactly 0
                            0.0, 1.0,  # candidate 1: mean 0.5, var (0.25 + 0.25) / 2 = 0.25
                            math.nan, 3.0,  # candidate 2: one finite reward -> 0
                            0.1, 0.1, 0.1,  # candidate 3: equal (a float mean need not be exact) -> exactly 0
                            1.0, 2.0, math.nan, 4.0])  # 4: finite 1, 2, 4; mean 7/3; var (16 + 1 + 25) / 27 = 14/9
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4])
    variances = group_variances(rewards, ids, 6)  # candidate 5 has no rows -> 0
    expected = torch.tensor([0.0, 0.25, 0.0, 0.0, 14 / 9, 0.0], dtype=torch.float64)
    assert torch.allclose(variances, expected, rtol=0, atol=1e-12)
    assert (variances[[0, 2, 3, 5]] == 0).all()  # exactly zero, not merely small


def test_commit_takes_the_highest_variance_and_skips_zero_variance():
    variances = torch.tensor([0.0, 0.25, 0.0, 1.0, 0.04])
    assert commit_candidates(variances, 2).tolist() == [1, 3]  # the two largest, in candidate order
    assert commit_candidates(variances, 3).tolist() == [1, 3, 4]  # every varying one before any zero


def test_commit_fills_with_zero_variance_candidates_in_candidate_order():
    # Only candidate 1 varies; 3 are needed: fill with the first zero-variance candidates, 0 then 2.
    variances = torch.tensor([0.0, 0.5, 0.0, 0.0])
    assert commit_candidates(variances, 3).tolist() == [0, 1, 2]
    assert commit_candidates(torch.zeros(3), 3).tolist() == [0, 1, 2]  # all collapsed: batch shape kept
    # Ties among varying candidates also go in candidate order: deterministic.
    assert commit_candidates(torch.tensor([0.3, 0.1, 0.3, 0.3]), 2).tolist() == [0, 2]
    with pytest.raises(ValueError):
        commit_candidates(variances, 5)


def test_pilot_and_commit_seeds_split_each_candidates_group_slot():
    seed, first, group, pilot = 7, 40, 4, 2
    pilot_seeds = slot_seeds(seed, first, range(3), group, 0, pilot)
    commit_seeds = slot_seeds(seed, first, [0, 2], group, pilot, group)
    assert len(set(pilot_seeds) | set(commit_seeds)) == 3 * 2 + 2 * 2  # unique across both passes
    # A committed group has exactly the seeds of candidate 2's full group (root rows 48..51).
    assert pilot_seeds[4:6] + commit_seeds[2:4] == root_seeds(seed, first + 2 * group, group)


# -- runs ---------------------------------------------------------------------------------------------------

def _record_sampling(monkeypatch, recipe_module):
    """Record every rollout call of sample_and_score and every trajectory it returns."""
    import flowrl.recipes.rollouts as rollouts

    calls, trajs = [], []
    real_rollout, real_sample = rollouts.rollout, recipe_module.sample_and_score

    def recording_rollout(policy, prompts, settings, **kwargs):
        traj = real_rollout(policy, prompts, settings, **kwargs)
        calls.append((kwargs["group_size"], traj))  # rewards are attached to the same object later
        return traj

    def recording_sample(*args, **kwargs):
        out = real_sample(*args, **kwargs)
        trajs.append(out[0])
        return out

    monkeypatch.setattr(rollouts, "rollout", recording_rollout)
    monkeypatch.setattr(recipe_module, "sample_and_score", recording_sample)
    return calls, trajs


def _check_piloted_batches(calls, trajs, *, candidates=4, pilot_size=2, group_size=4, per_batch=2):
    """Every epoch: groups of full size with unique ids; the committed candidates are the highest-variance
    ones and keep their scored pilot rows; seeds never repeat. Returns the number of zero-variance candidates."""
    key = BrightUnlessOn.name
    pilots = [t for size, t in calls if size == pilot_size and len(t.prompts) == candidates]
    commits = [t for size, t in calls if size == group_size - pilot_size and len(t.prompts) == per_batch]
    assert len(pilots) == len(commits) == len(trajs)  # one batch per epoch
    all_seeds = torch.cat([t.seeds for _, t in calls])
    assert all_seeds.unique().numel() == all_seeds.numel()  # unique across pilot, commit and epochs
    seen_groups, zero = set(), 0
    for pilot, traj in zip(pilots, trajs):
        assert traj.num_rows == per_batch * group_size
        groups, counts = traj.group_ids.unique(return_counts=True)
        assert counts.tolist() == [group_size] * per_batch
        assert not seen_groups & set(groups.tolist())
        seen_groups |= set(groups.tolist())
        variances = group_variances(pilot.rewards[key], pilot.prompt_ids, candidates)
        zero += int((variances == 0).sum())
        expected = commit_candidates(variances, per_batch).tolist()
        committed = []
        for g in groups.tolist():
            rows = (traj.group_ids == g).nonzero().flatten()
            assert traj.prompt_ids[rows].unique().numel() == 1
            head = traj.seeds[rows[:pilot_size]]
            candidate = int(pilot.prompt_ids[pilot.seeds.tolist().index(int(head[0]))])
            pilot_rows = (pilot.prompt_ids == candidate).nonzero().flatten()
            assert torch.equal(head, pilot.seeds[pilot_rows])  # the candidate's pilot rollouts stay ...
            assert torch.equal(traj.rewards[key][rows[:pilot_size]], pilot.rewards[key][pilot_rows])  # ... scored
            assert traj.prompts[int(traj.prompt_ids[rows[0]])] == pilot.prompts[candidate]
            committed.append(candidate)
        assert sorted(committed) == expected
        if (variances > 0).sum() >= per_batch:
            assert all(variances[c] > 0 for c in committed)  # a collapsed candidate is skipped
        assert traj.rollouts_sampled == candidates * pilot_size + per_batch * (group_size - pilot_size)
        assert traj.sampling_metrics["perf/rollouts_saved"] == (candidates - per_batch) * (group_size - pilot_size)
        assert traj.sampling_metrics["perf/pilot_zero_std"] == float((variances == 0).sum()) / candidates
    return zero


def test_grpo_smoke_run_with_pilot_commit(tmp_path, monkeypatch):
    import flowrl.recipes.grpo as grpo

    captured = capture_training_policy(monkeypatch)
    calls, trajs = _record_sampling(monkeypatch, grpo)
    metrics = grpo.train(smoke_config(tmp_path))
    assert math.isfinite(metrics["loss/total"]) and math.isfinite(metrics["reward/bright_unless_on_mean"])
    lora_before, _ = captured["before"]
    lora_after, _ = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    zero = _check_piloted_batches(calls, trajs)
    assert zero >= 1  # the 'on' prompts made the skip rule bite in this run


def test_nft_smoke_run_with_pilot_commit(tmp_path, monkeypatch):
    import flowrl.recipes.nft as nft

    calls, trajs = _record_sampling(monkeypatch, nft)
    metrics = nft.train(smoke_config(tmp_path, "recipe=nft", "train.learning_rate=1e-3"))
    assert math.isfinite(metrics["loss/total"])
    _check_piloted_batches(calls, trajs)


def test_pilot_sampling_is_deterministic_and_off_by_default(tmp_path):
    from flowrl.sampling.epoch_plan import step_plan
    from flowrl.recipes.rollouts import sample_and_score
    from flowrl.recipes.start import start_run
    from flowrl.rewards_api import AsyncScorer

    cfg = smoke_config(tmp_path, "train.batches_per_epoch=2")
    run = start_run(cfg)
    scorer = AsyncScorer(run.rewards, asynchronous=False)
    plan = step_plan(cfg.sampling, 0, cfg.seed)
    first, again = (sample_and_score(run, scorer, 3, plan=plan, noise_level=0.7)[0] for _ in range(2))
    for name in ("seeds", "group_ids", "prompt_ids", "latents", "log_probs"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert first.prompts == again.prompts
    # Two batches per epoch: epoch 3 owns the batch slots 6 and 7, i.e. groups 12..15.
    assert first.group_ids.unique().tolist() == [12, 13, 14, 15]
    assert first.seeds.unique().numel() == first.num_rows == 16
    assert first.sampling_metrics["perf/rollouts_saved"] == 2 * (4 - 2) * 2  # 2 skipped x 2 rollouts x 2 batches
    assert first.rollouts_sampled == 2 * (4 * 2 + 2 * 2)

    off = load_config(Config, SMOKE, [f"run_dir={tmp_path / 'off'}"])
    assert not off.sampling.pilot.candidates
    assert not load_config(Config, SMOKE, ["sampling.pilot.candidates=null"]).sampling.pilot.candidates
    run.cfg = off
    plain = sample_and_score(run, scorer, 3, plan=plan, noise_level=0.7)[0]
    assert plain.sampling_metrics == {} and plain.rollouts_sampled == plain.num_rows == 8
    scorer.close()


@pytest.mark.parametrize("overrides, key", [
    (["sampling.pilot.candidates=1"], "sampling.pilot.candidates"),  # fewer than prompts_per_batch=2
    (["sampling.pilot.candidates=-1"], "sampling.pilot.candidates"),
    (["sampling.pilot.group_size=1"], "sampling.pilot.group_size"),  # no variance from one rollout
    (["sampling.pilot.group_size=4"], "sampling.pilot.group_size"),  # = group_size: nothing left to commit
    (["sampling.tree.branch_steps=[1]", "sampling.tree.branch_factor=2"], "sampling.pilot.candidates"),
    (["sampling.same_noise_in_group=true"], "sampling.pilot.candidates"),
])
def test_bad_pilot_config_names_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'") as error:
        smoke_config(tmp_path, *overrides)
    assert "\n" not in str(error.value)
