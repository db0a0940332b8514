"""Throughput of reward models: one batched call against one call per image.

Run (offline, tiny random models of the real architectures, 64 images of 256 px, 8 per prompt)::

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/bench_rewards.py
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/bench_rewards.py --only clipscore,aesthetic --n 128
    .venv/bin/python scripts/bench/bench_rewards.py --only pickscore --pickscore-model yuvalkirstain/PickScore_v1 \\
        --device cuda --dtype bf16

What is measured, per reward, on one reward object (so both sides share the same weights):
``reward(images, prompts, metadata)`` over all N images with chunks of ``--batch-size``, against
N calls ``reward(images[i:i+1], ...)``. After one warm-up call of each, both are timed
``--repeats`` times (alternating) and the best time of each is reported as images/second. Rewards
return CPU tensors, so a GPU run is synchronised by the result itself.

What the default tiny models measure, honestly: they have CLIP's classes, tokeniser, 224 px input
and patch grid, but a narrow width (``--width``) and few layers, so on a CPU the one-by-one side
pays mostly per-call costs (Python and module dispatch, tokenisation, one resize/crop per call,
the text tower run once per image) which batching amortises. Batched calls also embed each distinct
prompt once (``--group-size`` images share a prompt, as in GRPO); ``--group-size 1`` removes that
gain. The tiny models do not measure how well big GEMMs fill an accelerator, which is where a real
CLIP-L/H on a GPU gets its (larger) batching gain; use the ``--*-model`` options with real weights
on the target device for that. Scores of the tiny models are noise.

Threads matter on a CPU: each multi-threaded op ends at a barrier, and on a shared or
oversubscribed machine every barrier can wait a scheduler slice, which hits the one-by-one side
(many small ops) far harder than the batched side. ``--threads 1`` gives the cleanest CPU figure;
the default (torch's thread count) shows what the contended machine actually delivers.

To add a section (e.g. OCR): write ``build(args) -> Reward`` and append
``Benchmark("ocr", build)`` to ``BENCHMARKS``; ``--only`` and the table pick it up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.rewards_api import Reward

PROMPTS = [
    "a red circle on a white table", "two blue squares in the sky", "a cute cat sitting on a chair",
    "a small house near a river at night", "a green apple and a yellow banana",
    "a portrait of a woman, oil painting", "a horse in a forest, watercolor",
    "a city street at day, cinematic photo",
]


@dataclass(frozen=True)
class Benchmark:
    name: str
    build: Callable[[argparse.Namespace], Reward]  # args -> a reward with a settable batch_size


# ------------------------------------------------------------------------------- CLIP family

def _tiny_kwargs(args: argparse.Namespace) -> dict:
    return dict(image_size=224, patch=args.patch, width=args.width, layers=args.layers, heads=args.heads)


def _common(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, batch_size=args.batch_size)


def build_clipscore(args: argparse.Namespace) -> Reward:
    from flowrl.models.clip import tiny_hf_clip
    from rewards.clip_scores import ClipScore

    if args.clip_model:
        return ClipScore(model_id=args.clip_model, **_common(args))
    model, tok = tiny_hf_clip(projection_dim=args.width, **_tiny_kwargs(args))
    return ClipScore(model=model, tokenizer=tok, **_common(args))


def build_pickscore(args: argparse.Namespace) -> Reward:
    from flowrl.models.clip import tiny_hf_clip
    from rewards.clip_scores import PickScore

    if args.pickscore_model:
        return PickScore(model_id=args.pickscore_model, processor_id=args.pickscore_processor, **_common(args))
    model, tok = tiny_hf_clip(seed=1, projection_dim=args.width, **_tiny_kwargs(args))
    return PickScore(model=model, tokenizer=tok, **_common(args))


def build_hpsv2(args: argparse.Namespace) -> Reward:
    from flowrl.models.clip import tiny_open_clip
    from rewards.clip_scores import HPSv2

    if args.hpsv2_checkpoint:
        return HPSv2(checkpoint=args.hpsv2_checkpoint, **_common(args))
    model, tok = tiny_open_clip(seed=2, embed_dim=args.width, **_tiny_kwargs(args))
    return HPSv2(model=model, tokenizer=tok, **_common(args))


def build_aesthetic(args: argparse.Namespace) -> Reward:
    from rewards.aesthetic import Aesthetic, AestheticMLP
    from flowrl.models.clip import tiny_open_clip

    weights = args.aesthetic_weights
    if not weights:  # a random head with the released layout
        from safetensors.torch import save_file

        weights = os.path.join(tempfile.mkdtemp(prefix="bench_rewards_"), "aesthetic.safetensors")
        save_file(AestheticMLP(768).state_dict(), weights)
    if args.aesthetic_clip:
        return Aesthetic(weights=weights, clip_pretrained=args.aesthetic_clip, **_common(args))
    model, _ = tiny_open_clip(seed=3, embed_dim=768, quick_gelu=True, **_tiny_kwargs(args))
    return Aesthetic(weights=weights, model=model, **_common(args))


BENCHMARKS: list[Benchmark] = [
    Benchmark("clipscore", build_clipscore),
    Benchmark("pickscore", build_pickscore),
    Benchmark("hpsv2", build_hpsv2),
    Benchmark("aesthetic", build_aesthetic),
]
# OCR needs images that hold text, so it runs through its own benchmark (rewards_ocr.py).
EXTRA = ("ocr",)


# ---------------------------------------------------------------------------------- timing

def _best_seconds(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(reward: Reward, images: torch.Tensor, prompts: list[str], repeats: int) -> tuple[float, float]:
    """-> (batched images/s, one-by-one images/s), best of `repeats`, after one warm-up each."""
    n, meta = images.shape[0], [{}] * images.shape[0]
    batched = lambda: reward(images, prompts, meta)
    single = lambda: [reward(images[i:i + 1], prompts[i:i + 1], meta[i:i + 1]) for i in range(n)]
    batched(), single()  # warm-up: lazy inits, allocator, kernel selection
    t_batched, t_single = [], []
    for _ in range(repeats):  # alternate so background load hits both sides alike
        t_batched += _best_seconds(batched, 1)
        t_single += _best_seconds(single, 1)
    return n / min(t_batched), n / min(t_single)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    p.add_argument("--n", type=int, default=64, help="images per scoring call")
    p.add_argument("--group-size", type=int, default=8, help="images per prompt (GRPO group)")
    p.add_argument("--resolution", type=int, default=256, help="side of the generated images")
    p.add_argument("--batch-size", type=int, default=64, help="the rewards' chunk size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 / bf16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    tiny = p.add_argument_group("tiny models (used when no real model is given)")
    tiny.add_argument("--width", type=int, default=128)
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--patch", type=int, default=32, help="32: ViT-B/32's 7x7 grid at 224 px")
    real = p.add_argument_group("real models")
    real.add_argument("--clip-model", help="hub id or folder, e.g. openai/clip-vit-large-patch14")
    real.add_argument("--pickscore-model", help="e.g. yuvalkirstain/PickScore_v1")
    real.add_argument("--pickscore-processor", default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    real.add_argument("--hpsv2-checkpoint", help="HPS_v2.1_compressed.pt path or hf:xswu/HPSv2/...")
    real.add_argument("--aesthetic-weights", help="sac+logos+ava1-l14-linearMSE.pth (default: random head)")
    real.add_argument("--aesthetic-clip", help="open_clip tag or file for ViT-L-14, e.g. openai")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = wanted - {b.name for b in BENCHMARKS} - set(EXTRA)
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; known: {[b.name for b in BENCHMARKS]}", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    images = torch.rand(args.n, 3, args.resolution, args.resolution, generator=g)  # [N, 3, R, R]
    prompts = [PROMPTS[(i // args.group_size) % len(PROMPTS)] + f" #{i // args.group_size}" for i in range(args.n)]
    print(f"{args.n} images of {args.resolution}px, {len(set(prompts))} prompts, device {args.device}, "
          f"batch_size {args.batch_size}, {torch.get_num_threads()} threads, best of {args.repeats}")
    rows = []
    for bench in BENCHMARKS:
        if wanted and bench.name not in wanted:
            continue
        reward = bench.build(args)
        batched, single = measure(reward, images.to(args.device), prompts, args.repeats)
        rows.append((bench.name, batched, single))
        print(f"  {bench.name}: {batched:.1f} img/s batched, {single:.1f} img/s one-by-one", flush=True)
    if not wanted or "ocr" in wanted:
        from rewards_ocr import ocr_benchmark

        ocr = ocr_benchmark(num_images=32, repeats=args.repeats)
        rows.append(("ocr", ocr["batched_img_s"], ocr["loop_img_s"]))
        print(f"  ocr: {ocr['batched_img_s']:.1f} img/s batched, {ocr['loop_img_s']:.1f} img/s one-by-one", flush=True)
    print("\nreward | batched img/s | one-by-one img/s | speedup")
    for name, batched, single in rows:
        print(f"{name} | {batched:.1f} | {single:.1f} | {batched / single:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
