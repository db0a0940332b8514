"""pass@k of the base toy model: the ceiling that RL sharpening (moving mass onto samples the model already
draws) can reach on ToyEval strict.

For ``--per-task`` x (number of tasks) prompts taken round-robin over tasks in file order, as the run's
held-out subsets (so ``--per-task`` of each task; a task with fewer prompts leaves its share to the
others), sample ``--k`` images per prompt on common seeds (the same seeds for every prompt) and score them
with ToyEval strict. Per task, and as the mean over tasks (GenEval's overall score), it prints:

    prompts | pass@1 (= mean strict) | pass@2 | pass@4 | ... | pass@k | mixed

pass@j is the unbiased estimator 1 - C(n-c, j) / C(n, j) of each prompt (c right of n samples), averaged
over the task's prompts; "mixed" is the fraction of prompts whose group holds both right and wrong images
(the groups where group-relative RL has a signal). ODE sampling (noise level 0) by default; with
``--noise-level 0.7`` the rollouts are full SDE, as GRPO's training rollouts.

    python scripts/toy_passk.py                                   # held-out prompts, ODE
    python scripts/toy_passk.py --split train --noise-level 0.7   # training prompts, SDE rollouts
"""

from __future__ import annotations

import argparse
import time

import torch

from flowrl.data.prompts import load_prompts
from flowrl.data.tasks import pass_at_k, stratified_prefix
from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, StepPlan, rollout, root_seeds

PROMPT_FILES = {"heldout": "assets/prompts/toy/heldout.jsonl", "train": "assets/prompts/toy/train.jsonl"}


@torch.no_grad()
def sample_groups(policy, prompts, *, k: int, num_steps: int, guidance: float, noise_level: float, seed: int,
                  batch_prompts: int) -> torch.Tensor:
    """[P * k, 3, H, W], prompt-major; prompt p's j-th image starts from seed j (common seeds)."""
    # ODE: one stored step with no noise (nothing else stored); SDE: every step stochastic, as in training.
    plan = StepPlan(num_steps) if noise_level > 0 else StepPlan(num_steps, sde_start=num_steps - 1, sde_size=1)
    settings = RolloutSettings(num_steps=num_steps, guidance_scale=guidance, noise_level=noise_level, plan=plan)
    seeds = root_seeds(seed, 0, k)
    images = []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts.subset(range(start, min(start + batch_prompts, len(prompts))))
        torch.manual_seed(seed + start)
        traj = rollout(policy, chunk.prompts, settings, group_size=k, seeds=seeds * len(chunk),
                       metadata=chunk.metadata)
        images.append(traj.images.cpu())
    return torch.cat(images)


def passk_table(strict: torch.Tensor, tasks: list[str], ks: list[int]) -> dict[str, dict[str, float]]:
    """{task or "task-mean": {"prompts", "pass@j"..., "mixed"}} from ``strict`` [P, k] in {0, 1} (NaN: wrong)."""
    right = torch.nan_to_num(strict, nan=0.0).round().long()
    n = strict.shape[1]
    rows: dict[str, dict[str, float]] = {}
    for task in dict.fromkeys(tasks):
        counts = [int(right[i].sum()) for i, t in enumerate(tasks) if t == task]
        row = {"prompts": len(counts)}
        row.update({f"pass@{j}": sum(pass_at_k(n, c, j) for c in counts) / len(counts) for j in ks})
        row["mixed"] = sum(0 < c < n for c in counts) / len(counts)
        rows[task] = row
    rows["task-mean"] = {key: (sum(r[key] for r in rows.values()) if key == "prompts" else
                               sum(r[key] for r in rows.values()) / len(rows)) for key in next(iter(rows.values()))}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=sorted(PROMPT_FILES), default="heldout")
    parser.add_argument("--prompts", help="a prompt file (overrides --split)")
    parser.add_argument("--per-task", type=int, default=16, help="prompts per task; a task with fewer leaves its share to the others")
    parser.add_argument("--k", type=int, default=16, help="seeds (samples) per prompt")
    parser.add_argument("--noise-level", type=float, default=0.0, help="0: ODE; > 0: full-SDE rollouts")
    parser.add_argument("--model", default="assets/toy")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-prompts", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from rewards.toyeval import ToyEval

    torch.manual_seed(args.seed)
    path = args.prompts or PROMPT_FILES[args.split]
    everything = load_prompts(path)
    tasks_in_file = list(dict.fromkeys(m.get("task") for m in everything.metadata))
    prompts = stratified_prefix(everything, args.per_task * len(tasks_in_file))
    tasks = [m.get("task") for m in prompts.metadata]
    print(f"{path}: {len(everything)} prompts, per task "
          + ", ".join(f"{t} {sum(m.get('task') == t for m in everything.metadata)}" for t in tasks_in_file)
          + f"; using {len(prompts)} (" + ", ".join(f"{t} {tasks.count(t)}" for t in dict.fromkeys(tasks)) + ")")

    policy = build_policy("sd3", args.model, max_sequence_length=1, device=args.device, seed=args.seed)
    began = time.perf_counter()
    images = sample_groups(policy, prompts, k=args.k, num_steps=args.num_steps, guidance=args.guidance,
                           noise_level=args.noise_level, seed=args.seed, batch_prompts=args.batch_prompts)
    row_prompts = [p for p in prompts.prompts for _ in range(args.k)]
    row_metadata = [m for m in prompts.metadata for _ in range(args.k)]
    strict = ToyEval()(images, row_prompts, row_metadata)["toyeval"].view(len(prompts), args.k)
    nans = int(strict.isnan().sum())
    sampler = "ODE" if args.noise_level == 0 else f"full SDE, noise level {args.noise_level}"
    print(f"{len(prompts)} prompts x {args.k} seeds, {sampler}, {args.num_steps} steps, guidance {args.guidance}, "
          f"{time.perf_counter() - began:.0f} s" + (f"; {nans} NaN scores counted wrong" if nans else ""))

    ks = [j for j in (1, 2, 4, 8, 16, 32, 64) if j <= args.k]
    rows = passk_table(strict, tasks, ks)
    width = max(map(len, rows))
    print(f"\n{'task':<{width}} | prompts | " + " | ".join(f"{'pass@' + str(j):>7}" for j in ks) + " |   mixed")
    for task, row in rows.items():
        print(f"{task:<{width}} | {row['prompts']:>7} | " + " | ".join(f"{row[f'pass@{j}']:>7.3f}" for j in ks)
              + f" | {row['mixed']:>7.3f}")


if __name__ == "__main__":
    main()
