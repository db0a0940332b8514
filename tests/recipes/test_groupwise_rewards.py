"""A group-wise reward in training: called once per whole group, on one process and on two, it gives the same
advantages as the pointwise reward of the same numbers (``tests.reward_fixtures:GroupBrightness`` is ``brightness``
declared group-wise)."""

import json
import os
import subprocess

import pytest
import torch

from flowrl.config import Config, load_config
from flowrl.recipes.grpo import train
from tests import REPO
from tests.advantage_capture import record_advantages
from tests.two_processes import TWO_PROCESSES, launch_failure

GROUP_SIZE = 4
COMMON = ["train.epochs=1", "log.progress=false", "log.eval_every=0", "log.report_prompts=0", "log.test_every=0",
          "train.export_lora=false", "sampling.num_steps=2", f"sampling.group_size={GROUP_SIZE}",
          "train.micro_batch_size=4"]


def groupwise(record) -> str:
    return f"rewards=[{{name: 'tests.reward_fixtures:GroupBrightness', kwargs: {{record: '{record}'}}}}]"


def calls(record) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.fixture(scope="module")
def pointwise(tmp_path_factory):
    """The advantages of one process training on ``brightness``: 2 groups of 4."""
    with pytest.MonkeyPatch.context() as patch:
        records = record_advantages(patch.setattr)
        run_dir = tmp_path_factory.mktemp("pointwise") / "run"
        train(load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml",
                          [f"run_dir={run_dir}", *COMMON, "sampling.prompts_per_batch=2"]))
    (record,) = records
    assert record["group_ids"].unique().numel() == 2 and record["advantages"].abs().sum() > 0
    return record


def assert_same_advantages(record, pointwise, atol):
    """The same rows in the same order, the same rewards and advantages (about 1 in size; a row scored as another
    would be off by about 1)."""
    assert torch.equal(record["group_ids"], pointwise["group_ids"])
    torch.testing.assert_close(record["rewards"]["brightness"], pointwise["rewards"]["brightness"], rtol=0, atol=1e-6)
    torch.testing.assert_close(record["advantages"], pointwise["advantages"], rtol=0, atol=atol)


def test_a_groupwise_reward_gives_the_pointwise_advantages(tmp_path, monkeypatch, pointwise):
    records, seen = record_advantages(monkeypatch.setattr), tmp_path / "calls.jsonl"
    train(load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml",
                      [f"run_dir={tmp_path / 'run'}", *COMMON, "sampling.prompts_per_batch=2", groupwise(seen)]))
    assert calls(seen) == [{"rows": GROUP_SIZE, "prompts": 1}] * 2  # one call per group, every row of it
    assert_same_advantages(records[0], pointwise, atol=1e-5)


@pytest.mark.slow
def test_two_processes_score_whole_groups_where_they_were_sampled(tmp_path, pointwise):
    """2 gloo CPU processes, a group each (the same global batch as the 1-process run): each process's reward
    calls hold one whole group, and the gathered advantages equal the 1-process pointwise run's."""
    seen = tmp_path / "calls.jsonl"
    launch = TWO_PROCESSES
    command = [*launch, "-m", "tests.advantage_capture", str(tmp_path), "train", "configs/smoke/sd3_tiny.yaml",
               f"run_dir={tmp_path / 'run'}", *COMMON, "sampling.prompts_per_batch=1", groupwise(seen)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, launch_failure(result.stderr)
    assert calls(seen) == [{"rows": GROUP_SIZE, "prompts": 1}] * 2  # a whole group on each process
    for rank in (0, 1):
        (record,) = torch.load(tmp_path / f"advantages_rank{rank}.pt", weights_only=True)
        # Two processes sample in batches of another shape: rewards ~1e-7 apart over a group std of ~4e-3.
        assert_same_advantages(record, pointwise, atol=1e-3)


def test_a_built_reward_that_declares_itself_groupwise_is_refused_where_groups_are_scored_in_parts():
    """start_run checks the built rewards too: an instance may set scores_groups (a remote judge)."""
    from flowrl.config import ConfigError
    from flowrl.recipes.names import check_group_rewards
    from tests.reward_fixtures import GroupBrightness

    pilot = load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml",
                        ["sampling.pilot.candidates=2", "sampling.pilot.group_size=2"])
    judge = GroupBrightness()
    judge.name = "judge"
    check_group_rewards(pilot)  # brightness: pointwise
    check_group_rewards(load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml"), [judge])  # whole groups
    with pytest.raises(ConfigError, match="'sampling.pilot.candidates': reward 'judge' scores each group whole"):
        check_group_rewards(pilot, [judge])
