"""Where each part of a pipeline lives and in which dtype it computes: model.dtype, model.text_encoder_dtype,
model.vae_dtype and train.mixed_precision, Flow-GRPO's float32 master weights under autocast among them."""

from types import SimpleNamespace

from functools import partial

import pytest
import torch

from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.config import Config, ConfigError, load_config
from flowrl.config.schema import FLOW_GRPO_PRECISION
from flowrl.models import build_policy, policy_from_config
from flowrl.recipes.build import autocast_precision
from flowrl.training.stats import StatsAccumulator
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.sampling import RolloutSettings, rollout

SMOKE = "configs/smoke/sd3_tiny.yaml"
FLOW_GRPO = [f"{key}={'null' if value is None else value}" for key, value in FLOW_GRPO_PRECISION.items()]


def _dtypes(modules) -> set[torch.dtype]:
    return {p.dtype for m in modules for p in m.parameters()}


def test_flow_grpo_precision_places_a_float32_transformer_and_vae_beside_float16_text_encoders():
    cfg = load_config(Config, SMOKE, FLOW_GRPO)
    policy = policy_from_config(cfg.model)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    assert _dtypes([policy.transformer]) == {torch.float32}  # base and LoRA: the master weights
    assert _dtypes([policy.vae]) == {torch.float32}
    assert len(policy.text_encoders()) == 3 and _dtypes(policy.text_encoders()) == {torch.float16}
    # The embeddings are the float16 encoders' own values, in the transformer's dtype.
    raw, _ = policy.encode_chunks(["a red circle"])
    cond = policy.encode(["a red circle"], negative=True)
    assert raw.dtype == torch.float16 and cond.prompt_embeds.dtype == torch.float32
    assert torch.equal(cond.prompt_embeds, raw.float())
    assert cond.negative_pooled_prompt_embeds.dtype == torch.float32


def test_the_vae_decodes_in_its_own_dtype_beside_bfloat16_weights():
    policy = build_policy("sd3", "tiny", dtype="bfloat16", vae_dtype="float32")
    assert _dtypes([policy.transformer]) == _dtypes(policy.text_encoders()) == {torch.bfloat16}
    seen = []
    hook = policy.vae.decoder.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    try:
        images = policy.decode(torch.randn(2, *policy.latent_shape(1)[1:], dtype=torch.bfloat16))
    finally:
        hook.remove()
    assert seen == [torch.float32] and images.dtype == torch.float32


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
def test_the_training_log_prob_runs_the_transformer_in_the_autocast_dtype_and_the_step_in_float32(autocast):
    """What a GPU accelerator's autocast does to the training pass, here with the CPU's own torch.autocast: float32
    weights, the transformer's matmuls in the autocast dtype, the SDE step and its log-prob in float32."""
    policy = build_policy("sd3", "tiny", dtype="float32", text_encoder_dtype="float16")
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    traj = rollout(policy, ["a red circle"], RolloutSettings(num_steps=2, guidance_scale=4.5, noise_level=0.7),
                   group_size=2, seeds=[1, 2])
    assert traj.latents.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    advantages = torch.ones(traj.log_probs.shape)
    seen = []
    hook = policy.transformer.proj_out.register_forward_hook(
        lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    accelerator = SimpleNamespace(device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", dtype=autocast))
    try:
        settings = TransitionSettings(policy_loss=partial(grpo_clip_loss, clip_low=1e-4, clip_high=1e-4),
                                      guidance=4.5, kind="sde", beta=0.1)
        loss = transition_loss(policy, traj, advantages, torch.arange(2), 0,
                               torch.ones(traj.log_probs.shape, dtype=torch.bool), settings=settings,
                               accelerator=accelerator, noise_level=0.7, stats=StatsAccumulator(), on_policy=False)
    finally:
        hook.remove()
    assert seen and set(seen) == {(torch.float32, autocast)}  # the policy's pass and the KL reference's
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in policy.trainable_parameters())


def test_the_accelerator_autocasts_on_gpu_only():
    cfg = load_config(Config, SMOKE, FLOW_GRPO)
    assert autocast_precision(cfg, on_cpu=False) == "fp16"
    assert autocast_precision(cfg, on_cpu=True) == "no"


@pytest.mark.parametrize("overrides, key", [
    (["model.dtype=bfloat16", "train.mixed_precision=fp16"], "train.mixed_precision"),
    (["model.dtype=float16", "train.mixed_precision=bf16"], "train.mixed_precision"),
    (["model.vae_dtype=float64"], "model.vae_dtype"),
    (["model.text_encoder_dtype=int8"], "model.text_encoder_dtype"),
])
def test_precision_combinations_that_cannot_work_are_one_line(overrides, key):
    with pytest.raises(ConfigError, match=key) as error:
        load_config(Config, SMOKE, overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides", [
    ["model.dtype=bfloat16", "train.mixed_precision=bf16"],  # bfloat16 weights under bfloat16 autocast
    ["model.dtype=float32", "train.mixed_precision=bf16", "model.text_encoder_dtype=bfloat16"],
    ["model.dtype=bfloat16", "train.mixed_precision='no'", "model.vae_dtype=float32"],
    FLOW_GRPO,
])
def test_precision_combinations_that_work_load(overrides):
    load_config(Config, SMOKE, overrides)



