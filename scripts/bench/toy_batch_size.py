"""ODE sampling speed of the toy model against the number of images per model call, on a CPU.

Run (offline, the shipped toy model, 10 steps at guidance 3, eight counting prompts of the RL training split)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/toy_batch_size.py
    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/toy_batch_size.py --seeds 96 --chunks 768 32

Why it matters: the toy transformer is narrow (96 wide, 81 tokens), so each of its ops streams its activations
through memory once. One call of 768 images holds 1536 rows with guidance, megabytes per activation, and every op
waits on memory; a call of a few dozen images keeps them in the caches. ``tools.toy_runs.ode_images`` (the toy
learning and collapse tests) samples in calls of ``EVAL_CHUNK`` images for this reason.

Prints milliseconds per image for each ``--chunks`` size (images per call; each must divide or be a multiple of
``--seeds``), the best of ``--repeats`` timings after one warm-up call of each.
"""

from __future__ import annotations

import argparse
import time

import torch

from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, chunked_rollout
from flowrl.toy.prompts import train_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=96,
                        help="images per prompt (8 prompts); 96 is the toy learning tests' number")
    parser.add_argument("--chunks", type=int, nargs="+", default=[768, 192, 96, 48, 32, 16, 8])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    policy = build_policy("sd3", "assets/toy", max_sequence_length=1)
    settings = RolloutSettings(num_steps=10, guidance_scale=3.0, noise_level=0.0)
    prompts = [prompt for prompt, meta in train_prompts(0) if meta["task"] == "counting"][:8]
    seeds = list(range(args.seeds)) * len(prompts)

    def sample(chunk: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            chunked_rollout(policy, prompts, settings, group_size=args.seeds, seeds=seeds, chunk=chunk)
        return time.perf_counter() - start

    for chunk in args.chunks:
        sample(chunk)  # warm-up
    print(f"{len(seeds)} images, {torch.get_num_threads()} torch thread(s)")
    print("| images per call | ms per image |\n|---|---|")
    for chunk in args.chunks:
        best = min(sample(chunk) for _ in range(args.repeats))
        print(f"| {chunk} | {1000 * best / len(seeds):.1f} |")


if __name__ == "__main__":
    main()
