"""DiffusionNFT and CRD held to their reference code on small examples.

References (each formula below is written out from them, not taken from flowrl):
- DiffusionNFT: NVlabs/DiffusionNFT at 24af555, ``scripts/train_nft_sd3.py`` (loss, ``return_decay``, the
  0.9 EMA of ``flow_grpo/ema.py``, the ``dpm2`` solver of ``flow_grpo/diffusers_patch/solver.py``) and
  ``config/nft.py``.
- CRD: X-GenGroup/Flow-Factory at a0b2bc5, ``src/flow_factory/trainers/crd.py`` (uniform centring, MSE loss,
  ``adaptive_logp``, ``compute_decay``, reward-adaptive KL) and ``examples/crd/lora/sd3_5/default.yaml``.
"""

import contextlib
from dataclasses import replace
from functools import partial

import pytest
import torch

from flowrl.algorithms.crd import crd_weights, implicit_reward
from flowrl.config import Config, load_config
from flowrl.config.nft import NFTSection
from flowrl.training.stats import StatsAccumulator
from flowrl.algorithms.forward_losses import CrdLoss, forward_process_loss, implicit_log_ratio, noised_sample
from flowrl.recipes.nft import train
from flowrl.training.ema import LoraEMA, decay_schedule, ema_weights


class LinearPolicy:
    """A stand-in policy: ``v = w * x + (guidance - 1) * g`` per channel, ``w`` its one trainable (LoRA-named)
    tensor; the adapter off (``reference``) means ``w = w_base``."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, w, w_base):
        self.w = torch.nn.Parameter(torch.tensor(w))
        self.w_base = torch.tensor(w_base)
        self.g = torch.tensor([0.3, -0.2])

    def velocity(self, x, sigma, cond, guidance):
        return x * self.w.view(1, -1, 1, 1) + (guidance - 1) * self.g.view(1, -1, 1, 1)

    @contextlib.contextmanager
    def reference(self):
        saved = self.w.data.clone()
        self.w.data.copy_(self.w_base)
        try:
            yield
        finally:
            self.w.data.copy_(saved)

    def local_forward(self):
        return contextlib.nullcontext()


def policy_with_old(w, w_old, w_base):
    """The policy at ``w`` and an old adapter (a LoraEMA copy) holding ``w_old``."""
    policy = LinearPolicy(w_old, w_base)
    old = LoraEMA([("w.lora_A.default.weight", policy.w)], decay=0.0)  # copies w_old
    policy.w.data.copy_(torch.tensor(w))
    return policy, old


X0 = torch.tensor([[[[0.5, -1.0], [1.5, 0.2]], [[-0.3, 0.8], [0.1, -0.6]]],
                   [[[1.0, 0.4], [-0.2, 0.9]], [[0.7, -0.5], [0.3, 0.2]]],
                   [[[-0.8, 0.1], [0.6, 1.2]], [[0.2, 0.4], [-1.1, 0.5]]]])  # [3, 2, 2, 2]
SIGMA = torch.tensor([0.8, 0.5, 0.3])  # [3]
SEED = [5, 6, 7]


def reference_velocities(policy, old, *, anchor_guidance):
    """At the noise the recipe draws for SEED: (x_t, target, t, v with grad, v_old, v_ref at anchor_guidance)."""
    xt, target, t = noised_sample(X0, SEED, SIGMA, policy)
    v = policy.velocity(xt, t, None, 1.0)
    with torch.no_grad():
        with old.swapped_in():
            v_old = policy.velocity(xt, t, None, 1.0)
        with policy.reference():
            v_ref = policy.velocity(xt, t, None, anchor_guidance)
    return xt, target, t, v, v_old, v_ref


# --- DiffusionNFT ------------------------------------------------------------------------------------------
def reference_nft_loss(v, v_old, v_ref, x0, xt, t, advantages, *, beta, adv_clip_max, kl_beta):
    """train_nft_sd3.py's loss of one micro-batch, term by term (adaptive weighting in x0-space, the policy loss
    times adv_clip_max, the strength ``beta`` dividing both terms, the KL added afterwards, unscaled)."""
    dims = (1, 2, 3)
    t = t.view(-1, 1, 1, 1)
    r = (advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2.0 + 0.5).clamp(0, 1)
    positive = beta * v + (1 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v
    x0_pos, x0_neg = xt - t * positive, xt - t * negative
    w_pos = (x0_pos.detach() - x0).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
    w_neg = (x0_neg.detach() - x0).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
    positive_loss = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
    negative_loss = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)
    policy_loss = ((r * positive_loss / beta + (1.0 - r) * negative_loss / beta) * adv_clip_max).mean()
    return policy_loss + kl_beta * ((v - v_ref) ** 2).mean(dim=dims).mean()


@pytest.mark.parametrize("strength, kl_beta", [(1.0, 0.0), (0.1, 1e-4), (0.1, 0.5)])
def test_nft_loss_is_the_reference_loss_with_its_scale(strength, kl_beta):
    advantages = torch.tensor([2.5, -7.0, 0.5])  # one beyond the clip
    policy, old = policy_with_old([1.2, -0.4], [1.0, -0.5], [0.9, -0.6])
    scale = NFTSection(strength=strength).policy_loss_scale(advantage_clip=5.0)
    assert scale == pytest.approx(5.0 / strength)  # the default: DiffusionNFT's adv_clip_max / beta
    a = advantages.clamp(-5, 5) / 5  # the recipe's clipped advantage over the clip
    ours = forward_process_loss(policy, partial(ema_weights, old), X0, None, a, torch.ones(3), guidance=1.0, strength=strength,
                                adaptive=True, beta=kl_beta, noise_seed=SEED, stats=StatsAccumulator(),
                                sigma=SIGMA, scale=scale) / 3  # the recipe divides the sum by the pairs
    ours.backward()
    ours_grad = policy.w.grad.clone()

    policy.w.grad = None
    xt, target, t, v, v_old, v_ref = reference_velocities(policy, old, anchor_guidance=1.0)
    expected = reference_nft_loss(v, v_old, v_ref, X0, xt, t, advantages, beta=strength, adv_clip_max=5.0,
                                  kl_beta=kl_beta)
    expected.backward()
    torch.testing.assert_close(ours.detach(), expected.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_grad, policy.w.grad, rtol=1e-5, atol=1e-7)


def reference_return_decay(step, decay_type):
    """train_nft_sd3.py's return_decay: (flat, uprate, uphold) per type, 0 before flat."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def test_decay_types_match_the_reference():
    # Type 2 (OCR) by hand: 0 through step 75, 25 * 0.0075 = 0.1875 at 100, 133 * 0.0075 = 0.9975 at 208,
    # capped at 0.999 from 209 on.
    for step, expected in ((0, 0.0), (74, 0.0), (75, 0.0), (100, 0.1875), (208, 0.9975), (209, 0.999), (5000, 0.999)):
        assert decay_schedule(step, 2) == pytest.approx(expected)
    for decay_type in (0, 1, 2):
        for step in (0, 1, 2, 50, 75, 76, 100, 208, 499, 500, 501, 2000):
            assert decay_schedule(step, decay_type) == pytest.approx(reference_return_decay(step, decay_type))
    # Flow-Factory's four-number form (start_step, start_value, slope, end_value): CRD's old adapter.
    assert [decay_schedule(s, [0, 0.25, 0.005, 0.999]) for s in (0, 100, 149, 150, 151)] == pytest.approx(
        [0.25, 0.75, 0.995, 0.999, 0.999])
    assert NFTSection().choice("old_decay") == 1 and NFTSection(loss="awm").choice("old_decay") == [0, 0.0, 0.001, 0.3]
    assert NFTSection(loss="crd").choice("old_decay") == [0, 0.25, 0.005, 0.999]
    assert NFTSection(loss="crd").sampler_schedule() == [75, 0.0, 0.0075, 0.999]
    assert NFTSection().sampler_schedule() is None


