"""Train a toy config on the four training prompts of tests/toy/test_toy_rl.py and count, on 48 common
ODE seeds per prompt, the images the run fixed and broke (strict ToyEval, paired before/after).

    python -m tools.toy_four_prompts configs/toy/nft.yaml --epochs 12 train.learning_rate=2e-3
    python -m tools.toy_four_prompts configs/toy/grpo.yaml --epochs 12 "rewards=[{name: toyeval}]" train.beta=0
    python -m tools.toy_four_prompts configs/toy/nft.yaml --prompt "three red squares" --prompt "two blue circles"

Prints the rollouts' strict score per epoch and ``strict before -> after, fixed, broken, s.e.`` with
s.e. = (fixed - broken) / sqrt(fixed + broken).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pytest

from rewards.toyeval import ToyEval
from tools.toy_runs import FOUR_PROMPTS, ode_images, paired_gain, train_on_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=48, help="common ODE seeds per prompt")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="PROMPT",
                        help="a training prompt to use instead of the test's four (repeat it)")
    args = parser.parse_intermixed_args()
    train_set = tuple(args.prompts or FOUR_PROMPTS)
    run_dir = Path(tempfile.mkdtemp(prefix="toy_four_"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        policy, cfg, metas = train_on_prompts(args.config, train_set, run_dir, monkeypatch, epochs=args.epochs,
                                              overrides=args.overrides)
        seeds = list(range(5000, 5000 + args.seeds))
        prompts = [p for p in train_set for _ in seeds]
        meta = [m for m in metas for _ in seeds]
        after = ToyEval()(ode_images(policy, cfg, train_set, seeds), prompts, meta)["toyeval"].float()
        with policy.reference():
            before = ToyEval()(ode_images(policy, cfg, train_set, seeds), prompts, meta)["toyeval"].float()
    for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        print(f"epoch {record['epoch']}: rollouts strict {record['reward/toyeval_mean']:.3f}")
    fixed, broken, gain = paired_gain(before, after)
    print(f"strict {before.mean():.3f} -> {after.mean():.3f}, fixed {fixed}, broken {broken}, {gain:.1f} s.e.")


if __name__ == "__main__":
    main()
