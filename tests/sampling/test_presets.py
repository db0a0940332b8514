"""Method presets and the solver of the steps outside the SDE window.

- Every preset config (Flow-GRPO-Fast, MixGRPO, MixGRPO-Flash, early-step focus, CPS; SD3.5-M and
  FLUX.1-dev) loads and has the window, solver and step kind its header claims.
- ``sampling.ode_solver``: on a linear "policy" whose probability-flow ODE is solved by hand,
  DPM-Solver++(2M) (``dpmpp_2m``: on every deterministic step) is far more accurate than Euler at
  the same step count and converges at second order; with ``euler`` a rollout is bit-identical to the
  Euler loop written out by hand; ``dpmpp_2m`` restarts after the window; stored SDE steps keep
  exact log-probs (the on-policy ratio). MixGRPO-Flash's ``mixgrpo_flash`` is held to its reference in
  tests/sampling/test_reference_windows.py.
- A GRPO smoke run with a sliding window and the second-order solver trains on-policy.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
import typing
from dataclasses import replace

import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.config import Config, ConfigError, SamplingConfig, load_config
from flowrl.models import build_policy
from flowrl.models.base import TextCond
from flowrl.sampling import RolloutSettings, StepPlan, rollout, sde_step
from flowrl.core.seeding import derive_seed, generators
from flowrl.sampling.steps import ODE_SOLVERS, dpmpp_2m_ode_step, euler_ode_step
from tests import REPO

SMOKE = "configs/smoke/sd3_tiny.yaml"

# preset -> what its header claims, as dotted config keys
PRESETS = {
    # SD3.5 Medium (Flow-GRPO-Fast and MixGRPO ship as grpo_ocr_fast.yaml and grpo_mixgrpo.yaml)
    "configs/sd35_medium/grpo_ocr_fast.yaml": {
        "sampling.kind": "cps", "sampling.noise_level": 0.8, "sampling.ode_solver": "euler", "sampling.window.size": 3,
        "sampling.window.mode": "random", "sampling.window.start_range": [0, 2], "train.clip_range": 1e-5,
        "train.beta": 0.0, "train.cfg": False, "train.skip_last_step": None},
    "configs/sd35_medium/grpo_mixgrpo.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "euler", "sampling.window.size": 3,
        "sampling.window.mode": "sliding", "sampling.window.start_range": [0, 6], "sampling.window.shift_every": 25},
    "configs/sd35_medium/grpo_mixgrpo_flash.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "mixgrpo_flash", "sampling.window.size": 3,
        "sampling.window.mode": "sliding", "sampling.window.start_range": [0, 6], "sampling.window.shift_every": 20},
    "configs/sd35_medium/grpo_early_steps.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "euler", "sampling.window.size": 4,
        "sampling.window.mode": "fixed", "sampling.window.start_range": [0, 0], "train.clip_range": 1e-5},
    "configs/sd35_medium/grpo_cps.yaml": {
        "sampling.kind": "cps", "sampling.noise_level": 0.8, "sampling.window.size": 3,
        "sampling.window.mode": "random", "sampling.window.start_range": [0, 2], "train.clip_range": 1e-5,
        "train.beta": 0.0, "train.cfg": False, "sampling.group_size": 18},
    # FLUX.1 [dev]
    "configs/flux1_dev/grpo_pickscore_fast.yaml": {
        "sampling.kind": "cps", "sampling.noise_level": 0.8, "sampling.num_steps": 6, "sampling.ode_solver": "euler",
        "sampling.window.size": 3, "sampling.window.mode": "random", "sampling.window.start_range": [0, 0],
        "train.clip_range": 1e-5, "train.beta": 0.0, "train.std_scope": "group", "train.skip_last_step": None},
    "configs/flux1_dev/grpo_mixgrpo.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "euler", "sampling.num_steps": 25,
        "sampling.noise_level": 0.7, "sampling.window.size": 4, "sampling.window.mode": "sliding",
        "sampling.window.start_range": [0, 19], "sampling.window.shift_every": 25, "model.height": 720,
        "sampling.group_size": 12, "sampling.same_noise_in_group": True, "train.clip_range": 1e-4},
    "configs/flux1_dev/grpo_mixgrpo_flash.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "mixgrpo_flash", "sampling.num_steps": 25,
        "sampling.window.size": 4, "sampling.window.mode": "sliding", "sampling.window.start_range": [0, 19],
        "sampling.window.shift_every": 20},
    "configs/flux1_dev/grpo_early_steps.yaml": {
        "sampling.kind": "sde", "sampling.ode_solver": "euler", "sampling.window.size": 4,
        "sampling.window.mode": "fixed", "sampling.window.start_range": [0, 0], "train.clip_range": 1e-5},
    "configs/flux1_dev/grpo_cps.yaml": {
        "sampling.kind": "cps", "sampling.num_steps": 6, "sampling.noise_level": 0.8, "sampling.window.size": 3,
        "sampling.window.mode": "fixed", "sampling.window.start_range": [0, 0], "train.clip_range": 1e-5,
        "train.beta": 0.0},
}


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# -- the presets ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(PRESETS))
def test_preset_loads_with_the_window_solver_and_kind_it_claims(path):
    cfg = load_config(Config, REPO / path)
    for key, value in PRESETS[path].items():
        assert _get(cfg, key) == value, f"{path}: {key} is {_get(cfg, key)!r}, the header claims {value!r}"
    family = "sd3" if "sd35_medium" in path else "flux"
    assert cfg.model.family == family and cfg.recipe == "grpo"
    header = (REPO / path).read_text().split("\n\n")[0]
    assert f"accelerate launch --config_file configs/accelerate/ddp_8gpu.yaml -m flowrl train {path}" in header
    assert "Hardware: 8 GPUs" in header


def test_flash_presets_differ_from_mixgrpo_only_in_the_solver_and_the_shift_interval():
    for folder in ("sd35_medium", "flux1_dev"):
        mix = load_config(Config, REPO / "configs" / folder / "grpo_mixgrpo.yaml")
        flash = load_config(Config, REPO / "configs" / folder / "grpo_mixgrpo_flash.yaml")
        assert (mix.sampling.ode_solver, flash.sampling.ode_solver) == ("euler", "mixgrpo_flash")
        flash.sampling.ode_solver, flash.sampling.window.shift_every = "euler", mix.sampling.window.shift_every
        flash.run_dir = mix.run_dir
        assert flash == mix, folder


def test_schema_names_exactly_the_registered_solvers():
    hints = typing.get_type_hints(SamplingConfig)
    assert set(typing.get_args(hints["ode_solver"])) == set(ODE_SOLVERS)
    assert SamplingConfig().ode_solver == "euler"


def test_unknown_solver_is_a_one_line_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="sampling.ode_solver") as error:
        load_config(Config, REPO / SMOKE, ["sampling.ode_solver=heun"])
    assert "\n" not in str(error.value) and "mixgrpo_flash" in str(error.value)
    with pytest.raises(ValueError, match="unknown ode_solver 'heun'"):
        rollout(GaussianFlow(), ["p"],
                RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.0, ode_solver="heun", decode=False),
                group_size=1, seeds=[0])


# -- the solver on an ODE solved by hand ----------------------------------------------------------------------

class GaussianFlow:
    """The exact flow-matching velocity of data ``x0 ~ N(m, s^2)`` per coordinate: a linear "policy".

    With ``x = (1 - sigma) x0 + sigma eps`` and ``y = x - (1 - sigma) m``, ``V = (1 - sigma)^2 s^2 + sigma^2``,
    the conditional means are ``E[eps | x] = sigma y / V`` and ``E[x0 | x] = m + (1 - sigma) s^2 y / V``, so
    ``v = E[eps - x0 | x] = (sigma - (1 - sigma) s^2) y / V - m``. The ODE ``dx/dsigma = v`` is then solved
    by ``x(sigma) = (1 - sigma) m + sqrt(V(sigma)) x(1)``: differentiating gives
    ``-m + (sigma - (1 - sigma) s^2) x(1) / sqrt(V) = v(x(sigma), sigma)``. At sigma = 0: ``m + s x(1)``.
    """

    device = torch.device("cpu")

    def __init__(self, shift: float = 1.0):
        self.mean = torch.linspace(-0.5, 0.5, 8, dtype=torch.float64).reshape(2, 2, 2)  # [C, h, w]
        self.std = torch.linspace(0.8, 1.2, 8, dtype=torch.float64).reshape(2, 2, 2)  # [C, h, w]
        self.shift = shift

    def encode(self, prompts, metadata=None):
        n = len(prompts)
        return TextCond(prompt_embeds=torch.zeros(n, 1, 1), pooled_prompt_embeds=torch.zeros(n, 1))

    def init_noise(self, n, generator=None):
        return randn_tensor((n, 2, 2, 2), generator=generator, dtype=torch.float64)  # [n, C, h, w]

    def sigmas(self, num_steps):
        """Uniform in t, then SD3's static time shift ``shift t / (1 + (shift - 1) t)``; ends at 0."""
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
        return self.shift * t / (1 + (self.shift - 1) * t)

    def velocity(self, x, sigma, cond, guidance_scale):
        var = (1 - sigma) ** 2 * self.std**2 + sigma**2
        return (sigma - (1 - sigma) * self.std**2) * (x - (1 - sigma) * self.mean) / var - self.mean

    def exact_clean(self, x1):
        return self.mean + self.std * x1


