"""Score a trained toy adapter against the base model on held-out prompts, with more images than a
run's own end-of-run report: per task, the task mean and the paired standard error of its change.

    python scripts/toy_report.py runs/toy_nft/lora --images 32 --out runs/toy_nft/report_32

It writes the same report.md / report.json / before.png / after.png as a run (``flowrl.eval.report``).
"""

from __future__ import annotations

import argparse
import os

import torch

from flowrl.data.prompts import load_prompts
from flowrl.data.tasks import stratified_prefix
from flowrl.models import build_policy
from flowrl.models.lora_io import load_lora_into
from flowrl.eval.report import write_report
from rewards.toyeval import ToyEval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lora", help="an exported LoRA (a run's lora/ directory or its .safetensors file)")
    parser.add_argument("--out", required=True, help="directory for the report")
    parser.add_argument("--prompts", default="assets/prompts/toy/heldout.jsonl")
    parser.add_argument("--num-prompts", type=int, default=64, help="taken round-robin over tasks")
    parser.add_argument("--images", type=int, default=32, help="images per prompt, the same seeds before and after")
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=2, help="seed of the images (a run's report uses its seed + 2)")
    args = parser.parse_args()
    torch.manual_seed(0)
    policy = build_policy("sd3", "assets/toy", max_sequence_length=1, device=torch.device("cpu"))
    load_lora_into(policy, args.lora)
    prompts = stratified_prefix(load_prompts(args.prompts), args.num_prompts)
    os.makedirs(args.out, exist_ok=True)
    results = write_report(args.out, policy=policy, ema=None, rewards=[ToyEval()], prompts=prompts,
                           images_per_prompt=args.images, num_steps=10, guidance=args.guidance, seed=args.seed)
    paired = results["paired"]["eval/toyeval/task_mean"]
    print(f"task-mean strict ToyEval {results['before']['eval/toyeval/task_mean']:.3f} -> "
          f"{results['after']['eval/toyeval/task_mean']:.3f} ({paired['gain']:+.3f}, "
          f"{paired['standard_errors']:.1f} paired standard errors); per task:")
    for key in results["before"]:
        if key.startswith("eval/toyeval/task/"):
            print(f"  {key.removeprefix('eval/toyeval/task/'):>13}: {results['before'][key]:.3f} -> "
                  f"{results['after'][key]:.3f}")


if __name__ == "__main__":
    main()
