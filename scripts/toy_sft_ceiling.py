"""What bounds RL on the toy world at a given optimizer budget: fine-tuning on perfect images.

DiffusionNFT trains with the flow-matching loss on the model's own images, pulled toward the right ones.
The best it could do with the same optimizer steps is to see only right images, and the best right images
are the toy world's own renders. This script runs the main job's optimization (``configs/toy/nft.yaml``:
LoRA, AdamW, learning rate, batch of ``prompts_per_batch x group_size`` images per epoch balanced by task,
``nft.timesteps_per_sample`` sigmas of the sampling schedule per pass, ``train.inner_epochs`` passes,
DiffusionNFT's adaptive weighting, the guided velocity) with every image a ground-truth render of its
training prompt and optimality 1, which makes DiffusionNFT's loss plain flow matching toward the render.
It prints the same held-out curve as ``scripts/toy_curve.py`` (task-mean strict ToyEval every
``--test-every`` epochs on ``log.test_prompts`` prompts x ``log.eval_images_per_prompt`` ODE images).

If this curve is slow too, the limit is how fast the model can change at this budget, not RL's signal.

    python scripts/toy_sft_ceiling.py --test-every 10 configs/toy/nft.yaml log.test_prompts=48 \
        log.eval_images_per_prompt=8 train.epochs=40
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from flowrl.algorithms.timesteps import schedule_timesteps
from flowrl.cli import DEFAULT_CONFIG
from flowrl.config import NFTConfig, load_config
from flowrl.data.prompts import epoch_prompt_indices
from flowrl.recipes.epoch_end import held_out_metrics, optimizer_step
from flowrl.recipes.start import start_run
from flowrl.training.stats import StatsAccumulator
from flowrl.algorithms.forward_losses import forward_process_loss
from flowrl.toy.world import render_batch


@torch.no_grad()
def encode_renders(policy, images: torch.Tensor) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] -> clean latents [N, C, h, w], the inverse of ``policy.decode``."""
    config = policy.vae.config
    moments = policy.vae.encode(images.to(policy.vae.dtype) * 2 - 1).latent_dist.mean
    return ((moments - (config.shift_factor or 0.0)) * config.scaling_factor).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--test-every", type=int, default=10)
    parser.add_argument("--run-dir", default="runs/toy_sft_ceiling")
    parser.add_argument("--loss-guidance", type=float, default=None,
                        help="guidance of the trained velocity (default: the config's, as DiffusionNFT trains it); "
                             "1 trains the conditional velocity alone, as pre-training did")
    args = parser.parse_args()
    cfg = load_config(NFTConfig, args.config, [f"run_dir={args.run_dir}", "log.progress=false", *args.overrides])
    run = start_run(cfg)
    policy, s, t, n = run.policy, cfg.sampling, cfg.train, cfg.nft
    size = policy.decode(policy.init_noise(1)).shape[-1]
    schedule = policy.sigmas(s.num_steps)[:-1]  # [num_steps], DiffusionNFT's sampling-schedule timesteps
    loss_guidance = run.guidance if args.loss_guidance is None else args.loss_guidance
    strata = [m[cfg.data.balance_by] for m in run.train_prompts.metadata] if cfg.data.balance_by else None

    def evaluate(epoch: int, wall: float) -> None:
        m = held_out_metrics(policy, None, run.rewards, run.test_set, cfg, run.guidance, run.accelerator)
        tasks = " ".join(f"{k.rsplit('/', 1)[-1]} {v:.3f}" for k, v in m.items() if k.startswith("test/toyeval/task/"))
        print(f"epoch {epoch:>4} | train s {wall:7.1f} | task-mean {m['test/toyeval/task_mean']:.3f} | {tasks}",
              flush=True)

    evaluate(-1, 0.0)
    wall = 0.0
    for epoch in range(t.epochs):
        start = time.perf_counter()
        index = epoch_prompt_indices(len(run.train_prompts), s.prompts_per_batch, seed=cfg.seed, epoch=epoch,
                                     strata=strata)
        specs = [run.train_prompts.metadata[i] for i in index for _ in range(s.group_size)]
        images, _ = render_batch(specs, np.random.default_rng([cfg.seed, epoch, 0x5F7]), size=size)
        x0 = encode_renders(policy, images)  # [N, C, h, w]
        cond = policy.encode([run.train_prompts.prompts[i] for i in index])
        rows_prompt = torch.arange(len(index)).repeat_interleave(s.group_size)  # [N]
        ones = torch.ones(len(specs))
        pairs = len(specs) * n.timesteps_per_sample
        for inner in range(t.inner_epochs):
            order = np.random.default_rng([cfg.seed, epoch, inner, 0x4F7]).permutation(pairs)
            timesteps = schedule_timesteps(schedule, len(specs), seed=[cfg.seed, epoch, inner, 0x7153])
            for chunk_index, chunk in enumerate(np.array_split(order, t.optimizer_steps_per_epoch)):
                chunk = torch.as_tensor(chunk, dtype=torch.long)
                stats = StatsAccumulator()
                for i, micro in enumerate(chunk.split(t.micro_batch_size)):
                    rows = micro % len(specs)
                    loss_sum = forward_process_loss(
                        policy, None, x0[rows], cond.select(rows_prompt[rows]), ones[rows], ones[rows],
                        guidance=loss_guidance, strength=1.0, adaptive=n.adaptive_weighting, beta=0.0,
                        noise_seed=[cfg.seed, epoch, inner, chunk_index, i, 0x4F7], stats=stats,
                        sigma=timesteps[rows, micro // len(specs)])
                    (loss_sum / len(chunk)).backward()
                optimizer_step(run, stats)
        wall += time.perf_counter() - start
        if (epoch + 1) % args.test_every == 0 or epoch + 1 == t.epochs:
            evaluate(epoch, wall)


if __name__ == "__main__":
    main()
