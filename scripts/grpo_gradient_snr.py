"""Where GRPO's policy gradient carries signal: per denoising step, its size and its agreement
between two disjoint rollout batches on the same prompts.

For each of two batches (same prompts, different seeds) of full-SDE rollouts of the base model, the
script computes, separately for every stored step k, the GRPO gradient on the LoRA weights
``g_k = -sum_i A_i * grad log p(x_{k+1} | x_k) / N`` (on-policy, so the clipped loss reduces to this).
It prints, per step, ``|g_k|`` and ``cos(g_k(batch 1), g_k(batch 2))``: a gradient that follows the
reward points the same way in both batches (cosine near 1); pure sampling noise gives cosine near 0.
The last rows do the same for the sums over step windows, which is what a windowed run trains.

    python scripts/grpo_gradient_snr.py                         # toy GRPO config, strict ToyEval
    python scripts/grpo_gradient_snr.py --prompts 16 --group 16 sampling.noise_level=1.0
"""

from __future__ import annotations

import argparse

import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from flowrl.config import Config, load_config
from flowrl.data.prompts import load_prompts
from flowrl.data.tasks import stratified_prefix
from flowrl.recipes.build import build_training_policy
from flowrl.sampling import RolloutSettings, StepPlan, rollout, root_seeds, sde_step
from rewards.toyeval import ToyEval


def step_gradients(policy, traj, advantages, guidance: float, noise_level: float) -> list[torch.Tensor]:
    """[K] flat gradients of -mean_i A_i log p_k(i) over the trainable parameters, one per stored step."""
    params = policy.trainable_parameters()
    grads = []
    for k in range(traj.num_stored_steps):
        x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
        sigma, sigma_next = traj.sigmas[k].item(), traj.sigmas[k + 1].item()
        velocity = policy.velocity(x, sigma, traj.cond.select(traj.prompt_ids), guidance)
        step = sde_step(velocity, x, sigma, sigma_next, noise_level=noise_level, prev_sample=x_next)
        loss = -(advantages * step.log_prob).mean()
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. sampling.noise_level=1.0")
    parser.add_argument("--config", default="configs/toy/grpo.yaml")
    parser.add_argument("--prompts", type=int, default=8, help="training prompts, an equal share per task")
    parser.add_argument("--group", type=int, default=16, help="rollouts per prompt in each batch")
    parser.add_argument("--key", default="toyeval", help="reward key the advantages come from")
    args = parser.parse_args()
    cfg = load_config(Config, args.config, args.overrides)
    torch.manual_seed(cfg.seed)
    policy = build_training_policy(cfg, torch.device("cpu"))
    prompts = stratified_prefix(load_prompts(cfg.data.prompts), args.prompts)
    s, reward = cfg.sampling, ToyEval()
    settings = RolloutSettings(num_steps=s.num_steps, guidance_scale=s.guidance_scale, noise_level=s.noise_level,
                               plan=StepPlan(s.num_steps))
    batches = []
    for b in range(2):
        seeds = root_seeds(cfg.seed + 1000 * (b + 1), 0, len(prompts) * args.group)
        with torch.no_grad():
            traj = rollout(policy, prompts.prompts, settings, group_size=args.group, seeds=seeds)
        rows = traj.prompt_ids.tolist()
        scores = reward(traj.images, [prompts.prompts[i] for i in rows], [prompts.metadata[i] for i in rows])
        advantages = ADVANTAGE_ESTIMATORS["grpo"](scores[args.key].float(), traj.group_ids, std_scope="global")
        print(f"batch {b}: mean {args.key} {float(scores[args.key].float().mean()):.3f}")
        batches.append(step_gradients(policy, traj, advantages, s.guidance_scale, s.noise_level))
    first, second = batches
    cosine = torch.nn.functional.cosine_similarity
    print(f"\n{'step':>4} | {'sigma':>5} | {'|g| b1':>8} | {'|g| b2':>8} | {'cos(b1, b2)':>11}")
    for k, (g1, g2) in enumerate(zip(first, second)):
        print(f"{k:>4} | {traj.sigmas[k].item():>5.3f} | {g1.norm():>8.2e} | {g2.norm():>8.2e} | "
              f"{cosine(g1, g2, dim=0):>11.3f}")
    print(f"\n{'window':>10} | {'cos(b1, b2)':>11} | share of |g|^2 from the window")
    total = sum(g.norm() ** 2 for g in first[:-1])
    for start, stop in ((0, 3), (0, 5), (2, 5), (3, 6), (5, 9), (0, len(first) - 1)):
        g1, g2 = sum(first[start:stop]), sum(second[start:stop])
        share = sum(g.norm() ** 2 for g in first[start:stop]) / total
        print(f"{f'{start}-{stop - 1}':>10} | {cosine(g1, g2, dim=0):>11.3f} | {share:.3f}")


if __name__ == "__main__":
    main()
