"""Make the toy world's artifact data: clean renders against corrupted renders, for ``flowrl fit-reward``.

Writes ``--n`` clean renders of training-split toy prompts to ``OUT/clean`` and ``--n`` corrupted renders (of
other scenes drawn the same way) to ``OUT/artifact``, each with one corruption, the kinds in equal shares:

- ``merged``: a second copy of one object (same shape and colour) drawn overlapping it, one blob of the
  wrong outline, the clean model's own failure on counting prompts (``assets/toy/README.md``);
- ``smeared``: the whole render blurred (Gaussian, sigma 0.7-1.5 px at 32 px), edges smeared into the
  background;
- ``noise``: Gaussian pixel noise (std 0.04-0.12) over the render.

Everything is drawn from ``numpy.random.default_rng(seed)``, so one seed gives the same folders everywhere.
Then fit the reward and train with it::

    python -m tools.toy_artifacts runs/toy_artifacts --n 200
    flowrl fit-reward runs/toy_artifacts/clean runs/toy_artifacts/artifact --out runs/toy_artifacts/fitted.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms.functional import gaussian_blur
from torchvision.utils import save_image

from flowrl.toy.prompts import split
from flowrl.toy.world import Obj, render, sample_scene, to_tensor

KINDS = ("merged", "smeared", "noise")


def merged(scene, rng: np.random.Generator, size: int) -> torch.Tensor:
    """[3, H, W]: ``scene`` with one object drawn again, shifted by 0.3-0.6 of its side, so the two overlap."""
    first = scene.objects[int(rng.integers(len(scene.objects)))]
    shift = rng.uniform(0.3, 0.6, 2) * first.size * rng.choice([-1.0, 1.0], 2)  # overlapping, never on top
    half = first.size / 2
    cx, cy = (float(np.clip(c + d, half, 1 - half)) for c, d in zip((first.cx, first.cy), shift))
    twin = Obj(first.shape, first.color, cx, cy, first.size)
    return to_tensor(render(dataclasses.replace(scene, objects=(*scene.objects, twin)), size)[None])[0]


def smeared(image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """[3, H, W]: ``image`` blurred with a Gaussian of sigma 0.7-1.5 px."""
    return gaussian_blur(image[None], kernel_size=7, sigma=float(rng.uniform(0.7, 1.5)))[0]


def noise(image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """[3, H, W]: ``image`` plus Gaussian noise of std 0.04-0.12, clipped to [0, 1]."""
    std = rng.uniform(0.04, 0.12)
    return (image + torch.from_numpy(rng.normal(0.0, std, image.shape).astype(np.float32))).clamp(0.0, 1.0)


def make_toy_artifacts(out: str | Path, n: int, seed: int = 0, size: int = 32) -> dict[str, int]:
    """Write ``n`` clean and ``n`` artifact PNGs under ``out/clean`` and ``out/artifact``; returns the count of
    each corruption kind."""
    rng = np.random.default_rng(seed)
    specs = [spec for _, spec in split(seed=0)[0]]  # the training prompts (the toy model's split, seed 0)
    out = Path(out)
    (out / "clean").mkdir(parents=True, exist_ok=True)
    (out / "artifact").mkdir(parents=True, exist_ok=True)
    kinds = rng.permutation(np.resize(np.arange(len(KINDS)), n))  # equal shares, in a seeded order
    for i in range(n):
        scene = sample_scene(specs[int(rng.integers(len(specs)))], rng)
        save_image(to_tensor(render(scene, size)[None]), out / "clean" / f"{i:05d}.png")
    for i, kind in enumerate(KINDS[k] for k in kinds):
        scene = sample_scene(specs[int(rng.integers(len(specs)))], rng)
        clean = to_tensor(render(scene, size)[None])[0]  # [3, H, W]
        image = merged(scene, rng, size) if kind == "merged" else (smeared if kind == "smeared" else noise)(clean, rng)
        save_image(image, out / "artifact" / f"{i:05d}_{kind}.png")
    return {kind: int((kinds == k).sum()) for k, kind in enumerate(KINDS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to write clean/ and artifact/ into")
    parser.add_argument("--n", type=int, default=200, help="images per class")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (the toy model renders 32)")
    args = parser.parse_args()
    if args.n < 1 or args.size < 8:
        raise SystemExit(f"toy_artifacts: --n must be >= 1 and --size >= 8, got {args.n} and {args.size}")
    kinds = make_toy_artifacts(args.out, args.n, args.seed, args.size)
    print(f"wrote {args.n} clean and {args.n} artifact images under {args.out} "
          f"({', '.join(f'{k} {v}' for k, v in kinds.items())})")


if __name__ == "__main__":
    main()