def test_snapshot_blend_uses_exactly_the_decay_from_the_first_epoch():
    # DiffusionNFT: old = d old + (1 - d) theta after every epoch, the first included (diffusers' EMA would copy).
    weight = torch.nn.Parameter(torch.tensor([2.0]))
    old = LoraEMA([("w.lora_A.default.weight", weight)], decay=0.0)  # holds 2
    for value, decay in ((4.0, 0.25), (8.0, 0.5)):
        weight.data.fill_(value)
        old.blend(decay)
    # 0.25 * 2 + 0.75 * 4 = 3.5; then 0.5 * 3.5 + 0.5 * 8 = 5.75
    assert old.state_tensors()["w.lora_A.weight"].item() == pytest.approx(5.75)


def test_eval_ema_is_the_reference_0_9_ema_with_its_ramp():
    # flow_grpo/ema.py: starts from the initial weights; after optimizer step s (1 at the first),
    # ema += (1 - min((1 + s) / (10 + s), 0.9)) (theta - ema).
    weight = torch.nn.Parameter(torch.tensor([0.0]))
    ema = LoraEMA([("w.lora_A.default.weight", weight)], decay=0.9)
    expected = 0.0
    for step in range(1, 121):
        weight.data.fill_(float(step % 7) - 2.0)
        ema.scheduled_step(step, start=0, every=1, warmup="flow_grpo")
        decay = min((1 + step) / (10 + step), 0.9)
        expected += (1 - decay) * (float(step % 7) - 2.0 - expected)
        assert ema.state_tensors()["w.lora_A.weight"].item() == pytest.approx(expected, abs=1e-6), step


