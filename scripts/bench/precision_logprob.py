"""How far each training precision moves the log-prob of a fixed SDE trajectory, on the tiny SD3 model (CPU).

GRPO's ratio exp(log p_new - log p_old) is clipped at 1 +- ``train.clip_range`` (1e-4 on a full SDE rollout), so a
precision whose recomputed log-prob drifts by more than ~1e-4 from the one recorded at sampling clips transitions
that have not moved at all. This script samples one trajectory in float32 without autocast (seeded), then
recomputes the log-prob of every stored transition, CFG and LoRA on, under:

- (a) bfloat16 weights under bfloat16 autocast (flowrl's default on GPU: ``model.dtype: bfloat16``; the LoRA stays
  float32, the text encoders bfloat16);
- (b) float32 weights under bfloat16 autocast (``model.dtype: float32``, ``train.mixed_precision: bf16``, text
  encoders in bfloat16);
- (c) float32 weights under float16 autocast, Flow-GRPO's (``FLOW_GRPO_PRECISION``: text encoders in float16);

each against float32 without autocast: per denoising step, the mean and max over rows of |Δ log p| and the max
|exp(Δ) - 1|, the PPO ratio's distance from 1, beside ``clip_range`` 1e-4. The text is encoded by each placement's
own encoders, as a run would. torch's CPU autocast stands in for CUDA's: it lowers the same matmuls and convolutions
(its op lists differ in details), so the figures show the size of the effect, not a GPU's exact bits. The tiny
model's random weights are not SD3.5's; rerun on a GPU with a real model for its figures.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/precision_logprob.py
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, rollout, sde_step

PROMPTS = ["a red circle on a blue background", "a green square"]
CLIP_RANGE = 1e-4
MODES = {  # name -> (model.dtype, model.text_encoder_dtype, autocast dtype or None)
    "fp32 (reference)": ("float32", None, None),
    "(a) bf16 weights + bf16 autocast": ("bfloat16", None, torch.bfloat16),
    "(b) fp32 weights + bf16 autocast": ("float32", "bfloat16", torch.bfloat16),
    "(c) fp32 weights + fp16 autocast": ("float32", "float16", torch.float16),
}


def lora_policy(dtype: str, text_encoder_dtype: str | None):
    """The tiny SD3 in this placement with one fixed float32 LoRA (seeded, B nonzero so the adapter acts)."""
    policy = build_policy("sd3", "tiny", seed=0, dtype=dtype, text_encoder_dtype=text_encoder_dtype)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return policy


@torch.no_grad()
def step_log_probs(policy, traj, prompts, *, autocast, guidance: float, noise_level: float) -> torch.Tensor:
    """[N, K] log-probs of the stored transitions recomputed by ``policy`` (the SDE step in float32)."""
    cond = policy.encode(prompts, negative=True).select(traj.prompt_ids)
    out = torch.empty(traj.log_probs.shape)
    for k in range(traj.num_stored_steps):
        sigma, sigma_next = float(traj.sigmas[k]), float(traj.sigmas[k + 1])
        context = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with context:
            velocity = policy.velocity(traj.latents[:, k], sigma, cond, guidance)
        out[:, k] = sde_step(velocity, traj.latents[:, k], sigma, sigma_next, noise_level=noise_level, kind="sde",
                             prev_sample=traj.latents[:, k + 1]).log_prob
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="denoising steps of the trajectory")
    parser.add_argument("--group-size", type=int, default=8, help="rows per prompt")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    guidance, noise_level = 4.5, 0.7
    seeds = list(range(len(PROMPTS) * args.group_size))
    reference = lora_policy("float32", None)
    settings = RolloutSettings(num_steps=args.steps, guidance_scale=guidance, noise_level=noise_level)
    traj = rollout(reference, PROMPTS, settings, group_size=args.group_size, seeds=seeds)  # float32 [N, K + 1, C, h, w]
    prompts = list(PROMPTS)
    results = {}
    for name, (dtype, text_dtype, autocast) in MODES.items():
        policy = reference if autocast is None else lora_policy(dtype, text_dtype)
        results[name] = step_log_probs(policy, traj, prompts, autocast=autocast, guidance=guidance,
                                       noise_level=noise_level)
    base = results.pop("fp32 (reference)")
    on_policy = float((base - traj.log_probs).abs().max())  # the recomputation itself: 0 up to float order
    print(f"tiny SD3, {len(seeds)} rows x {args.steps} SDE steps (noise_level {noise_level}, CFG {guidance}), "
          f"LoRA r4; float32 recomputation vs the rollout's own log-probs: max |Δ| {on_policy:.1e}\n")
    print("| precision | mean \\|Δ log p\\| | max \\|Δ log p\\| | max \\|exp(Δ) - 1\\| | / clip_range 1e-4 |")
    print("| --- | --- | --- | --- | --- |")
    for name, log_probs in results.items():
        delta = (log_probs - base).abs()  # [N, K]
        ratio = float((log_probs - base).exp().sub(1).abs().max())
        print(f"| {name} | {float(delta.mean()):.2e} | {float(delta.max()):.2e} | {ratio:.2e} | "
              f"{ratio / CLIP_RANGE:.1f}x |")
    print("\nPer step (0 = noisiest), mean / max |Δ log p| over rows:\n")
    print("| step | " + " | ".join(name.split(" ")[0] for name in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for k in range(traj.num_stored_steps):
        cells = [f"{float((lp - base)[:, k].abs().mean()):.1e} / {float((lp - base)[:, k].abs().max()):.1e}"
                 for lp in results.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
