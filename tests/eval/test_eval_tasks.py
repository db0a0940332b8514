"""GenEval-style scoring by task: per-task means and their mean, task-stratified prompt subsets, the
unbiased pass@k estimator, and the per-task keys of a tiny run's held-out curve and report."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import itertools
import json
import math

import pytest
import torch

from flowrl.data.prompts import PromptSet
from flowrl.data.tasks import by_task, paired_task_mean_gain, pass_at_k, stratified_prefix
from flowrl.eval.held_out import evaluate
from flowrl.training.metrics import read_metrics
from tests.reward_fixtures import RedMinusBlue


def test_by_task_means_each_task_then_the_tasks():
    nan = math.nan
    scores = {"s": torch.tensor([1.0, 0.0, 1.0, 1.0, nan, 0.0]), "t": torch.tensor([0.2, 0.4, 1.0, 0.0, 0.9, 0.3])}
    out = by_task(scores, ["a", "a", "b", "b", "c", "c"])
    # s: a = (1 + 0) / 2, b = (1 + 1) / 2, c = 0 (its NaN skipped); mean over tasks (0.5 + 1 + 0) / 3.
    assert out["s/task/a"] == 0.5 and out["s/task/b"] == 1.0 and out["s/task/c"] == 0.0
    assert out["s/task_mean"] == pytest.approx(0.5)
    # t: a (0.2 + 0.4) / 2, b (1 + 0) / 2, c (0.9 + 0.3) / 2 -> (0.3 + 0.5 + 0.6) / 3.
    assert out["t/task/a"] == pytest.approx(0.3) and out["t/task_mean"] == pytest.approx(1.4 / 3)
    # Unequal tasks: the mean over tasks is not the mean over images.
    out = by_task({"t": torch.tensor([1.0, 1.0, 1.0, 0.0])}, ["a", "a", "a", "b"])
    assert out["t/task_mean"] == 0.5  # (1 + 0) / 2, while the image mean is 0.75
    assert list(by_task(scores, ["a"] * 6)) == ["s/task/a", "s/task_mean", "t/task/a", "t/task_mean"]


def test_by_task_skips_all_nan_tasks_and_untasked_rows():
    out = by_task({"s": torch.tensor([1.0, 0.0, math.nan, 1.0])}, ["a", "a", "b", None])
    # a = 0.5; b is all NaN (NaN itself, left out of the mean); the untasked row counts nowhere.
    assert out["s/task/a"] == 0.5 and math.isnan(out["s/task/b"]) and out["s/task_mean"] == 0.5
    assert set(out) == {"s/task/a", "s/task/b", "s/task_mean"}


def _tasked(tasks):
    return PromptSet([f"p{i}" for i in range(len(tasks))], [{"task": t} for t in tasks])


def test_stratified_prefix_takes_tasks_round_robin_in_file_order():
    prompts = _tasked(["a", "b", "c", "a", "b", "c", "c", "c", "c"])
    # Round-robin: p0 (a), p1 (b), p2 (c), p3 (a), p4 (b), p5 (c), then a and b are spent: p6, p7 (c).
    assert stratified_prefix(prompts, 8).prompts == ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"]
    assert stratified_prefix(prompts, 4).prompts == ["p0", "p1", "p2", "p3"]
    # A file whose tail is one task: a plain prefix of 6 would hold 1 a, 1 b, 4 c; stratified, 2 each.
    tail = _tasked(["a", "b", "c", "c", "c", "c", "a", "b"])
    assert [m["task"] for m in stratified_prefix(tail, 6).metadata] == ["a", "b", "c", "a", "b", "c"]
    assert len(stratified_prefix(prompts, 100)) == 9 and len(stratified_prefix(prompts, 0)) == 0


def test_stratified_prefix_without_tasks_is_the_plain_prefix():
    plain = PromptSet([f"p{i}" for i in range(5)])
    assert stratified_prefix(plain, 3).prompts == ["p0", "p1", "p2"]
    assert stratified_prefix(plain, 3, key="missing").prompts == ["p0", "p1", "p2"]


@pytest.mark.parametrize("n, c", [(5, 0), (5, 1), (5, 2), (6, 3), (6, 6)])
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_right_sample(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    # By hand: n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6.
    assert pass_at_k(4, 1, 2) == 0.5


def test_evaluate_adds_per_task_keys_only_with_task_metadata():
    images = torch.rand(6, 3, 8, 8)
    tasked = evaluate(images, _tasked(["a", "b", "b"]), 2, [RedMinusBlue()], "none")
    redness = (images[:, 0] - images[:, 2]).mean(dim=(1, 2))
    assert tasked["eval/redness"] == pytest.approx(float(redness.mean()))
    assert tasked["eval/redness/task/a"] == pytest.approx(float(redness[:2].mean()))
    assert tasked["eval/redness/task/b"] == pytest.approx(float(redness[2:].mean()))
    assert tasked["eval/redness/task_mean"] == pytest.approx(float((redness[:2].mean() + redness[2:].mean()) / 2))
    plain = evaluate(images, PromptSet(["p0", "p1", "p2"]), 2, [RedMinusBlue()], "none")
    assert list(plain) == ["eval/redness"]


def test_tiny_run_reports_and_curves_per_task(tmp_path):
    from flowrl.config import Config, load_config
    from flowrl.recipes.grpo import train

    prompts = tmp_path / "prompts.jsonl"  # the tail is all task "b": a plain prefix of 2 would miss "a"
    records = [("a red dog", "a"), ("a blue cat", "b"), ("a green cat", "b"), ("a cat", "b")]
    prompts.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": t}}) + "\n" for p, t in records))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": t}}) + "\n"
                                for p, t in [records[1], records[2], records[0]]))
    cfg = load_config(Config, "configs/smoke/sd3_tiny.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.epochs=1", "log.progress=false", "log.eval_every=0",
        f"data.prompts={prompts}", f"data.test_prompts={held_out}", "log.test_every=1", "log.test_prompts=2",
        "log.report_prompts=2", "log.eval_images_per_prompt=2", "train.checkpoint_every=0", "train.export_lora=false"])
    metrics = train(cfg)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["prompts_per_task"] == {"b": 1, "a": 1}
    for when in ("before", "after"):
        assert set(report[when]) == {"eval/brightness", "eval/brightness/task/a", "eval/brightness/task/b",
                                     "eval/brightness/task_mean"}
        scores = report[when]
        assert scores["eval/brightness/task_mean"] == pytest.approx(
            (scores["eval/brightness/task/a"] + scores["eval/brightness/task/b"]) / 2)
    assert "report/after/eval/brightness/task_mean" in metrics
    paired = report["paired"]["eval/brightness/task_mean"]  # same prompts and seeds: the paired change
    change = report["after"]["eval/brightness/task_mean"] - report["before"]["eval/brightness/task_mean"]
    assert paired["gain"] == pytest.approx(change, abs=1e-6)
    assert "paired standard errors" in (tmp_path / "run" / "report.md").read_text()
    assert "task_mean" in (tmp_path / "run" / "report.md").read_text()
    curve = [r for r in read_metrics(tmp_path / "run") if "test/brightness" in r]
    assert [r["epoch"] for r in curve] == [-1, 0]
    assert all({"test/brightness/task/a", "test/brightness/task/b", "test/brightness/task_mean"} <= set(r)
               for r in curve)


def test_paired_task_mean_gain_matches_a_hand_computation():
    # Task a: differences (1, 0, 1, 0): mean 0.5, sample variance 1/3 over 4 pairs -> 1/12.
    # Task b: differences (0, -1): mean -0.5, sample variance 0.5 over 2 pairs -> 0.25. A NaN pair is dropped.
    # gain = (0.5 - 0.5) / 2 = 0; s.e. = sqrt(1/12 + 1/4) / 2 = 0.288675.
    before = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, float("nan")])
    after = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    out = paired_task_mean_gain(before, after, ["a", "a", "a", "a", "b", "b", "b"])
    assert out["gain"] == pytest.approx(0.0, abs=1e-7)
    assert out["standard_error"] == pytest.approx(math.sqrt(1 / 12 + 1 / 4) / 2)
    # Only task a: gain 0.5, s.e. sqrt(1/12) -> 1.732 standard errors.
    out = paired_task_mean_gain(before[:4], after[:4], ["a"] * 4)
    assert out["gain"] == pytest.approx(0.5) and out["standard_errors"] == pytest.approx(0.5 / math.sqrt(1 / 12))


def test_geneval_records_name_their_task_tag():
    from flowrl.data.prompts import PromptSet
    from flowrl.data.tasks import row_tasks, stratified_prefix, task_of
    counting = {"tag": "counting", "include": [{"class": "dog", "count": 3}], "exclude": [{"class": "dog", "count": 4}]}
    colors = {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}]}
    assert task_of(counting) == "counting" and task_of({"tag": "x"}) is None  # a tag without GenEval's include
    assert task_of({"task": "a", "tag": "b", "include": []}) == "a"
    assert row_tasks([counting, colors, None]) == ["counting", "colors", None]
    prompts = PromptSet(["c1", "c2", "k1"], [counting, counting, colors])
    assert stratified_prefix(prompts, 2).prompts == ["c1", "k1"]