def test_fp16_loss_scale_overflows_go_to_the_scaler_and_are_not_faults():
    """fp16 on GPU scales the loss (accelerate's GradScaler): an overflowing step is the scaler's calibration, which
    skips it and halves the scale, however many in a row; below scale 1 a non-finite gradient is a fault again.
    torch's own GradScaler on the CPU, with accelerate's two calls on it: unscale in clip_grad_norm_, step + update
    in the optimizer's step."""
    from flowrl.recipes.epoch_end import optimizer_step
    from flowrl.training.faults import FaultCounter, TrainingAborted

    param = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def clip(params, max_norm):  # accelerator.clip_grad_norm_
        scaler.unscale_(inner)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def step():  # AcceleratedOptimizer.step with a scaler
        scaler.step(inner)
        scaler.update()

    optimizer = SimpleNamespace(step=step, zero_grad=inner.zero_grad, param_groups=inner.param_groups)
    run = SimpleNamespace(hook=lambda name: [], params=[param], optimizer=optimizer,
                          cfg=SimpleNamespace(train=SimpleNamespace(max_grad_norm=1.0, max_skipped_steps=3)),
                          accelerator=SimpleNamespace(clip_grad_norm_=clip, scaler=scaler, is_main_process=False),
                          extras={"lr_scheduler": SimpleNamespace(step=lambda: None)},
                          faults=FaultCounter(max_skipped_steps=3, max_nan_epochs=2))

    def one_step(grad: float) -> None:
        scaler.scale((param * torch.full((3,), grad)).sum()).backward()  # accelerator.backward under fp16
        optimizer_step(run, StatsAccumulator())

    for _ in range(5):  # more overflows in a row than train.max_skipped_steps: calibration, not a fault
        one_step(float("inf"))
    assert scaler.get_scale() == 2.0**11 and torch.equal(param.detach(), torch.ones(3))
    one_step(0.1)  # a finite step goes through, unscaled
    torch.testing.assert_close(param.detach(), torch.full((3,), 0.99))
    scaler.update(0.5)  # a scale below 1: a non-finite gradient is the model's, counted
    with pytest.raises(TrainingAborted):
        for _ in range(3):
            one_step(float("nan"))


def test_hrf_anchor_pull_joins_the_gradients_at_their_loss_scale():
    from flowrl.recipes.snapshots import PhaseAnchor

    param = torch.nn.Parameter(torch.full((2,), 3.0))
    anchor = PhaseAnchor(SimpleNamespace(model=SimpleNamespace(shadow_params=[torch.ones(2)])), weight=0.5,
                         phase_length=1)
    for scaler, scale in ((None, 1.0), (SimpleNamespace(get_scale=lambda: 1024.0), 1024.0)):
        param.grad = torch.zeros(2)
        anchor.before_step(SimpleNamespace(params=[param], accelerator=SimpleNamespace(scaler=scaler)))
        assert torch.equal(param.grad, torch.full((2,), 2 * 0.5 * (3.0 - 1.0) * scale))