def _ode_error(policy, num_steps, solver, rows=16):
    """Max |x_0 - exact| of a rollout whose steps are all deterministic: the solver's steps, then a last
    noise-free "SDE" step (noise_level 0: the Euler step to sigma 0, which returns the x0 prediction)."""
    seeds = list(range(rows))
    settings = RolloutSettings(num_steps=num_steps, guidance_scale=1.0, noise_level=0.0,
                               plan=StepPlan(num_steps, sde_start=num_steps - 1), ode_solver=solver, decode=False)
    traj = rollout(policy, ["p"], settings, group_size=rows, seeds=seeds)
    x1 = policy.init_noise(rows, generator=generators(seeds))
    return (traj.final_latents - policy.exact_clean(x1)).abs().max().item()


@pytest.mark.parametrize("shift, num_steps, factor", [(1.0, 10, 10.0), (3.0, 20, 4.0)])
def test_second_order_solver_is_far_more_accurate_than_euler_at_equal_steps(shift, num_steps, factor):
    # Measured (float64): uniform 10 steps 0.256 vs 0.0128 (20x); SD3 shift 3, 20 steps 0.187 vs 0.0229 (8x).
    policy = GaussianFlow(shift)
    euler, second = _ode_error(policy, num_steps, "euler"), _ode_error(policy, num_steps, "dpmpp_2m")
    assert second < euler / factor, (euler, second)


