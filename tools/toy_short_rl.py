"""Train a toy config on a few training prompts (by default the eight counting prompts of tests/toy/test_toy_rl.py)
and count, on common ODE seeds per prompt, the images the run fixed and broke (strict ToyEval, paired
before/after).

    python -m tools.toy_short_rl configs/toy/nft.yaml --epochs 12 --seeds 96 seed=1
    python -m tools.toy_short_rl configs/toy/grpo.yaml --epochs 16 --seeds 96
    python -m tools.toy_short_rl configs/toy/nft.yaml --set four --epochs 12 train.learning_rate=3e-3
    python -m tools.toy_short_rl configs/toy/nft.yaml --prompt "three red squares" --prompt "two blue circles"

Prints the rollouts' strict score per epoch, the seconds spent training and evaluating, and
``strict before -> after, fixed, broken, s.e.`` with s.e. = (fixed - broken) / sqrt(fixed + broken).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

from rewards.toyeval import ToyEval
from tools.toy_runs import PROMPT_SETS, ode_images, paired_gain, train_on_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=96, help="common ODE seeds per prompt")
    parser.add_argument("--set", choices=sorted(PROMPT_SETS), default="counting", help="the training prompts")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="PROMPT",
                        help="a training prompt to use instead of the set (repeat it)")
    args = parser.parse_intermixed_args()
    train_set = tuple(args.prompts or PROMPT_SETS[args.set])
    run_dir = Path(tempfile.mkdtemp(prefix="toy_short_rl_"))
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as monkeypatch:
        policy, cfg, metas = train_on_prompts(args.config, train_set, run_dir, monkeypatch, epochs=args.epochs,
                                              overrides=args.overrides)
        trained = time.perf_counter()
        seeds = list(range(5000, 5000 + args.seeds))
        prompts = [p for p in train_set for _ in seeds]
        meta = [m for m in metas for _ in seeds]
        after = ToyEval()(ode_images(policy, cfg, train_set, seeds), prompts, meta)["toyeval"].float()
        with policy.reference():
            before = ToyEval()(ode_images(policy, cfg, train_set, seeds), prompts, meta)["toyeval"].float()
    evaluated = time.perf_counter()
    for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        print(f"epoch {record['epoch']}: rollouts strict {record['reward/toyeval_mean']:.3f}")
    fixed, broken, gain = paired_gain(before, after)
    print(f"{torch.get_num_threads()} threads: training {trained - start:.0f} s, evaluation {evaluated - trained:.0f} s")
    print(f"strict {before.mean():.3f} -> {after.mean():.3f}, fixed {fixed}, broken {broken}, {gain:.1f} s.e.")


if __name__ == "__main__":
    main()
