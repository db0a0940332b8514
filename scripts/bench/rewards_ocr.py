"""Throughput of the OCR reward: one batched call (thread pool over images) against a per-image loop.

Run (offline, CPU; defaults: 32 images of 512x512, workers = min(4, CPUs), 1 ONNX thread each)::

    .venv/bin/python scripts/bench/rewards_ocr.py
    .venv/bin/python scripts/bench/rewards_ocr.py --num-images 64 --size 1024 --workers 8 --rapidocr-defaults

Images are black words of varied size and position on white, like a text-rendering prompt's output.
Both sides use the same ``OcrReward`` (same engines, already built by a warm-up call, so engine
construction is not timed): "loop" calls it on one image at a time (no pool), "batched" calls it once
on the whole batch. The target is batched >= loop in img/s. ``--rapidocr-defaults`` also times
rapidocr's stock settings (detector short side upscaled to 736, angle classifier on) on a few images
for context. The last line reads ``speedup ocr: X.XX``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from rewards.ocr import OcrReward

WORDS = ("hello", "flow", "matching", "OPEN", "coffee", "Grand Opening", "STOP", "diffusion")


def _images(num_images: int, size: int, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    rng = np.random.default_rng(seed)
    images, prompts = [], []
    for i in range(num_images):
        word = WORDS[i % len(WORDS)]
        im = Image.new("RGB", (size, size), "white")
        font = ImageFont.load_default(size=int(size * rng.uniform(0.08, 0.16)))
        xy = (size * rng.uniform(0.35, 0.65), size * rng.uniform(0.2, 0.8))
        ImageDraw.Draw(im).text(xy, word, fill="black", font=font, anchor="mm")
        images.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1))
        prompts.append(f'a poster with the text "{word}"')
    return torch.stack(images).float() / 255, prompts


def _timed(fn) -> tuple[float, float, object]:
    """-> (wall seconds, process CPU seconds, fn())."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def ocr_benchmark(num_images: int = 32, size: int = 512, num_workers: int | None = None,
                  num_threads: int = 1, repeats: int = 1, rapidocr_defaults: bool = False) -> dict:
    """Time batched vs per-image OCR scoring -> a flat dict of figures (seconds, img/s, speedup)."""
    images, prompts = _images(num_images, size)
    meta = [{}] * num_images
    reward = OcrReward(num_workers=num_workers, num_threads=num_threads)
    warm = min(reward.num_workers, num_images)
    reward(images[:warm], prompts[:warm], meta[:warm])  # builds every engine: not timed

    def loop() -> torch.Tensor:
        return torch.cat([reward(images[i:i + 1], prompts[i:i + 1], meta[i:i + 1])["ocr"]
                          for i in range(num_images)])

    loop_s, batched_s, loop_cpu, batched_cpu = [], [], [], []
    for _ in range(max(1, repeats)):  # alternate, so drifting machine load hits both sides
        t, c, loop_scores = _timed(loop)
        loop_s.append(t)
        loop_cpu.append(c)
        t, c, out = _timed(lambda: reward(images, prompts, meta))
        batched_s.append(t)
        batched_cpu.append(c)
    loop_t, batched_t = statistics.median(loop_s), statistics.median(batched_s)
    result = {
        "num_images": num_images, "size": size, "num_workers": reward.num_workers,
        "num_threads": num_threads, "cpus": os.cpu_count(),
        "loop_s": round(loop_t, 3), "loop_img_s": round(num_images / loop_t, 2),
        "batched_s": round(batched_t, 3), "batched_img_s": round(num_images / batched_t, 2),
        "speedup": round(loop_t / batched_t, 2),
        # CPU seconds per wall second: how many cores each side actually got
        "loop_cores_used": round(statistics.median(loop_cpu) / loop_t, 2),
        "batched_cores_used": round(statistics.median(batched_cpu) / batched_t, 2),
        "mean_score": round(float(out["ocr"].nanmean()), 4),
        "scores_match": bool(torch.allclose(loop_scores, out["ocr"], equal_nan=True)),
    }
    if rapidocr_defaults:
        from rapidocr_onnxruntime import RapidOCR

        stock = RapidOCR(intra_op_num_threads=num_threads, inter_op_num_threads=1)
        arrs = (images[:4] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).flip(-1).contiguous().numpy()
        stock(arrs[0])
        t, _, _ = _timed(lambda: [stock(a) for a in arrs])
        result["rapidocr_defaults_img_s"] = round(len(arrs) / t, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=32)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=None, help="thread pool size (default min(4, CPUs))")
    parser.add_argument("--threads", type=int, default=1, help="ONNX intra-op threads per engine")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rapidocr-defaults", action="store_true")
    args = parser.parse_args(argv)
    res = ocr_benchmark(args.num_images, args.size, args.workers, args.threads, args.repeats,
                        args.rapidocr_defaults)
    width = max(map(len, res))
    for key, value in res.items():
        print(f"{key:<{width}}  {value}")
    print(f"speedup ocr: {res['speedup']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
