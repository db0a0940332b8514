"""SDE windows against their references: Flow-GRPO-Fast's per-call window and MixGRPO-Flash's sampler.

Flow-GRPO-Fast (yifan123/flow_grpo, ``scripts/train_sd3_fast.py`` @ 74db691 with
``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py``): every sampling call on every process draws
``start = random.randint(r0, r1 - size)`` (inclusive), stores the window's ``size + 1`` states, log-probs and
timesteps per row, and trains every stored step at that row's own timestep, the last schedule step included
when the window reaches it. flowrl: ``sampling.window.mode: random`` with ``start_range = [r0, r1 - size]``.

MixGRPO-Flash (Tencent-Hunyuan/MixGRPO @ e5cdd6a, ``fastvideo/utils/sampling_utils.py``, ``dpm_apply_strategy
post``, ``flow_grpo_sampling``): Euler before and inside the window (the SDE on the window steps), every step up to
the window's end pushing its data prediction ``x - sigma v`` into the DPM-Solver++ history; after the window
DPM-Solver++(2M), midpoint form, first order on the last step. flowrl: ``sampling.ode_solver: mixgrpo_flash``.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.config import Config, ConfigError, load_config
from flowrl.models.base import TextCond
from flowrl.algorithms.credit import same_step_rows, trained_mask
from flowrl.sampling import RolloutSettings, StepPlan, rollout, window_start
from flowrl.core.seeding import generators
from tests import REPO

SMOKE = REPO / "configs/smoke/sd3_tiny.yaml"


def _smoke(tmp_path, *overrides):
    return load_config(Config, SMOKE, [f"run_dir={tmp_path}", "log.progress=false", "log.eval_every=0",
                                       "log.report_prompts=0", "train.export_lora=false", *overrides])


# -- Flow-GRPO-Fast: where the window falls -------------------------------------------------------------------

def test_random_window_is_drawn_per_batch_and_per_process_and_covers_the_reference_range():
    # Flow-GRPO-Fast's pickscore_sd3_fast_nocfg: 10 steps, sde_window_size 3, sde_window_range (0, 5), so
    # random.randint(0, 5 - 3): starts 0, 1 or 2, uniformly.
    draw = lambda epoch, batch, rank: window_start(epoch, num_steps=10, size=3, mode="random",  # noqa: E731
                                                   start_range=(0, 2), seed=11, batch=batch, rank=rank)
    starts = np.array([[[draw(e, b, r) for r in range(4)] for b in range(4)] for e in range(30)])  # [E, B, R]
    assert set(starts.flatten().tolist()) == {0, 1, 2}
    counts = np.bincount(starts.flatten(), minlength=3) / starts.size
    assert np.all(np.abs(counts - 1 / 3) < 0.08), counts  # 480 draws: 3 sigma of a uniform share is 0.065
    # Not one draw per epoch: batches of one epoch, and processes of one batch, differ.
    assert sum(len(set(starts[e, :, 0])) > 1 for e in range(30)) > 15
    assert sum(len(set(starts[e, 0, :])) > 1 for e in range(30)) > 15
    # A pure function of (seed, epoch, batch, process): a resumed run redraws the same windows.
    assert draw(7, 2, 3) == starts[7, 2, 3] and draw(7, 2, 3) == draw(7, 2, 3)
    # flowrl's earlier draw stays available under its own name: one start per epoch, whatever the batch.
    per_epoch = [window_start(5, num_steps=10, size=3, mode="random_per_epoch", start_range=(0, 2), seed=11,
                              batch=b, rank=r) for b in range(4) for r in range(4)]
    assert len(set(per_epoch)) == 1


def test_each_rollout_batch_samples_and_records_its_own_window(tmp_path):
    from flowrl.sampling.epoch_plan import step_plan
    from flowrl.recipes.rollouts import sample_and_score
    from flowrl.recipes.start import start_run
    from flowrl.rewards_api import AsyncScorer

    cfg = _smoke(tmp_path, "train.batches_per_epoch=4", "sampling.window.size=2", "sampling.window.mode=random",
                 "sampling.window.start_range=[0, 2]")
    run = start_run(cfg)
    scorer = AsyncScorer(run.rewards, asynchronous=False)
    epoch = 3
    expected = [step_plan(cfg.sampling, epoch, cfg.seed, batch=b, rank=0).sde_start for b in range(4)]
    assert len(set(expected)) > 1, "pick a seed whose batches draw different windows"
    traj = sample_and_score(run, scorer, epoch, plan=step_plan(cfg.sampling, epoch, cfg.seed), noise_level=0.7,
                            batch_windows=True)[0]
    scorer.close()
    rows = cfg.sampling.prompts_per_batch * cfg.sampling.group_size
    sigmas = run.policy.sigmas(cfg.sampling.num_steps)
    for b, start in enumerate(expected):
        part = slice(b * rows, (b + 1) * rows)
        assert traj.row_step_indices[part].tolist() == [[start, start + 1]] * rows
        torch.testing.assert_close(traj.row_sigmas[part], sigmas[start:start + 3].repeat(rows, 1), rtol=0, atol=0)
        torch.testing.assert_close(traj.row_timesteps[part], 1000 * sigmas[start:start + 2].repeat(rows, 1))
    assert not traj.shares_window
    with pytest.raises(ValueError, match="row_sigmas"):
        traj.sigmas  # noqa: B018  (mixed windows have no shared sigma vector)


def test_every_window_step_trains_the_last_schedule_step_included():
    # Flow-GRPO-Fast trains j in range(sde_window_size) for every row: a window [8, 10) of 10 steps trains
    # step 9, the last one. Full-SDE Flow-GRPO trains steps 0..T-2, which the default keeps for full rollouts.
    rows = torch.tensor([[8, 9], [3, 4], [8, 9]])
    window = trained_mask(rows, 10, skip_last_step=False, fraction=1.0, seed=0, epoch=0)
    assert window.all()
    full = trained_mask(torch.arange(10).repeat(2, 1), 10, skip_last_step=True, fraction=1.0, seed=0, epoch=0)
    assert full[:, :9].all() and not full[:, 9].any()
    # The default: skip the last step only for a full-SDE rollout.
    assert load_config(Config, SMOKE).train.skip_last_step is None
    # A micro-batch of mixed windows is run as one model call per schedule step, rows kept in order.
    parts = same_step_rows(rows, torch.tensor([0, 1, 2]), 1)
    assert [p.tolist() for p in parts] == [[0, 2], [1]]


def test_fast_grpo_trains_each_row_at_its_own_sigma_and_the_last_step(tmp_path):
    from flowrl.sampling.epoch_plan import step_plan
    from flowrl.recipes.grpo import train

    # 4 steps, a 2-step window anywhere: windows [2, 4) reach the last step and train it. Three batches per
    # epoch draw different windows, so stored column k is a different step, at a different sigma, by row.
    cfg = _smoke(tmp_path, "train.epochs=1", "train.batches_per_epoch=3", "sampling.window.size=2",
                 "sampling.window.mode=random", "sampling.window.start_range=[0, 2]", "train.clip_range=1e-5",
                 "train.beta=0.04")
    starts = [step_plan(cfg.sampling, 0, cfg.seed, batch=b).sde_start for b in range(3)]
    assert len(set(starts)) > 1 and 2 in starts, starts
    metrics = train(cfg)
    assert math.isfinite(metrics["loss/total"])
    # Every stored step trains (first visit, scored, last step included): with train.skip_last_step=true
    # the windows at start 2 would lose half their steps.
    assert metrics["policy/trained_fraction"] == 1.0
    # The first pass is on-policy: each row's log-prob is recomputed at its own sigmas. Were the loss to read
    # one sigma per column for every row, rows from the other windows would give ratios far from 1.
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5


@pytest.mark.parametrize("credit", ["dense_ode", "dense_cosine"])
def test_dense_credit_runs_on_rows_of_different_windows(tmp_path, credit):
    from flowrl.sampling.epoch_plan import step_plan
    from flowrl.recipes.grpo import train

    # Each row looks ahead from its own window's steps; on-policy ratios stay 1 and every stored step trains.
    lookahead = ["train.dense_lookahead=1"] if credit == "dense_ode" else []
    cfg = _smoke(tmp_path, "train.epochs=1", "train.batches_per_epoch=2", "sampling.window.size=2",
                 "sampling.window.mode=random", "sampling.window.start_range=[0, 2]", "train.clip_range=1e-5",
                 f"train.credit={credit}", *lookahead)
    assert len({step_plan(cfg.sampling, 0, cfg.seed, batch=b).sde_start for b in range(2)}) == 2
    metrics = train(cfg)
    assert math.isfinite(metrics["loss/total"]) and 0 < metrics["advantages/dense_abs_mean"] < math.inf
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5


def test_lookahead_from_rows_of_different_windows_equals_each_window_on_its_own():
    from flowrl.algorithms.dense import lookahead_rewards
    from flowrl.models import build_policy
    from flowrl.sampling import concat_trajectories

    sd3 = build_policy("sd3", "tiny", seed=0)
    settings = RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7, decode=False)
    parts = [rollout(sd3, ["a red circle"], replace(settings, plan=StepPlan(4, sde_start=start, sde_size=2)),
                     group_size=2, seeds=[1 + start, 2 + start]) for start in (0, 2)]
    joined = concat_trajectories(parts)
    schedule = sd3.sigmas(4)
    brightness = lambda images: {"b": images.mean(dim=(1, 2, 3))}  # noqa: E731
    rewards = [lookahead_rewards(sd3, t.latents, schedule, t.row_step_indices, t.cond.select(t.prompt_ids), 4.5,
                                 brightness, states=[0, 1])["b"] for t in (joined, *parts)]
    # Batches of 4 and of 2 round differently (GEMM kernels follow shape and CPU): 1e-5 on brightnesses ~0.56,
    # well under the ~1e-3 between rows.
    torch.testing.assert_close(rewards[0], torch.cat(rewards[1:]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rewards[1], rewards[2])  # the windows' states do differ


def test_per_batch_windows_refuse_a_per_column_step_normalisation():
    # ratio_norm batch_sensitivity scales stored column k by one step's sensitivity: it needs one window per epoch.
    # GRPO-Guard's own normalisation reads each row's sigmas, so it runs on per-batch windows.
    with pytest.raises(ConfigError, match="train.ratio_norm") as error:
        load_config(Config, SMOKE, ["sampling.window.size=2", "sampling.window.mode=random",
                                    "train.ratio_norm=batch_sensitivity"])
    assert "random_per_epoch" in str(error.value) and "\n" not in str(error.value)
    load_config(Config, SMOKE, ["sampling.window.size=2", "sampling.window.mode=random_per_epoch",
                                "train.ratio_norm=batch_sensitivity"])
    load_config(Config, SMOKE, ["sampling.window.size=2", "sampling.window.mode=random", "train.ratio_norm=true"])


# -- MixGRPO-Flash: the solver around the window ----------------------------------------------------------------

class LinearFlow:
    """A linear toy velocity field ``v(x, sigma) = a x + b sigma + c`` per coordinate, float64."""

    device = torch.device("cpu")

    def __init__(self):
        self.a = torch.linspace(0.3, 0.9, 6, dtype=torch.float64).reshape(1, 2, 3)  # [C, h, w]
        self.b = torch.linspace(-0.4, 0.2, 6, dtype=torch.float64).reshape(1, 2, 3)
        self.c = torch.linspace(0.1, -0.5, 6, dtype=torch.float64).reshape(1, 2, 3)

    def encode(self, prompts, metadata=None):
        n = len(prompts)
        return TextCond(prompt_embeds=torch.zeros(n, 1, 1), pooled_prompt_embeds=torch.zeros(n, 1))

    def init_noise(self, n, generator=None):
        return randn_tensor((n, 1, 2, 3), generator=generator, dtype=torch.float64)

    def sigmas(self, num_steps):
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
        return 3 * t / (1 + 2 * t)  # SD3's static shift 3, as MixGRPO's sd3_time_shift(3, t)

    def velocity(self, x, sigma, cond, guidance_scale):
        return self.a * x + self.b * float(sigma) + self.c


def mixgrpo_post_window(x, x0_window_last, sigmas, last, flow):
    """MixGRPO's dpm_step after the window (dpmsolver++, order 2, midpoint), written from its formulas: with
    alpha = 1 - sigma and lambda = log(alpha) - log(sigma), step i takes m0 = x - sigma_i v (pushed into the
    history, whose previous entry m1 is step i-1's data prediction), h = lambda_{i+1} - lambda_i,
    h_0 = lambda_i - lambda_{i-1}, D0 = m0, D1 = (m0 - m1) h / h_0 and
    x' = (sigma_{i+1} / sigma_i) x - alpha_{i+1} (e^-h - 1) (D0 + D1 / 2); the last step is first order, which
    at sigma = 0 returns m0."""
    s = [float(v) for v in sigmas]
    lam = lambda v: math.log(1 - v) - math.log(v) if v > 0 else math.inf  # noqa: E731
    m_prev = x0_window_last  # None: no history (a restarted solver), the first step is first order
    for i in range(last + 1, len(s) - 1):
        m0 = x - s[i] * flow.velocity(x, s[i], None, 1.0)
        if i == len(s) - 2:  # lower_order_final: the last step, to sigma 0, returns the data prediction
            x = m0
        else:
            h, h0 = lam(s[i + 1]) - lam(s[i]), lam(s[i]) - lam(s[i - 1])
            d1 = 0.0 if m_prev is None else (m0 - m_prev) * h / h0
            x = (s[i + 1] / s[i]) * x - (1 - s[i + 1]) * (math.exp(-h) - 1) * (m0 + 0.5 * d1)
        m_prev = m0
    return x


@pytest.mark.parametrize("start", [1, 2])
def test_flash_is_euler_to_the_window_end_then_dpmpp_2m_seeded_by_the_window(start):
    # 6 steps, a window of 2 at `start`; the post-window steps are second order except the last.
    flow, steps, seeds = LinearFlow(), 6, [5, 6, 7]
    plan = StepPlan(steps, sde_start=start, sde_size=2)
    flash = RolloutSettings(num_steps=steps, guidance_scale=1.0, noise_level=0.7, plan=plan,
                            ode_solver="mixgrpo_flash", decode=False)
    traj = rollout(flow, ["p"], flash, group_size=3, seeds=seeds)
    sigmas = flow.sigmas(steps)
    # Before the window: Euler, x' = x + (sigma' - sigma) v, from the initial noise.
    x = flow.init_noise(3, generator=generators(seeds))
    for i in range(start):
        x = x + (sigmas[i + 1] - sigmas[i]) * flow.velocity(x, sigmas[i], None, 1.0)
    torch.testing.assert_close(traj.latents[:, 0], x, rtol=0, atol=1e-12)
    # After the window: MixGRPO's formulas from the window's last state, with the history's previous entry the
    # data prediction of the window's last step at its input state (before its noise).
    last = start + 1
    x_in = traj.latents[:, -2]
    x0_last = x_in - sigmas[last] * flow.velocity(x_in, sigmas[last], None, 1.0)
    expected = mixgrpo_post_window(traj.latents[:, -1], x0_last, sigmas, last, flow)
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=1e-12)
    # The seeded history matters: a solver restarted after the window (first order on its first step) lands
    # elsewhere, and so does Euler.
    restarted = mixgrpo_post_window(traj.latents[:, -1], None, sigmas, last, flow)
    assert (traj.final_latents - restarted).abs().max() > 1e-4
    euler = rollout(flow, ["p"], replace(flash, ode_solver="euler"), group_size=3, seeds=seeds)
    torch.testing.assert_close(euler.latents, traj.latents, rtol=0, atol=0)  # same Euler prefix, same window
    assert (euler.final_latents - traj.final_latents).abs().max() > 1e-4


def test_flash_numbers_by_hand_on_one_coordinate():
    # One coordinate, v = x, x(sigma = 1) = 1, 4 uniform steps sigma 1, 3/4, 1/2, 1/4, 0, a window of one step
    # at step 1 with noise 0 (its SDE step is then the Euler step). lambda = log((1 - sigma) / sigma).
    #   step 0, Euler: x = 1 - 1/4 = 3/4.
    #   step 1, window: data prediction m1 = 3/4 - (3/4)(3/4) = 3/16 at sigma 3/4; x = 3/4 - (1/4)(3/4) = 9/16.
    #   step 2, DPM-Solver++(2M): m0 = 9/16 - (1/2)(9/16) = 9/32; h = lambda(1/4) - lambda(1/2) = log 3 and
    #     h_0 = lambda(1/2) - lambda(3/4) = log 3, so D = m0 + (h / h_0)(m0 - m1) / 2 = 9/32 + 3/64 = 21/64 and
    #     x = (1/4)/(1/2) * 9/16 - (3/4)(e^-h - 1) D = 9/32 + (3/4)(2/3)(21/64) = 9/32 + 21/128 = 57/128.
    #   step 3, last (first order, to sigma 0): the data prediction 57/128 - (1/4)(57/128) = 171/512.
    # Euler throughout gives (3/4)^4 = 81/256; so does a solver restarted after the window (its step 2 is first
    # order, the Euler step). The exact ODE solution is e^-1 = 0.368.
    class One(LinearFlow):
        def __init__(self):
            self.a, self.b, self.c = (torch.full((1, 1, 1), v, dtype=torch.float64) for v in (1.0, 0.0, 0.0))

        def init_noise(self, n, generator=None):
            return torch.ones(n, 1, 1, 1, dtype=torch.float64)

        def sigmas(self, num_steps):
            return torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)

    one_stored = RolloutSettings(num_steps=4, guidance_scale=1.0, noise_level=0.0,
                                 plan=StepPlan(4, sde_start=1, sde_size=1), decode=False)
    final = {solver: rollout(One(), ["p"], replace(one_stored, ode_solver=solver), group_size=1,
                             seeds=[0]).final_latents.item()
             for solver in ("mixgrpo_flash", "euler", "dpmpp_2m")}
    assert final["mixgrpo_flash"] == pytest.approx(171 / 512, abs=1e-12)
    assert final["euler"] == pytest.approx(81 / 256, abs=1e-12)
    assert final["dpmpp_2m"] == pytest.approx(81 / 256, abs=1e-12)
