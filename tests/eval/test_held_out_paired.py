"""The end-of-run report's paired changes: before_after gives each task, not only the task mean, its change and
the standard error of the paired per-image differences (same prompts and seeds before and after)."""

import math
import statistics
from contextlib import nullcontext

import pytest
import torch

from flowrl.data.prompts import PromptSet
from flowrl.eval import held_out
from tests.reward_fixtures import RedMinusBlue


def _images(scores: list[float]) -> torch.Tensor:
    """Images [N, 3, 2, 2] that RedMinusBlue scores ``scores``: red channel the score, blue 0."""
    images = torch.zeros(len(scores), 3, 2, 2)
    images[:, 0] = torch.tensor(scores)[:, None, None]
    return images


class _Policy:
    def reference(self):
        return nullcontext()


def test_before_after_pairs_each_task_and_the_task_mean(monkeypatch):
    # prompts p0, p1 (task a), p2 (task b), p3 (task c, unscorable: NaN images) x 2 images each
    nan = math.nan
    before = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, nan, nan]
    after = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, nan, nan]
    renders = iter([_images(before), _images(after)])
    monkeypatch.setattr(held_out, "render", lambda *args, **kwargs: next(renders))
    prompts = PromptSet(["p0", "p1", "p2", "p3"], [{"task": "a"}, {"task": "a"}, {"task": "b"}, {"task": "c"}])
    results, _, _ = held_out.before_after(_Policy(), None, [RedMinusBlue()], prompts, images_per_prompt=2,
                                          num_steps=1, guidance=1.0, seed=0)
    paired = results["paired"]
    # by hand: task a's differences (1, 0, 1, 0), task b's (0, -1); a task's s.e. is stdev / sqrt(n)
    differences = {"a": [1.0, 0.0, 1.0, 0.0], "b": [0.0, -1.0]}
    errors = {t: statistics.stdev(d) / math.sqrt(len(d)) for t, d in differences.items()}
    for task, d in differences.items():
        change = paired[f"eval/redness/task/{task}"]
        assert change["gain"] == pytest.approx(statistics.mean(d))
        assert change["standard_error"] == pytest.approx(errors[task])
        assert change["standard_errors"] == pytest.approx(statistics.mean(d) / errors[task])
        assert change["gain"] == pytest.approx(results["after"][f"eval/redness/task/{task}"]
                                               - results["before"][f"eval/redness/task/{task}"])
    assert errors["a"] == pytest.approx(math.sqrt(1 / 12)) and errors["b"] == pytest.approx(0.5)
    # the task mean: the mean of the tasks' gains (0.5 - 0.5) / 2, s.e. sqrt(sum of squared s.e.) / 2
    mean = paired["eval/redness/task_mean"]
    assert mean["gain"] == pytest.approx(0.0, abs=1e-7)
    assert mean["standard_error"] == pytest.approx(math.sqrt(errors["a"] ** 2 + errors["b"] ** 2) / 2)
    assert all(math.isnan(v) for v in paired["eval/redness/task/c"].values())  # nothing scored: no change
    assert set(paired) == {"eval/redness/task_mean", "eval/redness/task/a", "eval/redness/task/b",
                           "eval/redness/task/c"}


def test_before_after_without_tasks_pairs_nothing(monkeypatch):
    renders = iter([_images([0.0, 1.0]), _images([1.0, 1.0])])
    monkeypatch.setattr(held_out, "render", lambda *args, **kwargs: next(renders))
    results, _, _ = held_out.before_after(_Policy(), None, [RedMinusBlue()], PromptSet(["p0"]), images_per_prompt=2,
                                          num_steps=1, guidance=1.0, seed=0)
    assert "paired" not in results and results["after"]["eval/redness"] == 1.0
