"""Feature self-guidance on the toy model: does it raise in-group diversity without costing strict ToyEval?

Samples ``--prompts`` held-out prompts (a seeded draw from ``assets/prompts/toy/heldout.jsonl``) x ``--images``
images each with the toy defaults of ``assets/toy/README.md`` (10 steps, guidance 3.0, max_sequence_length 1),
once without guidance and once per ``--scales`` value, on the same seeds, and prints per setting:

- ``latent_gmd``: mean over prompts of the in-group geometric-mean RMS distance of the clean latents
  (:func:`flowrl.eval.metrics.latent_gmd`);
- ``pix_cos``: mean in-group pairwise cosine distance of the images' pixels
  (:func:`flowrl.eval.metrics.pairwise_cosine_distance`);
- ``bg``, ``pos``, ``size``, ``gt_mean``: ground-truth free-attribute diversity, the normalised in-group entropy of the
  background, object position and size, and their mean (:func:`flowrl.toy.diversity.diversity`);
- ``strict``: strict ToyEval (``rewards.toyeval.ToyEval``), and ``s/img``: wall seconds per image.

Run from the repository root:
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/self_guidance_toy.py --prompts 16 --images 8
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from flowrl.data import load_prompts
from flowrl.eval.held_out import render
from flowrl.eval.metrics import latent_gmd, pairwise_cosine_distance
from flowrl.models import build_policy
from flowrl.sampling.self_guidance import SelfGuidance
from flowrl.toy.diversity import diversity
from rewards.toyeval import ToyEval


def measure(policy, prompts, args, guide: SelfGuidance | None) -> dict[str, float]:
    start = time.perf_counter()
    images, latents = render(policy, prompts, images_per_prompt=args.images, num_steps=10, guidance=3.0,
                             seed=args.seed, batch_prompts=args.batch_prompts, with_latents=True,
                             self_guidance=guide)  # [P * K, 3, 32, 32], [P * K, 4, 16, 16]
    seconds = (time.perf_counter() - start) / len(images)
    groups = torch.arange(len(prompts)).repeat_interleave(args.images)  # [P * K]
    rows = [p for p in prompts.prompts for _ in range(args.images)]
    meta = [m for m in prompts.metadata for _ in range(args.images)]
    toy = diversity(images, groups.tolist())
    return {"latent_gmd": float(latent_gmd(latents, groups).mean()),
            "pix_cos": float(pairwise_cosine_distance(images.flatten(1), groups).mean()),
            "bg": toy["diversity/background"], "pos": toy["diversity/position"], "size": toy["diversity/size"],
            "gt_mean": toy["diversity/gt_mean"],
            "strict": float(torch.nanmean(ToyEval()(images, rows, meta)["toyeval"])), "s/img": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts drawn")
    parser.add_argument("--images", type=int, default=8, help="images per prompt (>= 2)")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.1, 0.3], help="guidance scales to compare")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--manifold-mix", type=float, default=0.4)
    parser.add_argument("--batch-prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.images < 2:
        parser.error("self-guidance needs at least 2 images per prompt (--images >= 2)")

    held_out = load_prompts("assets/prompts/toy/heldout.jsonl")
    pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(args.seed))[:args.prompts]
    prompts = held_out.subset(sorted(pick.tolist()))
    policy = build_policy("sd3", "assets/toy", max_sequence_length=1, seed=args.seed)
    settings = [("none", None)] + [
        (f"scale {s:g}", SelfGuidance(s, tuple(args.blocks), tuple(args.steps), args.iterations, args.temperature,
                                      args.manifold_mix)) for s in args.scales]
    print(f"{len(prompts)} held-out prompts x {args.images} images; blocks {args.blocks}, steps {args.steps}, "
          f"{args.iterations} iterations, temperature {args.temperature:g}, manifold_mix {args.manifold_mix:g}")
    header = None
    for name, guide in settings:
        row = measure(policy, prompts, args, guide)
        if header is None:
            header = list(row)
            print(f"{'setting':<12}" + "".join(f"{k:>11}" for k in header))
        print(f"{name:<12}" + "".join(f"{row[k]:>11.4f}" if not math.isnan(row[k]) else f"{'nan':>11}"
                                      for k in header))


if __name__ == "__main__":
    main()