def test_euler_converges_at_first_order_and_dpmpp_2m_at_second():
    # Halving the step divides the global error by ~2 for a first-order method, by ~4 for a second-order
    # one (measured 40 -> 80 uniform steps: Euler 1.98x, DPM-Solver++(2M) 3.35x; the first and last
    # steps are first order, which costs only a constant).
    policy = GaussianFlow()
    euler = _ode_error(policy, 40, "euler") / _ode_error(policy, 80, "euler")
    second = _ode_error(policy, 40, "dpmpp_2m") / _ode_error(policy, 80, "dpmpp_2m")
    assert 1.8 < euler < 2.2 and second > 3.0, (euler, second)


def test_one_dpmpp_2m_step_by_hand():
    # sigma 0.5 -> 0.25 after a step from 0.75. lambda = log((1 - sigma) / sigma): -log 3, 0, log 3, so
    # h = h_prev = log 3 and the correction weight h / (2 h_prev) is 1/2. sigma'/sigma = 1/2 and
    # alpha' - sigma' alpha / sigma = 0.75 - 0.25 = 1/2. With x = 2, v = 1: x0 = 2 - 0.5 = 1.5; the previous
    # x0 was 1, so D = 1.5 + (1.5 - 1) / 2 = 1.75 and x' = 2 / 2 + 1.75 / 2 = 1.875.
    x, v = torch.full((1, 3), 2.0, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    prev, history = dpmpp_2m_ode_step(v, x, 0.5, 0.25, (torch.ones(1, 3, dtype=torch.float64), 0.75))
    torch.testing.assert_close(prev, torch.full((1, 3), 1.875, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(history[0], torch.full((1, 3), 1.5, dtype=torch.float64), rtol=0, atol=0)
    # Without history it is first order: 2 / 2 + 1.5 / 2 = 1.75, the Euler step 2 + (0.25 - 0.5) * 1.
    first, _ = dpmpp_2m_ode_step(v, x, 0.5, 0.25, None)
    torch.testing.assert_close(first, euler_ode_step(v, x, 0.5, 0.25)[0], rtol=0, atol=1e-12)
    # After a step from sigma = 1 (lambda = -inf) and into sigma = 0 (lambda = +inf) the weight is 0.
    after_one, _ = dpmpp_2m_ode_step(v, x, 0.5, 0.25, (torch.zeros(1, 3, dtype=torch.float64), 1.0))
    torch.testing.assert_close(after_one, first, rtol=0, atol=1e-12)
    last, _ = dpmpp_2m_ode_step(v, x, 0.5, 0.0, (torch.zeros(1, 3, dtype=torch.float64), 0.75))
    torch.testing.assert_close(last, x - 0.5 * v, rtol=0, atol=1e-12)  # sigma' = 0: the x0 prediction
    # Low-precision inputs: computed in float32, returned in the input dtype.
    low, low_history = dpmpp_2m_ode_step(v.bfloat16(), x.bfloat16(), 0.5, 0.25, None)
    assert low.dtype == torch.bfloat16 and low_history[0].dtype == torch.float32


# -- the solver inside a real rollout ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd3():
    return build_policy("sd3", "tiny", seed=0)


def test_euler_rollout_is_bit_identical_to_the_euler_loop_written_out(sd3):
    """The rollout before ``ode_solver`` existed: Euler outside the window, Flow-GRPO SDE inside it."""
    steps, seeds, prompts = 7, [3, 4, 5, 6], ["a red circle", "two blue squares"]
    plan = StepPlan(steps, sde_start=3, sde_size=2)
    settings = RolloutSettings(num_steps=steps, guidance_scale=4.5, noise_level=0.7, plan=plan)
    rows = dict(group_size=2, seeds=seeds)
    euler = rollout(sd3, prompts, replace(settings, ode_solver="euler"), **rows)
    default = rollout(sd3, prompts, settings, **rows)
    cond = sd3.encode(prompts).select([0, 0, 1, 1])
    sigmas = sd3.sigmas(steps)
    x = sd3.init_noise(4, generator=generators(seeds))
    stored, log_probs = [], []
    for i in range(steps):
        v = sd3.velocity(x, sigmas[i], cond, 4.5)
        if i in plan.sde_steps:
            stored = stored or [x]
            out = sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=0.7,
                           generator=[torch.Generator().manual_seed(derive_seed(s, i + 1)) for s in seeds])
            stored.append(out.prev_sample)
            log_probs.append(out.log_prob)
        else:
            out = sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=0.0, kind="ode")
        x = out.prev_sample
    for traj in (euler, default):
        assert torch.equal(traj.final_latents, x)
        assert torch.equal(traj.latents, torch.stack(stored, dim=1))
        assert torch.equal(traj.log_probs, torch.stack(log_probs, dim=1).float())
        assert torch.equal(traj.images, euler.images)


def test_dpmpp_2m_rollout_keeps_exact_log_probs_and_restarts_after_the_window(sd3):
    steps, seeds, prompts = 8, [1, 2], ["a red circle"]
    plan = StepPlan(steps, sde_start=4, sde_size=2)
    settings = RolloutSettings(num_steps=steps, guidance_scale=4.5, noise_level=0.7, plan=plan)
    rows = dict(group_size=2, seeds=seeds)
    second = rollout(sd3, prompts, replace(settings, ode_solver="dpmpp_2m"), **rows)
    euler = rollout(sd3, prompts, settings, **rows)
    # Before the window steps 2 and 3 are second order: the window starts from another state than Euler's.
    assert not torch.allclose(second.latents[:, 0], euler.latents[:, 0], rtol=0, atol=1e-4)
    # Stored transitions are the SDE's: recomputing each log-prob from the stored latents gives it exactly.
    cond = second.cond.select(second.prompt_ids)
    for k in range(second.num_stored_steps):
        v = sd3.velocity(second.latents[:, k], second.sigmas[k], cond, 4.5)
        again = sde_step(v, second.latents[:, k], second.sigmas[k], second.sigmas[k + 1], noise_level=0.7,
                         prev_sample=second.latents[:, k + 1])
        assert torch.equal(again.log_prob, second.log_probs[:, k])
    # After the window the solver restarts: step 6 is first order and step 7 ends at sigma 0 (first order
    # too), so the suffix equals Euler from the window's last state; history from before the window would
    # make step 6 second order instead.
    sigmas, x = sd3.sigmas(steps), second.latents[:, -1]
    for i in range(6, steps):
        x = euler_ode_step(sd3.velocity(x, sigmas[i], cond, 4.5), x, sigmas[i], sigmas[i + 1])[0]
    torch.testing.assert_close(second.final_latents, x, rtol=0, atol=1e-5)


# -- training ---------------------------------------------------------------------------------------------------

def test_grpo_smoke_run_with_a_sliding_window_and_the_second_order_solver(tmp_path, monkeypatch):
    import sys

    from flowrl.recipes.grpo import train

    solvers = []
    # the recipe samples through chunked_rollout, which calls its own module's rollout
    sampling = sys.modules["flowrl.sampling.rollout"]
    real_rollout = sampling.rollout

    def recording_rollout(policy, prompts, settings, **kwargs):
        solvers.append(settings.ode_solver)
        return real_rollout(policy, prompts, settings, **kwargs)

    monkeypatch.setattr(sampling, "rollout", recording_rollout)
    # 6 steps, window of 2 starting at step 3 then 4: Euler before it, DPM-Solver++(2M) after it.
    cfg = load_config(Config, REPO / SMOKE, [
        f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
        "train.export_lora=false", "sampling.num_steps=6", "sampling.ode_solver=mixgrpo_flash", "sampling.window.size=2",
        "sampling.window.mode=sliding", "sampling.window.start_range=[3, 4]", "train.clip_range=1e-5"])
    metrics = train(cfg)
    assert solvers and set(solvers) == {"mixgrpo_flash"}, f"the recipe's rollouts ran with {set(solvers)}: " \
        "it must pass sampling.ode_solver to rollout"
    assert math.isfinite(metrics["loss/total"])
    # The first inner pass is on-policy: the solver moves the window's start state, never a stored transition.
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
