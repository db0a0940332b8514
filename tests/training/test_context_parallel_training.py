"""Training under sequence (context) parallelism: a context group's processes hold one data rank's rows
(:class:`flowrl.training.row_shards.RowShards`), and a tiny Wan run with Ulysses 2 on 2 gloo CPU processes trains
as the same config on one process does."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.core.context_parallel import ContextLayout
from flowrl.cli import main
from flowrl.training.metrics import read_metrics
from flowrl.training.row_shards import RowShards
from tests import REPO
from tests.two_processes import TWO_PROCESSES, launch_failure


class _Launch:
    """What RowShards reads of an accelerator, for process ``rank`` of ``world``: each process's tensor of a
    gather is its rank's ``values`` row (the processes of a context group hold the same one)."""

    def __init__(self, rank: int, world: int, values: dict[int, torch.Tensor]):
        self.process_index, self.num_processes, self.device, self.values = rank, world, torch.device("cpu"), values

    def gather(self, tensor):
        return torch.cat([self.values[r].reshape(tensor.shape) for r in range(self.num_processes)])

    def reduce(self, tensor, reduction):
        stacked = torch.stack([self.values[r] for r in range(self.num_processes)])
        return {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0).values}[reduction]


def test_row_shards_answer_per_data_rank_and_gather_each_row_once():
    """World 4 with Ulysses 2: processes (0, 1) hold data rank 0's rows, (2, 3) data rank 1's; a gather keeps one copy
    of each group's rows, a sum counts them once, and the gradient scale undoes DDP's mean over all 4 processes of
    gradients that sum over each group (2 data ranks x 2)."""
    rows = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([1.0, 2.0]), 2: torch.tensor([3.0, 4.0]),
            3: torch.tensor([3.0, 4.0])}
    layout = ContextLayout(world=4, ulysses=2)
    shards = [RowShards(_Launch(rank, 4, rows), layout) for rank in range(4)]
    assert [s.process_index for s in shards] == [0, 0, 1, 1] and shards[3].num_processes == 2
    assert shards[1].gather(rows[1]).tolist() == [1.0, 2.0, 3.0, 4.0]
    sums = {r: torch.tensor(float(rows[r].sum())) for r in rows}
    assert float(RowShards(_Launch(2, 4, sums), layout).reduce(sums[2], "sum")) == 10.0
    assert float(RowShards(_Launch(2, 4, sums), layout).reduce(sums[2], "max")) == 7.0
    assert shards[0].gradient_scale == 4.0
    plain = RowShards(_Launch(3, 4, rows))  # no context parallelism: the accelerator's own answers
    assert (plain.process_index, plain.num_processes, plain.gradient_scale) == (3, 4, 4.0)
    assert plain.gather(rows[3]).tolist() == [1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0]


COMMON = ["configs/smoke/wan_tiny.yaml", "train.epochs=2", "log.progress=false", "log.eval_every=0",
          "log.report_prompts=0", "train.learning_rate=1e-2", "train.beta=0.04"]
RECIPES = {"grpo": ["train.clip_range=0.2"], "nft": ["recipe=nft"]}


def _train(launcher: list[str], run_dir: Path, *overrides: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*launcher, "-m", "flowrl", "train", *COMMON, f"run_dir={run_dir}", *overrides], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, launch_failure(result.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_ulysses_on_two_processes_trains_as_one_process(tmp_path, recipe):
    """Wan with parallel.context.ulysses=2 on 2 gloo CPU processes (one context group, one data rank) against the
    same config on 1 process: every epoch's metrics (rewards, losses, advantages, the gradient norm) to rel 1e-3
    (abs 1e-6), and the exported LoRA to 1e-2 relative per tensor (as tests/training/test_distributed.py: at lr 1e-2
    Adam can move an entry of near-zero gradient by float-order noise). Measured: grpo epoch 0 bit-equal, epoch 1
    within 3.0e-4 relative (loss/total, whose policy part is ~1e-8 and differs by 7e-9), LoRA 4.3e-6; nft epochs
    within 1.0e-7 and 3.5e-6 relative, LoRA 8.6e-4.

    What each check guards: a group whose processes drew different rows (rows sharded by process, not by data
    rank) logs other rewards and advantages, and the float32 Ulysses attention that mixes the two processes' rows
    would not match either; a gradient left at the group's DDP mean (no factor for the context degree) logs half
    the gradient norm. Adam divides that factor out of the LoRA update, so the gradient norm is the check on it."""
    overrides = RECIPES[recipe]
    _train(TWO_PROCESSES, tmp_path / "context", "parallel.context.ulysses=2", *overrides)
    assert main(["train", *COMMON, f"run_dir={tmp_path / 'one'}", *overrides]) == 0  # in this process
    one, context = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "context")
    assert len(one) == len(context) == 2
    for a, b in zip(one, context):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith("perf/") and key != "step":
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["epoch"], key)
    assert one[-1]["perf/rollouts"] == context[-1]["perf/rollouts"]  # each row counted once
    lora_one = load_file(tmp_path / "one" / "lora" / "pytorch_lora_weights.safetensors")
    lora_context = load_file(tmp_path / "context" / "lora" / "pytorch_lora_weights.safetensors")
    assert lora_one.keys() == lora_context.keys()
    relative = {key: float((lora_one[key] - lora_context[key]).norm() / lora_one[key].norm().clamp(min=1e-12))
                for key in lora_one}
    assert max(relative.values()) < 1e-2, max(relative.items(), key=lambda item: item[1])
