"""Group-wise rewards at the reward seam: a reward with ``scores_groups = True`` is called once per group, with exactly
that group's rows, and its scores land back in row order; training's whole-group invariant; eval's groups."""

import logging
import math

import pytest
import torch

from flowrl.data.prompts import PromptSet
from flowrl.rewards_api import AsyncScorer, RewardError, check_whole_groups, group_rows, score


class Recording:
    """Scores each row by its mean pixel and, as ``/size``, the size of the batch it was called with; keeps every
    call's (images, prompts, metadata). Fails on a call holding a prompt with "bad" in it."""

    def __init__(self, name: str, groupwise: bool) -> None:
        self.name, self.scores_groups, self.calls = name, groupwise, []

    def __call__(self, images, prompts, metadata):
        self.calls.append((images.clone(), list(prompts), list(metadata)))
        if any("bad" in p for p in prompts):
            raise RuntimeError("judge crashed")
        n = images.shape[0]
        return {self.name: images.flatten(1).mean(1), f"{self.name}/size": torch.full((n,), float(n))}


def batch(groups: list[int], prompts: list[str] | None = None, seed: int = 0):
    n = len(groups)
    images = torch.rand(n, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    prompts = prompts or [f"prompt of group {g}" for g in groups]
    return images, prompts, [{"row": i} for i in range(n)], torch.tensor(groups)


def test_each_group_is_one_call_with_exactly_its_rows_and_scores_land_in_row_order():
    ids = [7, 2, 7, 5, 2, 7, 9]  # interleaved, out of order, one group of one row
    images, prompts, metadata, groups = batch(ids)
    grouped, pointwise = Recording("grouped", True), Recording("pointwise", False)
    out = score([pointwise, grouped], images, prompts, metadata, groups=groups)

    assert len(pointwise.calls) == 1 and torch.equal(pointwise.calls[0][0], images)  # pointwise: the whole batch
    expected_rows = {7: [0, 2, 5], 2: [1, 4], 5: [3], 9: [6]}
    assert len(grouped.calls) == len(expected_rows)
    for seen_images, seen_prompts, seen_metadata in grouped.calls:
        rows = [m["row"] for m in seen_metadata]
        group = ids[rows[0]]
        assert sorted(rows) == expected_rows[group], group  # exactly this group's rows, every one of them
        assert torch.equal(seen_images, images[rows]) and seen_prompts == [prompts[r] for r in rows]
    torch.testing.assert_close(out["grouped"], images.flatten(1).mean(1), rtol=0, atol=0)  # each row its own score
    sizes = [float(len(expected_rows[g])) for g in ids]
    assert out["grouped/size"].tolist() == sizes and out["pointwise/size"].tolist() == [7.0] * 7
    assert list(out) == ["pointwise", "pointwise/size", "grouped", "grouped/size"]

    async_out = AsyncScorer([pointwise, grouped]).submit(images, prompts, metadata, groups).result()
    assert async_out.keys() == out.keys() and all(torch.equal(async_out[k], out[k]) for k in out)


def test_without_group_ids_the_rows_of_one_prompt_form_a_group():
    prompts = ["a cat", "a dog", "a cat", "an owl", "a dog", "a cat"]
    images, _, metadata, _ = batch([0] * 6)
    grouped = Recording("grouped", True)
    out = score([grouped], images, prompts, metadata)
    assert sorted(sorted(m["row"] for m in call[2]) for call in grouped.calls) == [[0, 2, 5], [1, 4], [3]]
    assert all(len(set(call[1])) == 1 for call in grouped.calls)
    assert out["grouped/size"].tolist() == [3.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert [rows.tolist() for rows in group_rows(None, prompts)] == [[0, 2, 5], [1, 4], [3]]


def test_a_failing_group_scores_nan_and_the_others_are_kept(caplog):
    ids = [1, 0, 1, 0, 2, 2]
    images, _, metadata, groups = batch(ids)
    prompts = ["fine", "a bad one", "fine", "a bad one", "also fine", "also fine"]
    grouped = Recording("grouped", True)
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards"):
        out = score([grouped], images, prompts, metadata, groups=groups, on_error="nan")
    failed = torch.tensor([g == 0 for g in ids])
    for key in ("grouped", "grouped/size"):
        assert torch.isnan(out[key][failed]).all() and torch.isfinite(out[key][~failed]).all(), key
    torch.testing.assert_close(out["grouped"][~failed], images.flatten(1).mean(1)[~failed], rtol=0, atol=0)
    assert any("'grouped' failed on prompt 'a bad one'" in r.getMessage() and "the group NaN" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(RewardError, match="reward 'grouped' failed on prompt 'a bad one'"):
        score([grouped], images, prompts, metadata, groups=groups)


def test_a_group_of_clips_gets_its_frames_and_scores_each_clip_by_their_mean():
    clips = torch.rand(4, 5, 3, 4, 4, generator=torch.Generator().manual_seed(1))  # [N, T, 3, H, W]
    grouped = Recording("grouped", True)
    out = score([grouped], clips, ["p"] * 4, [{"row": i} for i in range(4)], groups=torch.tensor([1, 0, 0, 1]))
    assert len(grouped.calls) == 2 and all(call[0].shape == (2 * 3, 3, 4, 4) for call in grouped.calls)  # frames 0,2,4
    expected = clips[:, [0, 2, 4]].flatten(2).mean(2).mean(1)  # [N] the mean over each clip's scored frames
    torch.testing.assert_close(out["grouped"], expected)
    assert out["grouped/size"].tolist() == [6.0] * 4


@pytest.mark.parametrize("groups, message", [
    (torch.tensor([0.0, 1.0, 1.0]), "integer tensor"),
    ([0, 1, 1], "integer tensor"),
    (torch.tensor([0, 1]), r"expected \(3,\)"),
])
def test_bad_group_ids_are_one_line(groups, message):
    images, prompts, metadata, _ = batch([0, 1, 1])
    for call in (lambda: score([Recording("r", True)], images, prompts, metadata, groups=groups),
                 lambda: AsyncScorer([Recording("r", True)]).submit(images, prompts, metadata, groups)):
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def test_training_refuses_a_part_of_a_group_only_for_a_groupwise_reward():
    whole, part = torch.tensor([4, 4, 3, 3]), torch.tensor([4, 4, 3])
    check_whole_groups([Recording("grouped", True)], whole, 2)
    check_whole_groups([Recording("pointwise", False)], part, 2)  # a pointwise reward scores any rows
    with pytest.raises(RewardError, match="reward 'grouped' scores whole groups, but group 3 has 1 of its 2 rows"):
        check_whole_groups([Recording("pointwise", False), Recording("grouped", True)], part, 2)


def test_eval_scores_each_prompts_images_as_a_group_in_whole_prompt_chunks():
    """flowrl eval's reward metrics (chunks of at most 64 images) and the held-out scores give a group-wise reward
    one prompt's n images per call, a repeated prompt text included."""
    from flowrl.eval.held_out import evaluate_rows
    from flowrl.eval.runner import reward_metrics

    n, suite = 3, PromptSet(["a cat", "a dog", "a cat"] * 10)  # 30 prompts, 90 images: chunks of 63 and 27
    images = torch.rand(len(suite) * n, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    group_ids = torch.arange(len(suite)).repeat_interleave(n)
    grouped = Recording("grouped", True)
    metrics = reward_metrics([grouped], {"grouped"}, images, suite, n, group_ids)
    assert len(grouped.calls) == len(suite) and all(len(call[1]) == n for call in grouped.calls)
    assert metrics["reward/grouped"] == pytest.approx(float(images.mean()), abs=1e-6)
    grouped.calls.clear()
    _, scores = evaluate_rows(images, suite, n, [grouped], "none")
    assert len(grouped.calls) == len(suite) and scores["grouped/size"].tolist() == [float(n)] * len(images)
    assert not math.isnan(float(scores["grouped"].mean()))
