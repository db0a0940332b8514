"""Keep the group advantages recipe grpo computes, in process or from ``accelerate launch`` processes.

In process: ``records = record_advantages(monkeypatch.setattr)``, then train. As a program:
``[accelerate launch ...] python -m tests.advantage_capture OUT_DIR train CONFIG [overrides]`` runs ``flowrl`` and
saves each process's records to ``OUT_DIR/advantages_rank<r>.pt``.
"""

import sys
from pathlib import Path

import torch


def record_advantages(patch=setattr, out: str | None = None) -> list[dict]:
    """Wrap recipe grpo's ``group_advantages``; each call appends ``{"advantages": [N_all], "group_ids": [N_all],
    "rewards": {key: [N_all]}}`` (every process's rows, gathered) to the list returned, saved in the folder ``out``
    after each call when given."""
    import flowrl.recipes.grpo as grpo

    records, real = [], grpo.group_advantages

    def recorded(run, traj, estimator):
        result = real(run, traj, estimator)
        gathered, advantages, _, _, group_ids = result
        records.append({"advantages": advantages.clone(), "group_ids": group_ids.clone(),
                        "rewards": {k: v.clone() for k, v in gathered.items()}})
        if out is not None:
            torch.save(records, Path(out) / f"advantages_rank{run.accelerator.process_index}.pt")
        return result

    patch(grpo, "group_advantages", recorded)
    return records


if __name__ == "__main__":
    from flowrl.cli import main

    record_advantages(out=sys.argv[1])
    sys.exit(main(sys.argv[2:]))
