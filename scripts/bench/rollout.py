"""Overhead of flowrl's written-out SDE rollout against the plain diffusers pipeline.

Run (offline, every tiny family, defaults: 10 steps, 2 prompts x group 4 = 8 images, 5 repeats)::

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/rollout.py --threads 1
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/rollout.py --family sd3 \\
        --model stabilityai/stable-diffusion-3.5-medium --steps 28 --batch 8 --dtype bfloat16

``--threads 1`` on a small shared CPU box: two intra-op threads on two busy cores made the tiny
models several times slower and the timings erratic. If other jobs still load the cores, add
``--clock process`` (CPU time of this process instead of elapsed time; CPU device only).

What is measured, per family, on the same policy object (so both sides share the very same weights):

- flowrl: ``rollout(policy, prompts, RolloutSettings(num_steps=N, guidance_scale=w, noise_level=0.7), group_size=G,
  seeds=...)``,
  the full SDE rollout (every step stochastic, per-row noise generators, log-probs kept, latents stored),
  including its own prompt encoding and the VAE decode of the final latents.
- diffusers: ``policy.pipeline_images(...)``, the family's own pipeline ``__call__`` (for SD3:
  ``pipeline(prompt=prompts, num_images_per_prompt=G, num_inference_steps=N, guidance_scale=w, height,
  width, generator=<one per row, same seeds>, output_type="pt", max_sequence_length=...)``), i.e. its own
  prompt encoding, the ODE loop and the VAE decode, progress bar off.

Both sides encode the same P distinct prompts (with the empty negative prompt under SD3's CFG) and
produce the same P*G images at the same resolution. After one warm-up call of each, the two are
timed alternately (flowrl, diffusers, flowrl, ...) ``--repeats`` times with ``torch.cuda.synchronize``
around each call on GPU; the table reports the medians, their ratio (the target is <= 1.05) and the
extra time per denoising step, ``(flowrl - diffusers) / steps``, which is the fixed cost of the SDE
step (noise, log-prob, bookkeeping) that a larger transformer does not grow. The last lines read
``ratio <family>: X.XXX``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from flowrl.models import FAMILIES, build_policy
from flowrl.sampling import RolloutSettings, rollout

PROMPTS = [
    "a red circle on a white table",
    "two blue squares in the sky",
    "a cute cat sitting on a chair",
    "a small house near a river at night",
    "a green apple and a yellow banana",
    "a portrait of a woman, oil painting",
    "a horse in a forest, watercolor",
    "a city street at day, cinematic photo",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default=None, help="default: every family (with --model tiny)")
    parser.add_argument("--model", default="tiny", help='"tiny" (offline) or a hub id / local diffusers directory')
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="images per call = prompts x group size")
    parser.add_argument("--group-size", type=int, default=4, help="images per prompt (must divide --batch)")
    parser.add_argument("--guidance", type=float, default=None, help="default: the family's own (policy.default_guidance: 4.5 for sd3, 3.5 for flux, ...)")
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs)")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall: elapsed time; process: CPU time of this process (CPU device, --threads 1), "
                             "immune to other jobs competing for the cores")
    args = parser.parse_args(argv)
    if args.batch % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide --batch {args.batch}")
    if args.clock == "process" and args.device not in (None, "cpu"):
        parser.error("--clock process measures CPU time: only for --device cpu")
    if args.family is None and args.model != "tiny":
        parser.error("--family is required with a non-tiny --model")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, clock) -> float:
    _sync(device)
    start = clock()
    fn()
    _sync(device)
    return clock() - start


def bench_family(family: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    policy = build_policy(family, args.model, dtype=dtype, device=device, height=args.height, width=args.width)
    pipeline = policy.pipeline
    pipeline.set_progress_bar_config(disable=True)

    group = args.group_size
    num_prompts = args.batch // group
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    seeds = list(range(1000, 1000 + args.batch))  # one per row; the pipeline gets the same per-row generators
    guidance = policy.default_guidance if args.guidance is None else args.guidance
    metadata = policy.example_metadata(num_prompts)  # an editing family's source images; None for the others
    settings = RolloutSettings(num_steps=args.steps, guidance_scale=guidance, noise_level=args.noise_level)

    def flowrl_call():
        traj = rollout(policy, prompts, settings, group_size=group, seeds=seeds, metadata=metadata)
        assert traj.images.shape[0] == args.batch
        return traj

    def diffusers_call():
        images = policy.pipeline_images(prompts, group_size=group, num_steps=args.steps, guidance_scale=guidance,
                                        seeds=seeds, metadata=metadata)
        assert images.shape[0] == args.batch
        return images

    # Warm-up (allocator, kernels, lazy imports), then the same work in the same shapes on both sides.
    traj, images = flowrl_call(), diffusers_call()
    assert traj.images.shape == images.shape, (traj.images.shape, images.shape)

    if args.clock == "process" and device.type != "cpu":
        raise SystemExit("--clock process measures CPU time: only for a CPU device")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = {"flowrl": [], "diffusers": []}
    for _ in range(args.repeats):
        times["flowrl"].append(_timed(flowrl_call, device, clock))
        times["diffusers"].append(_timed(diffusers_call, device, clock))
    flowrl_s, diffusers_s = statistics.median(times["flowrl"]), statistics.median(times["diffusers"])
    return dict(family=family, model=args.model, steps=args.steps, batch=args.batch, device=device.type,
                dtype=dtype, flowrl=flowrl_s, diffusers=diffusers_s, ratio=flowrl_s / diffusers_s, times=times,
                overhead_ms=1000 * (flowrl_s - diffusers_s) / args.steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    families = [args.family] if args.family else list(FAMILIES)
    rows = [bench_family(family, args) for family in families]

    header = (f"{'family':<7} {'model':<24} {'device':<6} {'dtype':<9} {'steps':>5} {'batch':>5} "
              f"{'flowrl s':>9} {'diffusers s':>11} {'ratio':>6} {'extra ms/step':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        model = r["model"] if len(r["model"]) <= 24 else "..." + r["model"][-21:]
        print(f"{r['family']:<7} {model:<24} {r['device']:<6} {r['dtype']:<9} {r['steps']:>5} {r['batch']:>5} "
              f"{r['flowrl']:>9.3f} {r['diffusers']:>11.3f} {r['ratio']:>6.3f} {r['overhead_ms']:>13.2f}")
    print(f"(medians of {args.repeats} interleaved runs after one warm-up, {args.clock} clock; target ratio <= 1.05)")
    for r in rows:  # the spread says how far to trust a median on a busy machine
        spread = ", ".join(f"{side} {min(t):.3f}..{max(t):.3f} s" for side, t in r["times"].items())
        print(f"spread {r['family']}: {spread}")
    for r in rows:
        print(f"ratio {r['family']}: {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