def reference_dpm2(velocity, x, sigmas):
    """solver.py's run_sampling(solver="dpm2", deterministic): DDIM at the first and last step, the multistep
    second-order update in between, on x0 = x - sigma v with alpha = 1 - sigma, lambda = log(alpha / sigma)."""
    outputs, lower = [None, None], 0
    for i in range(len(sigmas) - 1):
        s, t = sigmas[i], sigmas[i + 1]
        x0 = x - s * velocity(x, s)
        outputs = [outputs[1], x0]
        if lower < 1 or i == len(sigmas) - 2:  # DDIM, eta 0: (1 - t) x0 + t (x - (1 - s) x0) / s
            x = (1 - t) * x0 + t * (x - (1 - s) * x0) / s
        else:
            s1 = sigmas[i - 1]
            lam = lambda v: torch.log(1 - v) - torch.log(v)  # noqa: E731
            h, h0 = lam(t) - lam(s), lam(s) - lam(s1)
            d0, d1 = outputs[1], (h / h0) * (outputs[1] - outputs[0])
            x = (t / s) * x - (1 - t) * (torch.exp(-h) - 1.0) * d0 - 0.5 * (1 - t) * (torch.exp(-h) - 1.0) * d1
        lower = min(lower + 1, 2)
    return x


def test_nft_rollout_with_dpmpp_2m_is_the_reference_dpm2_sampler():
    from flowrl.models import build_policy
    from flowrl.sampling import RolloutSettings, StepPlan, rollout
    from flowrl.core.seeding import generators

    policy = build_policy("sd3", "tiny", seed=0)
    steps, seeds = 6, [3, 4]
    # The nft recipe's rollout: noise 0, only the last step stored (it is the plan's one 'SDE' step, at noise 0).
    ode = RolloutSettings(num_steps=steps, guidance_scale=1.0, noise_level=0.0,
                          plan=StepPlan(steps, sde_start=steps - 1), decode=False)
    traj = rollout(policy, ["a red circle"], replace(ode, ode_solver="dpmpp_2m"), group_size=2, seeds=seeds)
    cond = policy.encode(["a red circle"]).select(torch.tensor([0, 0]))
    x = policy.init_noise(2, generator=generators(seeds)).double()
    sigmas = policy.sigmas(steps).double()
    with torch.no_grad():
        expected = reference_dpm2(lambda z, s: policy.velocity(z.float(), s.float(), cond, 1.0).double(), x, sigmas)
    torch.testing.assert_close(traj.final_latents.double(), expected, rtol=0, atol=2e-5)
    euler = rollout(policy, ["a red circle"], ode, group_size=2, seeds=seeds)
    assert (euler.final_latents.double() - expected).abs().max() > 1e-3  # the test tells the solvers apart


# --- CRD -----------------------------------------------------------------------------------------------------
def reference_crd_loss(v, v_old, v_ref, target, advantages, *, crd_beta, adv_clip, kl_beta, adaptive_logp):
    """trainers/crd.py, one micro-batch, uniform centring (weight_temp < 0), MSE, reward-adaptive KL."""
    dims = (1, 2, 3)
    if adaptive_logp:
        w_theta = (v.detach() - target).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        w_old = (v_old - target).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        r_theta = -((v - target) ** 2 / w_theta - (v_old - target) ** 2 / w_old)
    else:
        r_theta = -((v - target) ** 2 - (v_old - target) ** 2)
    r_theta = r_theta.mean(dim=dims)
    rank = (advantages.clamp(-adv_clip, adv_clip) / adv_clip / 2.0 + 0.5).clamp(0, 1)
    centred_reward = rank - rank.mean()
    centred_theta = r_theta - r_theta.mean().detach()
    policy_loss = (((crd_beta * centred_theta - centred_reward) ** 2).mean() * adv_clip / crd_beta).mean()
    kl = ((v - v_ref) ** 2).mean(dim=dims)
    floor = 1e-4 / kl_beta
    return policy_loss + kl_beta * torch.mean((floor + rank * (1 - floor)) * kl)


