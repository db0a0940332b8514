"""AWM against its reference (github.com/scxue/advantage_weighted_matching at be51372): the ghuber log-probability
and its per-sample weights by hand, the clipped ratio, the stratified timesteps, the SA-Solver step against
diffusers' SASolverScheduler and the whole loop against the reference's control flow, and the recipe: rollouts
from the trained adapter by SA-Solver, eval and export through the separate 0.99 EMA."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SASolverScheduler
from safetensors.torch import load_file

import flowrl.recipes.finish as finish
import flowrl.algorithms.forward_losses as forward_losses
import flowrl.recipes.nft as nft_recipe
from flowrl.algorithms.awm import awm_loss, awm_policy_loss, matching_log_prob, stratified_indices
from flowrl.config import Config, ConfigError, load_config
from flowrl.sampling.sa_solver import noise_schedule, sa_solver_grid, sa_solver_sample, sa_step

SMOKE = "configs/smoke/sd3_tiny.yaml"


def sd3_sigmas(num_steps: int) -> list[float]:
    """SD3.5's sampling schedule (static shift 3), as the reference's pipeline sets it."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.double().tolist()


# ---- the loss -----------------------------------------------------------------------------------------------

def test_ghuber_log_prob_and_its_per_sample_weights_match_a_hand_computation():
    # The reference: log_prob = -((l + 1e-10)^p - (1e-10)^p) * t / p, l the per-sample MSE, p = 0.25.
    # Sample 1: v - target = 0.25 everywhere, so l = 0.0625, t = 0.5:
    #   (0.0625)^0.25 = 0.5, (1e-10)^0.25 = 10^-2.5 = 0.00316228 -> log_prob = -2 (0.5 - 0.00316228) = -0.99367544
    #   d(-log_prob)/dl = t (l + e)^(p - 1) = 0.5 * 0.0625^-0.75 = 0.5 * 8 = 4
    # Sample 2: v - target = 1, l = 1, t = 0.8: log_prob = -3.2 (1 - 0.00316228) = -3.18988071, weight 0.8 * 1 = 0.8.
    # The two samples' gradients differ 5x in weight where plain MSE weighs them alike.
    target = torch.zeros(2, 4, dtype=torch.float64)
    v = torch.tensor([[0.25] * 4, [1.0] * 4], dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor([0.5, 0.8], dtype=torch.float64)
    log_prob = matching_log_prob(v, target, sigma, weighting="ghuber", power=0.25)
    assert log_prob.tolist() == pytest.approx([-0.99367544, -3.18988071], abs=1e-7)
    # At ratio 1 the surrogate's gradient is -A grad log_prob = A t l^-0.75 grad l, grad l = 2 (v - target) / D.
    awm_policy_loss(log_prob, log_prob.detach(), torch.tensor([1.0, 1.0], dtype=torch.float64),
                    clip_range=1.0).sum().backward()
    assert v.grad[0].tolist() == pytest.approx([4 * 2 * 0.25 / 4] * 4, rel=1e-7)  # 0.5
    assert v.grad[1].tolist() == pytest.approx([0.8 * 2 * 1.0 / 4] * 4, rel=1e-7)  # 0.4
    # uniform is the plain MSE: log_prob = -l.
    assert matching_log_prob(v, target, sigma, weighting="uniform").tolist() == pytest.approx([-0.0625, -1.0])


def test_awm_ratio_is_clipped_pessimistically():
    # rho = exp(-1 - (-1.5)) = e^0.5 = 1.6487213; clip 0.2 -> 1.2.
    # A = 1:  max(-1.6487, -1.2) = -1.2 (clipped: no gradient);  A = -1: max(1.6487, 1.2) = 1.6487 (gradient flows).
    log_prob = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss = awm_policy_loss(log_prob, torch.tensor([-1.5, -1.5]), torch.tensor([1.0, -1.0]), clip_range=0.2)
    assert loss.tolist() == pytest.approx([-1.2, math.exp(0.5)])
    loss.sum().backward()
    assert log_prob.grad.tolist() == pytest.approx([0.0, math.exp(0.5)])


def test_awm_loss_value_and_gradient_with_its_ema_pull():
    # kl_weight 0.5; sample: v = (1, 3), v_old = (0, 1), target = (1, 1), t = 0.5, A = -0.4.
    # l = mean((0, 2)^2) = 2; surrogate at ratio 1: -A = 0.4; pull: mean((1, 2)^2) = 2.5 -> 0.4 + 0.5 * 2.5 = 1.65.
    # d/dv: A t (l + e)^-0.75 * 2 (v - target) / 2 + 0.5 * 2 (v - v_old) / 2
    #     = -0.4 * 0.5 * 2^-0.75 * (0, 2) + 0.5 * (1, 2) = (0.5, 1 - 0.4 * 2^-0.75) = (0.5, 0.76215...)
    v = torch.tensor([[1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    loss = awm_loss(v, torch.tensor([[0.0, 1.0]], dtype=torch.float64), torch.tensor([[1.0, 1.0]], dtype=torch.float64),
                    torch.tensor([-0.4], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64), kl_weight=0.5)
    assert loss.tolist() == pytest.approx([1.65])
    loss.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.5, 1 - 0.4 * 2 ** -0.75], rel=1e-6)


# ---- timesteps --------------------------------------------------------------------------------------------------

class FixedUniform:
    """A numpy-Generator stand-in whose ``random`` returns given draws."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.float64)

    def random(self, shape):
        return self.values.reshape(shape)


def test_stratified_timesteps_are_the_reference_discrete_wo_init_draw():
    # The reference, written out: boundaries = linspace(1, int(14 * 0.9), 7).long() = [1, 2, 4, 6, 8, 10, 12],
    # index = lower + (u * (upper - lower)).long(): strata {1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}.
    u = torch.tensor([0.3, 0.99, 0.0, 0.5, 0.49, 0.51])
    edges = torch.linspace(1, int(14 * 0.9), steps=7).long()
    reference = edges[:-1] + (u * (edges[1:] - edges[:-1])).long()
    assert reference.tolist() == [1, 3, 4, 7, 8, 11]  # 6 + floor(0.5 * 2) = 7, 8 + floor(0.98) = 8
    assert stratified_indices(14, 6, 0.9, FixedUniform(u.numpy())).tolist() == [reference.tolist()]
    # Every index the draw can give: 1 .. 11 of 14. Never sigma = 1 (index 0) nor the last two sigmas.
    drawn = stratified_indices(14, 6, 0.9, np.random.default_rng(0), rows=2000)
    assert set(drawn.ravel().tolist()) == set(range(1, 12))
    strata = [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    assert all(set(drawn[:, j].tolist()) == strata[j] for j in range(6))
    sigmas = torch.tensor(sd3_sigmas(14)[:-1])
    assert sigmas[0] == 1.0 and not set(drawn.ravel().tolist()) & {0, 12, 13}


# ---- SA-Solver -------------------------------------------------------------------------------------------------

def diffusers_sa_solver(grid):
    """diffusers' SASolverScheduler in flow-matching mode, its sigmas replaced by ``grid`` (float64)."""
    scheduler = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", predictor_order=2,
                                  corrector_order=2)
    scheduler.sigmas = torch.tensor(grid, dtype=torch.float64)
    return scheduler


def test_sa_solver_grid_and_noise_window_follow_the_reference():
    sigmas = sd3_sigmas(14)
    grid = sa_solver_grid(sigmas)
    # The reference: t = sigmas; t[-2] = t[-3] / 2; t[0] = 1 - 1e-3; the rest untouched, ending at 0.
    assert grid[0] == pytest.approx(0.999) and grid[-2] == pytest.approx(sigmas[-3] / 2) and grid[-1] == 0
    assert grid[1:-2] == sigmas[1:-2]
    # tau(t) = 0.4 for 0.3 <= t <= 0.9 (t the step's target), else 0.
    assert noise_schedule([1.0, 0.95, 0.9, 0.5, 0.3, 0.2, 0.0], 0.4) == [0, 0, 0.4, 0.4, 0.4, 0, 0]


@pytest.mark.parametrize("tau", [0.0, 0.4])
def test_sa_solver_steps_match_diffusers_sasolver_scheduler(tau):
    # Predictor of order 1 and 2 (stochastic_adams_bashforth_update) and corrector of order 2
    # (stochastic_adams_moulton_update) on the reference's 14-step grid, same inputs and noise.
    grid = sa_solver_grid(sd3_sigmas(14))
    g = torch.Generator().manual_seed(0)
    x, noise = (torch.randn(3, 4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    x0 = [torch.randn(3, 4, 5, generator=g, dtype=torch.float64) for _ in range(3)]  # at grid[3], grid[4], grid[5]
    scheduler = diffusers_sa_solver(grid)
    for order in (1, 2):
        scheduler._step_index, scheduler.model_outputs = 4, [x0[0], x0[1]]  # step grid[4] -> grid[5]
        expected = scheduler.stochastic_adams_bashforth_update(x0[1], sample=x, noise=noise, order=order,
                                                               tau=torch.tensor(tau, dtype=torch.float64))
        ours = sa_step(x, [x0[1], x0[0]][:order], [grid[4], grid[3]][:order], grid[4], grid[5], tau, noise)
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    scheduler._step_index, scheduler.model_outputs = 5, [x0[0], x0[1]]  # corrector of grid[4] -> grid[5]
    expected = scheduler.stochastic_adams_moulton_update(x0[2], last_sample=x, last_noise=noise, this_sample=x,
                                                         order=2, tau=torch.tensor(tau, dtype=torch.float64))
    ours = sa_step(x, [x0[2], x0[1]], [grid[5], grid[4]], grid[4], grid[5], tau, noise)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def gaussian_velocity(mean: float, std: float):
    """The exact flow-matching velocity for data N(mean, std^2): x_t = (1 - t) mean + s_t z along the ODE,
    s_t = sqrt((1 - t)^2 std^2 + t^2)."""
    def velocity(x, t):
        s_t = math.sqrt((1 - t) ** 2 * std ** 2 + t ** 2)
        z = (x - (1 - t) * mean) / s_t
        return -mean + (t - (1 - t) * std ** 2) / s_t * z
    return velocity


def reference_sa_loop(velocity, x, grid, taus, noises):
    """The reference's SASolver.sample(predictor_order=2, corrector_order=2, pc_mode='PEC') control flow (first
    corrector skipped, lower orders at the end, the last step returns the last x0 prediction), its steps taken by
    diffusers' scheduler."""
    scheduler = diffusers_sa_solver(grid)
    steps = len(grid) - 1
    x0s = [x - grid[0] * velocity(x, grid[0])]
    for step in range(1, steps + 1):
        if step == steps:
            return x0s[-1]
        t, tau = grid[step], torch.tensor(taus[step], dtype=torch.float64)
        order = 1 if step == 1 else min(2, steps - step + 1)
        scheduler._step_index, scheduler.model_outputs = step - 1, x0s[-order:]
        predicted = scheduler.stochastic_adams_bashforth_update(x0s[-1], sample=x, noise=noises[step], order=order,
                                                                tau=tau)
        x0_t = predicted - t * velocity(predicted, t)
        if step > 1:
            scheduler._step_index, scheduler.model_outputs = step, x0s[-1:]
            x = scheduler.stochastic_adams_moulton_update(x0_t, last_sample=x, last_noise=noises[step],
                                                          this_sample=predicted, order=min(2, steps - step + 2),
                                                          tau=tau)
        else:
            x = predicted
        x0s.append(x0_t)


def test_sa_solver_loop_matches_the_reference_control_flow_on_diffusers_steps():
    grid = sa_solver_grid(sd3_sigmas(14))
    taus = noise_schedule(grid, 0.4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, dtype=torch.float64, generator=g)
    noises = [torch.randn(64, 1, dtype=torch.float64, generator=g) for _ in grid]
    velocity = gaussian_velocity(0.5, 0.3)
    ours, _ = sa_solver_sample(velocity, x, grid, taus, lambda step: noises[step])
    torch.testing.assert_close(ours, reference_sa_loop(velocity, x, grid, taus, noises), rtol=1e-9, atol=1e-9)


def test_sa_solver_converges_to_the_flow_and_keeps_its_marginals():
    # Data N(0.5, 0.3^2) with its exact velocity; 200 steps of the reference's grid. Without noise the state the
    # last model call sees must be the exact ODE solution x_t = (1 - t) mean + s_t z (z the start, standardised at
    # t = 0.999), closer than Euler gets on the same grid. With tau = 0.4 in [0.3, 0.9] the SDE keeps the
    # marginals: the output, E[x0 | x_t] at t = grid[-2] (the reference's last step), has mean 0.5 and spread
    # (1 - t) std^2 / s_t over 40 000 samples.
    mean, std = 0.5, 0.3
    velocity = gaussian_velocity(mean, std)
    spread = lambda t: math.sqrt((1 - t) ** 2 * std ** 2 + t ** 2)  # noqa: E731
    grid = sa_solver_grid(sd3_sigmas(200))
    t = grid[-2]
    x = torch.linspace(-2, 2, 9, dtype=torch.float64).unsqueeze(1)
    _, predicted = sa_solver_sample(velocity, x, grid, [0.0] * len(grid), lambda step: torch.zeros_like(x))
    exact = (1 - t) * mean + spread(t) * (x - (1 - grid[0]) * mean) / spread(grid[0])
    euler = x.clone()
    for i in range(len(grid) - 2):
        euler = euler + (grid[i + 1] - grid[i]) * velocity(euler, grid[i])
    error = float((predicted - exact).abs().max())
    assert error < 5e-3 and error < float((euler - exact).abs().max()) / 3
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40000, 1, dtype=torch.float64, generator=g)
    out, _ = sa_solver_sample(velocity, x, grid, noise_schedule(grid, 0.4),
                              lambda step: torch.randn(40000, 1, dtype=torch.float64, generator=g))
    assert float(out.mean()) == pytest.approx(mean, abs=0.005)
    assert float(out.std()) == pytest.approx((1 - t) * std ** 2 / spread(t), rel=0.01)


def test_sa_solver_rollout_is_row_seeded_and_keeps_the_clean_samples():
    from flowrl.models import build_policy
    from flowrl.sampling import RolloutSettings, chunked_rollout
    from flowrl.sampling.sa_solver import sa_solver_rollout

    policy = build_policy("sd3", "tiny", seed=0)
    prompts = ["a red circle", "two blue squares"]
    settings = RolloutSettings(num_steps=4, guidance_scale=1.0, noise_level=0.4)
    rows = dict(group_size=4, seeds=list(range(8)))
    whole = sa_solver_rollout(policy, prompts, settings, **rows)
    chunked = chunked_rollout(policy, prompts, settings, chunk=2, rollout_fn=sa_solver_rollout, **rows)
    assert whole.final_latents.shape[0] == 8 and whole.images.shape[0] == 8 and whole.log_probs.abs().sum() == 0
    assert torch.equal(whole.latents[:, 1], whole.final_latents) and torch.equal(whole.group_ids, chunked.group_ids)
    # Chunks of 2 and one batch of 8 pick different GEMM kernels (by shape and CPU), so rounding differs
    # through the 4 steps: 1e-4 on latents of |x| <= ~5; a wrong row's noise moves them by ~1.
    torch.testing.assert_close(chunked.final_latents, whole.final_latents, rtol=1e-4, atol=1e-4)
    # Its noise matters (tau 0.4 on the 4-step grid's points in [0.3, 0.9]) and comes from the row seeds.
    quiet = sa_solver_rollout(policy, prompts, dataclasses.replace(settings, noise_level=0.0), **rows)
    assert not torch.allclose(quiet.final_latents, whole.final_latents)


# ---- the recipe --------------------------------------------------------------------------------------------------

def awm_config(tmp_path, *overrides):
    base = [f"run_dir={tmp_path}", "recipe=nft", "nft.loss=awm", "train.epochs=2", "log.progress=false",
            "log.eval_every=0", "log.report_prompts=0", "train.learning_rate=1e-3", "nft.timesteps_per_sample=2",
            "train.cfg=false"]
    return load_config(Config, SMOKE, base + list(overrides))


def test_awm_rolls_out_the_trained_adapter_with_sa_solver_and_exports_the_eval_ema(tmp_path, monkeypatch):
    runs, rollouts, exported, sigmas, restored = [], [], [], [], []
    real_start, real_rollout, real_export = nft_recipe.start_run, nft_recipe.sa_solver_rollout, finish.export_final_lora
    real_loss = forward_losses.awm_loss

    def start(cfg, accelerator=None, **kwargs):
        runs.append(real_start(cfg, accelerator, **kwargs))
        restored.append({"ema": runs[-1].eval_ema.state_tensors(), "old": runs[-1].ema.state_tensors()})
        return runs[-1]

    def spy_rollout(policy, prompts, settings, **kwargs):
        # The old adapter's EMA swaps its weights in through diffusers' store(); None: the live weights sample.
        rollouts.append((runs[0].ema.model.temp_stored_params is None, settings.noise_level))
        return real_rollout(policy, prompts, settings, **kwargs)

    def spy_loss(velocity, old_velocity, target, advantages, sigma, **kwargs):
        sigmas.append(sigma.detach().cpu())
        return real_loss(velocity, old_velocity, target, advantages, sigma, **kwargs)

    def spy_export(policy, ema, *args, **kwargs):
        exported.append(ema)
        return real_export(policy, ema, *args, **kwargs)

    monkeypatch.setattr(nft_recipe, "start_run", start)
    monkeypatch.setattr(nft_recipe, "sa_solver_rollout", spy_rollout)
    monkeypatch.setattr(forward_losses, "awm_loss", spy_loss)
    monkeypatch.setattr(finish, "export_final_lora", spy_export)
    nft_recipe.train(awm_config(tmp_path))
    run = runs[0]
    assert rollouts and all(live for live, _ in rollouts) and {level for _, level in rollouts} == {0.4}
    # The trained sigmas: the 4-step schedule's index 1 .. int(4 * 0.9) - 1 = 2, never sigma 1 or the last.
    schedule = run.policy.sigmas(4)
    trained = torch.cat(sigmas)
    assert all(torch.isclose(schedule[1:3], s).any() for s in trained)
    # Eval and export use the separate eval EMA (decay 0.99), not the old policy.
    assert run.eval_ema is not None and run.eval_ema.decay == 0.99 and exported == [run.eval_ema]
    assert run.exported_ema is run.eval_ema and set(run.snapshots) == {"old"}
    # The checkpoint's ema.safetensors holds the eval EMA (what `flowrl export-lora` and `flowrl eval` read), the
    # old policy rides along as a snapshot, and a resumed run gets both back.
    checkpoint = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    saved_eval, saved_old = (load_file(str(checkpoint / f"{name}.safetensors")) for name in ("ema", "old"))
    for saved, ema in ((saved_eval, run.eval_ema), (saved_old, run.ema)):
        assert all(torch.equal(saved[k], v) for k, v in ema.state_tensors().items())
    assert any(not torch.equal(saved_eval[k], saved_old[k]) for k in saved_eval)
    runs.clear()
    nft_recipe.train(awm_config(tmp_path, "train.epochs=3", "train.resume=latest"))
    assert runs[0].start_epoch == 2
    for name, saved in (("ema", saved_eval), ("old", saved_old)):
        assert all(torch.equal(saved[k], v) for k, v in restored[-1][name].items()), name


def test_nft_keeps_ode_rollouts_from_the_old_adapter(tmp_path, monkeypatch):
    rollouts = []
    monkeypatch.setattr(nft_recipe, "sa_solver_rollout", lambda *a, **k: rollouts.append(1))
    cfg = awm_config(tmp_path, "nft.loss=nft", "train.epochs=1")
    assert (cfg.nft.choice("sampler"), cfg.nft.choice("rollout_weights"), cfg.nft.choice("eval_ema_decay")) == \
        ("ode", "old", 0.9)  # DiffusionNFT's own eval EMA
    nft_recipe.train(cfg)
    assert not rollouts


def test_awm_config_choices_and_errors(tmp_path):
    awm = awm_config(tmp_path).nft
    assert [awm.choice(k) for k in ("timestep_schedule", "sampler", "rollout_weights", "eval_ema_decay")] == \
        ["stratified", "sa_solver", "trained", 0.99]
    assert (awm.awm_weighting, awm.awm_ghuber_power, awm.awm_clip_range, awm.sa_noise_level, awm.sa_noise_window) \
        == ("ghuber", 0.25, 1.0, 0.4, [0.3, 0.9])
    for override, key in (("nft.awm_clip_range=0", r"nft\.awm_clip_range"),
                          ("nft.sa_noise_window=[0.9,0.3]", r"nft\.sa_noise_window"),
                          ("nft.stratified_fraction=0.4", r"nft\.stratified_fraction"),
                          (["sampling.pilot.candidates=4", "sampling.pilot.group_size=2"],
                           r"sampling\.pilot\.candidates")):
        with pytest.raises(ConfigError, match=key) as error:
            awm_config(tmp_path, *([override] if isinstance(override, str) else override))
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("path", ["configs/toy/awm.yaml", "configs/sd35_medium/awm_geneval.yaml",
                                  "configs/sd35_medium/awm_ocr.yaml"])
def test_awm_presets_carry_the_reference_settings(path):
    cfg = load_config(Config, path)
    n, t = cfg.nft, cfg.train
    assert n.loss == "awm" and n.awm_weighting == "ghuber" and n.awm_ghuber_power == 0.25 and n.awm_clip_range == 1
    assert [n.choice(k) for k in ("timestep_schedule", "sampler", "rollout_weights", "eval_ema_decay")] == \
        ["stratified", "sa_solver", "trained", 0.99]
    assert n.old_decay == [0, 0.0, 0.001, 0.3] and n.awm_kl == 1.0 and n.timesteps_per_sample == 6
    assert (n.sa_noise_level, n.sa_noise_window, n.stratified_fraction) == (0.4, [0.3, 0.9], 0.9)
    assert (t.inner_epochs, t.optimizer_steps_per_epoch, t.advantage_clip, t.std_scope) == (1, 1, 5.0, "global")
    if "sd35" in path:
        assert cfg.sampling.num_steps == 14 and t.learning_rate == 3e-4 and not t.cfg
        assert t.beta == (0.001 if "geneval" in path else 0.003)
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.sampling.group_size) == (32, 64, 24)
        assert dataclasses.asdict(cfg)["log"]["eval_num_steps"] == 40
