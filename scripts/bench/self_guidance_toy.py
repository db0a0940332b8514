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
    (add ``--seeds 0 1 2`` for the 3-seed summary of docs/results.md)
    ... --blocks 0 1 2 3 --steps 0,1 2,3 --scales 0.3        # which block and steps spread which attribute

Each row is named by its blocks (``b``), guided steps (``s``) and scale (``x``).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from flowrl.data.prompts import load_prompts
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
    parser.add_argument("--blocks", type=_indices, nargs="+", default=[(1,)],
                        help="the blocks whose features are spread, comma-separated; several sets: one row each")
    parser.add_argument("--steps", type=_indices, nargs="+", default=[(0, 1)],
                        help="the sampling steps guided, comma-separated; several sets: one row each")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--manifold-mix", type=float, default=0.4)
    parser.add_argument("--batch-prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="each seed draws its own prompts and noise; with several, a summary of mean +- s.e.")
    args = parser.parse_args()
    if args.images < 2:
        parser.error("self-guidance needs at least 2 images per prompt (--images >= 2)")

    held_out = load_prompts("assets/prompts/toy/heldout.jsonl")
    print(f"{args.prompts} held-out prompts x {args.images} images per seed; {args.iterations} iterations, "
          f"temperature {args.temperature:g}, manifold_mix {args.manifold_mix:g}")
    rows: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:
        args.seed = seed
        pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(seed))[:args.prompts]
        prompts = held_out.subset(sorted(pick.tolist()))
        policy = build_policy("sd3", "assets/toy", max_sequence_length=1, seed=seed)
        settings = [("none", None)] + [
            (f"b{_name(b)} s{_name(t)} x{s:g}", SelfGuidance(s, b, t, args.iterations, args.temperature,
                                                             args.manifold_mix))
            for b in args.blocks for t in args.steps for s in args.scales]
        print(f"seed {seed}")
        for name, guide in settings:
            rows.setdefault(name, []).append(measure(policy, prompts, args, guide))
            print_row(name, rows[name][-1])
    if len(args.seeds) > 1:
        print(f"mean +- s.e. over seeds {args.seeds}; change: paired with the same seed's 'none'")
        for name, runs in rows.items():
            print(f"{name:<18}" + "".join(f"{k:>9} {mean_se([r[k] for r in runs])}" for k in runs[0]))
            if name != "none":
                print(f"{'  change':<18}" + "".join(
                    f"{k:>9} {mean_se([r[k] - b[k] for r, b in zip(runs, rows['none'])])}" for k in runs[0]))


def _indices(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``: one set of block or step indices."""
    return tuple(int(i) for i in text.split(","))


def _name(indices: tuple[int, ...]) -> str:
    return ",".join(map(str, indices))


def print_row(name: str, row: dict[str, float]) -> None:
    print(f"{name:<18}" + "".join(f" {k}={row[k]:.4f}" for k in row))


def mean_se(values: list[float]) -> str:
    """``mean +- s.e.`` with the sample standard deviation over sqrt(n)."""
    x = torch.tensor(values, dtype=torch.float64)
    se = float(x.std() / math.sqrt(len(x))) if len(x) > 1 else float("nan")
    return f"{float(x.mean()):+.4f}+-{se:.4f}"

if __name__ == "__main__":
    main()