@pytest.mark.parametrize("crd_beta, adaptive", [(1.0, True), (2.0, False), (0.5, True)])
def test_crd_gradient_is_the_reference_loss_gradient(crd_beta, adaptive):
    from flowrl.algorithms.crd import reward_adaptive_kl_weights

    advantages = torch.tensor([3.0, -1.0, -6.0])  # one group, one slot; one advantage beyond the clip
    kl_beta, anchor_guidance = 0.1, 4.5
    policy, old = policy_with_old([1.2, -0.4], [1.0, -0.5], [0.9, -0.6])
    a = advantages.clamp(-5, 5) / 5
    # flowrl: measure the log-ratios, weigh, then the surrogate's gradient (policy unguided, anchor at 4.5).
    ratios = implicit_log_ratio(policy, partial(ema_weights, old), X0, None, guidance=1.0, noise_seed=SEED, sigma=SIGMA, adaptive=adaptive)
    weights = crd_weights(ratios, a, torch.arange(3), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool),
                          num_rows=3, beta=crd_beta)
    scale = NFTSection(loss="crd", crd_beta=crd_beta).policy_loss_scale(advantage_clip=5.0)
    assert scale == pytest.approx(5.0 / crd_beta)
    loss = forward_process_loss(policy, partial(ema_weights, old), X0, None, weights, torch.ones(3), guidance=1.0, beta=kl_beta,
                                noise_seed=SEED, stats=StatsAccumulator(), sigma=SIGMA,
                                loss=CrdLoss(adaptive=adaptive, beta=crd_beta), scale=scale, kl_guidance=anchor_guidance,
                                kl_weights=reward_adaptive_kl_weights(a, kl_beta)) / 3
    loss.backward()
    ours = policy.w.grad.clone()

    policy.w.grad = None
    xt, target, t, v, v_old, v_ref = reference_velocities(policy, old, anchor_guidance=anchor_guidance)
    expected = reference_crd_loss(v, v_old, v_ref, target, advantages, crd_beta=crd_beta, adv_clip=5.0,
                                  kl_beta=kl_beta, adaptive_logp=adaptive)
    expected.backward()
    torch.testing.assert_close(ours, policy.w.grad, rtol=1e-5, atol=1e-7)


def test_crd_target_is_the_optimality_in_0_1_and_adaptive_logp_by_hand():
    # Two samples, advantages +5 and -5 (clip 5): r = 1 and 0, centred +-0.5 (not +-1). Log-ratios equal,
    # so the residuals are -0.5 and +0.5 and the weights -2 beta e = (1, -1) at beta 1.
    weights = crd_weights(torch.tensor([0.2, 0.2]), torch.tensor([1.0, -1.0]), torch.arange(2),
                          torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool), num_rows=2, beta=1.0)
    assert weights.tolist() == pytest.approx([1.0, -1.0])
    # adaptive_logp: v - target = (1, -3) -> 10/2 / 2 = 2.5; v_old - target = (2, 2) -> 4 / 2 = 2; l = 2 - 2.5.
    v, v_old, target = (torch.tensor([[[[1.0]], [[-3.0]]]]), torch.tensor([[[[2.0]], [[2.0]]]]),
                        torch.zeros(1, 2, 1, 1))
    assert implicit_reward(v, v_old, target, adaptive=True).item() == pytest.approx(-0.5)
    assert implicit_reward(v, v_old, target, adaptive=False).item() == pytest.approx(4.0 - 5.0)


# --- the recipe: snapshots saved apart, resumed exactly ------------------------------------------------------
SMOKE = "configs/smoke/sd3_tiny.yaml"


def run_config(path, *overrides):
    base = [f"run_dir={path}", "recipe=nft", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
            "train.optimizer_steps_per_epoch=2", "train.learning_rate=1e-3", "nft.timesteps_per_sample=2",
            "train.checkpoint_every=1"]
    return load_config(Config, SMOKE, base + list(overrides))


def checkpoint_tensors(run_dir, name):
    from safetensors.torch import load_file

    from flowrl.training.checkpoint import resolve_checkpoint

    return load_file(str(resolve_checkpoint(run_dir, "latest") / f"{name}.safetensors"))


@pytest.mark.parametrize("loss, snapshots", [("nft", ("ema", "old")), ("crd", ("ema", "old", "sampler"))])
def test_checkpoints_keep_eval_ema_and_old_adapter_apart_and_resume_both(tmp_path, loss, snapshots):
    common = [f"nft.loss={loss}", "nft.old_decay=[0,0.3,0.1,0.9]"] + (
        ["nft.sampler_decay=[0,0.6,0.0,0.6]"] if loss == "crd" else [])
    train(run_config(tmp_path / "full", *common, "train.epochs=3"))
    full = {name: checkpoint_tensors(tmp_path / "full", name) for name in ("lora", *snapshots)}
    for a in full:  # four separate copies of the adapter: trained, eval EMA, old, CRD's sampler
        for b in full:
            if a < b:
                assert any(not torch.equal(full[a][k], full[b][k]) for k in full[a]), (a, b)
    train(run_config(tmp_path / "resumed", *common, "train.epochs=2"))
    train(run_config(tmp_path / "resumed", *common, "train.epochs=3", "train.resume=latest"))
    for name in ("lora", *snapshots):
        resumed = checkpoint_tensors(tmp_path / "resumed", name)
        assert all(torch.equal(resumed[k], full[name][k]) for k in full[name]), name
