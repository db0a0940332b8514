"""The per-axis scores of the benchmark suites (`flowrl.eval.suites`) and the eval runner's batching, held to
constructed images whose centroids, tones and style distributions are known by hand."""

from __future__ import annotations

import math

import pytest
import torch


def _square(x0: int, y0: int, size: int = 8, hw: int = 32) -> torch.Tensor:
    image = torch.zeros(3, hw, hw)
    image[:, y0:y0 + size, x0:x0 + size] = 1.0
    return image


def test_foreground_centroids():
    from flowrl.eval.suites import foreground_centroids

    images = torch.stack([_square(20, 4), _square(0, 24), torch.zeros(3, 32, 32), torch.full((3, 32, 32), 0.3)])
    centroids = foreground_centroids(images)
    expected = torch.tensor([[24 / 32, 8 / 32], [4 / 32, 28 / 32], [0.5, 0.5], [0.5, 0.5]])
    torch.testing.assert_close(centroids, expected)
    grey = torch.full((1, 3, 32, 32), 0.8)
    grey[..., 8:16, 16:32] = 0.2  # darker than its border: still the foreground
    torch.testing.assert_close(foreground_centroids(grey), torch.tensor([[0.75, 0.375]]))


def test_layout_spread():
    from flowrl.eval.suites import UNIFORM_SPREAD, layout_spread

    same = torch.stack([_square(12, 12)] * 3)
    apart = torch.stack([_square(4, 4), _square(20, 20)])  # centroids (0.25, 0.25) and (0.75, 0.75)
    spread = layout_spread(torch.cat([same, apart]), torch.tensor([0, 0, 0, 1, 1]))
    assert spread[0] == 0
    torch.testing.assert_close(spread[1], torch.tensor(0.125 ** 0.5 / UNIFORM_SPREAD))


def test_tonal_spread():
    from flowrl.eval.suites import tonal_spread, tonal_statistics

    grey = lambda v: torch.full((3, 16, 16), v)
    images = torch.stack([grey(0.2), grey(0.4), grey(0.6), grey(0.5), grey(0.5)])
    torch.testing.assert_close(tonal_statistics(images[:1]), torch.tensor([[0.2, 0.0]]))
    spread = tonal_spread(images, torch.tensor([0, 0, 0, 1, 1]))
    # brightness 0.2, 0.4, 0.6: population variance 0.08 / 3; contrast 0 throughout
    torch.testing.assert_close(spread, torch.tensor([(0.08 / 3) ** 0.5, 0.0]))
    half = torch.zeros(1, 3, 16, 16)
    half[..., :8] = 1.0  # luminance 0 and 1 on halves: mean 0.5, std 0.5
    torch.testing.assert_close(tonal_statistics(half), torch.tensor([[0.5, 0.5]]))


def test_style_dispersion():
    from flowrl.eval.suites import style_dispersion

    k = 5
    one_style = torch.eye(k)[[2, 2, 2, 2]]
    every_style = torch.eye(k)
    uniform = torch.full((3, k), 1 / k)
    two = torch.eye(k)[[0, 1]]
    probabilities = torch.cat([one_style, every_style, uniform, two])
    groups = torch.tensor([0] * 4 + [1] * k + [2] * 3 + [3] * 2)
    torch.testing.assert_close(style_dispersion(probabilities, groups),
                               torch.tensor([0.0, 1.0, 1.0, math.log(2) / math.log(k)]),
                               atol=1e-6, rtol=0)


def test_axis_scores_not_measured_and_chosen_groups():
    from flowrl.eval.suites import axis_scores

    images = torch.stack([_square(4, 4), _square(20, 20), _square(12, 12), _square(12, 12)])
    groups = torch.tensor([0, 0, 1, 1])
    scores, missing = axis_scores(images, groups, {0: ["layout", "style"], 1: ["identity"]})
    assert missing == ["identity", "style"] and set(scores) == {"axis/layout"}
    assert scores["axis/layout"] > 0  # group 0 only; group 1 (spread 0) does not leave layout free
    uniform = lambda x: torch.full((len(x), 4), 0.25)
    scores, missing = axis_scores(images, groups, {0: ["style"], 1: ["layout"]}, style_probe=uniform)
    assert missing == [] and scores == {"axis/style": pytest.approx(1.0), "axis/layout": 0.0}


def test_batches_are_consecutive_runs():
    from flowrl.eval.runner import _batches

    assert _batches([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    assert _batches([1, 3, 4, 9], 4) == [[1], [3, 4], [9]]
