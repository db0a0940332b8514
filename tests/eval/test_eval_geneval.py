"""``flowrl eval --suite`` with GenEval prompts: the tiny SD3 renders a GenEval-format prompt file, the geneval judge
(tiny random detector and CLIP) scores it, and results.json holds the per-task scores and their mean, the overall
score GenEval reports. The bare suite name ``geneval`` is the generated eval split."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests import REPO

TASKS = ["single_object", "counting", "colors", "position"]


def _suite(tmp_path: Path) -> Path:
    """One prompt of each of four tasks from the shipped GenEval sample."""
    records = [json.loads(line) for line in (REPO / "assets/prompts/geneval_train.jsonl").read_text().splitlines()]
    chosen = [next(r for r in records if r["metadata"]["tag"] == tag) for tag in TASKS]
    path = tmp_path / "geneval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return path


def _flowrl_eval(tmp_path: Path, suite: str, capsys) -> tuple[int, str]:
    from flowrl.cli import main

    cwd = os.getcwd()
    os.chdir(REPO)  # the smoke config names the tiny model and its files relative to the repository
    try:
        code = main(["eval", "configs/smoke/sd3_tiny.yaml", "--suite", suite, "--out", str(tmp_path / "eval"),
                     f"run_dir={tmp_path / 'run'}", "eval.images_per_prompt=2", "eval.num_steps=2",
                     "eval.batch_prompts=4", "eval.features=pixels",
                     "rewards=[{name: 'tests.rewards.test_rewards_geneval:tiny_geneval'}]"])
    finally:
        os.chdir(cwd)
    return code, capsys.readouterr().err


def test_eval_scores_a_geneval_file_per_task_and_overall(tmp_path, capsys):
    suite = _suite(tmp_path)
    code, err = _flowrl_eval(tmp_path, str(suite), capsys)
    assert code == 0, err
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["suite"] == str(suite) and results["tasks"] == TASKS  # GenEval's tag is the task
    base = results["metrics"]["base"]
    per_task = [base[f"reward/geneval/task/{t}"] for t in TASKS]
    assert all(v in (0.0, 0.5, 1.0) for v in per_task)  # two images a prompt, strict 0/1 each
    assert base["reward/geneval/task_mean"] == pytest.approx(sum(per_task) / len(per_task))
    assert base["reward/geneval"] == pytest.approx(sum(per_task) / len(per_task))  # one prompt per task
    # the sub-scores are logged beside it (not trained on: held_out/), per task too
    assert "held_out/geneval/partial/task_mean" in base and "held_out/geneval/count/task/counting" in base
    assert math.isnan(base["held_out/geneval/exclude/task/single_object"])  # no exclude clause there


def test_bare_geneval_suite_is_the_generated_split():
    from flowrl.eval.suites import load_suite
    from flowrl.data.tasks import row_tasks
    from flowrl.data.geneval import generate_split
    suite = load_suite("geneval")
    records = generate_split("eval", seed=0)
    assert suite.prompts == [r["prompt"] for r in records]
    assert row_tasks(suite.metadata) == [r["metadata"]["tag"] for r in records]  # GenEval's tag is the task
