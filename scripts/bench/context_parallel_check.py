"""Context parallelism against one process: what each process of a ``torch.distributed.run`` launch checks.

Every process builds the same tiny LoRA'd Wan transformer twice: one copy split by flowrl's mesh and diffusers'
context parallelism (Ulysses or ring over both processes), one left whole. Both roll out the same rows (2 SDE steps,
the same per-row generators) and take one GRPO-clip step on the recorded transitions. The process writes, as JSON,
the largest difference of the velocities and log-probs and the relative difference of each LoRA gradient, the
context-parallel one summed over its context group (each process holds its tokens' share of the gradient).

    python -m torch.distributed.run --nproc_per_node 2 scripts/bench/context_parallel_check.py OUT ulysses cpu
    python -m torch.distributed.run --nproc_per_node 2 scripts/bench/context_parallel_check.py OUT ring cuda

On the CPU (gloo, float32, tests/training/test_context_parallel.py) only Ulysses runs: ring attention needs the
attention's log-sum-exp, which diffusers' native (SDPA) backend does not return. On GPUs (NCCL) both run, ring on
torch's flash kernel in bfloat16; ``scripts/bench/gpu_full_size.py --context-parallel`` launches this on every GPU
of the machine and prints the results.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from peft import LoraConfig

from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.core.context_parallel import (
    ContextLayout,
    build_mesh,
    enable_context_parallel,
)
from flowrl.sampling.steps import sde_step


def rollout_and_grads(transformer, latents, text, sigmas):
    velocities, log_probs, samples = [], [], [latents]
    generators = [torch.Generator(latents.device).manual_seed(1000 + row) for row in range(latents.shape[0])]
    with torch.no_grad():
        for k in range(len(sigmas) - 1):
            t = sigmas[k].expand(latents.shape[0]) * 1000
            velocity = transformer(hidden_states=samples[-1], timestep=t, encoder_hidden_states=text,
                                   return_dict=False)[0]
            step = sde_step(velocity, samples[-1], float(sigmas[k]), float(sigmas[k + 1]), noise_level=0.7,
                            generator=generators)
            velocities.append(velocity)
            log_probs.append(step.log_prob)
            samples.append(step.prev_sample)
    old = torch.stack(log_probs, dim=1)  # [N, K]
    advantages = torch.tensor([1.0, -1.0], device=latents.device)
    losses = []
    for k in range(len(sigmas) - 1):
        t = sigmas[k].expand(latents.shape[0]) * 1000
        velocity = transformer(hidden_states=samples[k], timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        step = sde_step(velocity, samples[k], float(sigmas[k]), float(sigmas[k + 1]), noise_level=0.7,
                        prev_sample=samples[k + 1])
        loss, _ = grpo_clip_loss(step.log_prob, old[:, k], advantages, clip_low=0.2, clip_high=0.2)
        losses.append(loss.mean())
    torch.stack(losses).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in transformer.named_parameters() if "lora" in n}
    return torch.stack(velocities, dim=1).float(), old, {n: g.float() for n, g in grads.items()}


def main(out: str, kind: str, device_type: str) -> None:
    if device_type == "cuda":
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")  # enable_context_parallel gives diffusers' device pick cpu:0 on CPU
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if kind == "ring" and device_type == "cuda" else torch.float32
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    transformer.to(device, dtype)
    if kind == "ring":  # ring attention merges partial results by their log-sum-exp: a backend that returns it
        transformer.set_attention_backend("_native_flash")
    whole = copy.deepcopy(transformer)
    world = dist.get_world_size()
    layout = ContextLayout(world=world, ulysses=world if kind == "ulysses" else 1, ring=world if kind == "ring" else 1)
    enable_context_parallel(transformer, layout, build_mesh(layout, device_type))

    tokens = 2 * 2 * world  # latent frames x h x w / (1 x 2 x 2) patches: 2 x (4 / 2) x (2 world / 2)
    latents = torch.randn(2, 4, 2, 4, 2 * world, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    text = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    sigmas = torch.tensor([1.0, 0.75, 0.5], device=device)
    v_cp, lp_cp, g_cp = rollout_and_grads(transformer, latents, text, sigmas)
    v_one, lp_one, g_one = rollout_and_grads(whole, latents, text, sigmas)
    relative = {}
    for name, grad in g_cp.items():
        dist.all_reduce(grad)  # the context group's partial gradients -> the row's gradient
        relative[name] = float((grad - g_one[name]).norm() / g_one[name].norm().clamp(min=1e-12))
    result = {"kind": kind, "processes": world, "dtype": str(dtype), "tokens_per_row": tokens,
              "velocity": float((v_cp - v_one).abs().max()), "log_prob": float((lp_cp - lp_one).abs().max()),
              "grad_relative": max(relative.values()), "lora_tensors": len(relative),
              "grad_norm": float(sum(g.norm() ** 2 for g in g_one.values()) ** 0.5)}
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "cpu")
