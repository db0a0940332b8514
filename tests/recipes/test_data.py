"""Prompt files, deterministic splits, and per-epoch shuffling sharded across processes."""

import json
from collections import Counter

import pytest

from flowrl.data.prompts import PromptSet, epoch_prompt_indices, load_prompts, round_robin, train_test_split


def test_txt_and_jsonl_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n  a dog  \n")
    assert load_prompts(txt).prompts == ["a cat", "a dog"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": 'a sign that says "OPEN"', "metadata": {"text": "OPEN"}}) + "\n"
                     + json.dumps({"prompt": "a dog"}) + "\n")
    loaded = load_prompts(jsonl)
    assert loaded.prompts[0] == 'a sign that says "OPEN"' and loaded.metadata == [{"text": "OPEN"}, {}]


@pytest.mark.parametrize("content, suffix, message", [
    ('{"prompt": 1}\n', ".jsonl", "p.jsonl:1: each line needs a string field 'prompt'"),
    ("{oops\n", ".jsonl", "p.jsonl:1: invalid JSON"),
    ("", ".txt", "holds no prompts"),
    ("a cat\n", ".csv", "use .txt or .jsonl"),
])
def test_bad_prompt_files_get_one_line_errors(tmp_path, content, suffix, message):
    path = tmp_path / f"p{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as error:
        load_prompts(path)
    assert "\n" not in str(error.value)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.txt")


def test_split_is_deterministic_disjoint_and_complete():
    prompts = PromptSet([f"p{i}" for i in range(20)])
    train, test = train_test_split(prompts, 0.25, seed=3)
    again_train, again_test = train_test_split(prompts, 0.25, seed=3)
    assert train.prompts == again_train.prompts and test.prompts == again_test.prompts
    assert len(test) == 5 and not set(train.prompts) & set(test.prompts)
    assert sorted(train.prompts + test.prompts) == sorted(prompts.prompts)
    assert train_test_split(prompts, 0.25, seed=4)[1].prompts != test.prompts


def test_epoch_shards_partition_the_single_process_batch():
    single = epoch_prompt_indices(10, 6, seed=0, epoch=7)
    shards = [epoch_prompt_indices(10, 3, seed=0, epoch=7, rank=r, world_size=2) for r in range(2)]
    assert shards[0] + shards[1] == single
    assert epoch_prompt_indices(10, 6, seed=0, epoch=8) != single  # reshuffled each epoch
    # A batch larger than the set cycles through fresh permutations: every prompt appears.
    assert set(epoch_prompt_indices(4, 8, seed=1, epoch=0)) == {0, 1, 2, 3}


TASKS4 = ["position"] * 40 + ["two_object"] * 12 + ["counting"] * 6 + ["single_object"] * 2  # toy-like skew


def _counts(index, strata):
    return Counter(strata[i] for i in index)


def test_stratified_batches_give_every_stratum_an_equal_share():
    for epoch in range(20):
        assert set(_counts(epoch_prompt_indices(60, 8, seed=0, epoch=epoch, strata=TASKS4), TASKS4).values()) == {2}
        six = _counts(epoch_prompt_indices(60, 6, seed=0, epoch=epoch, strata=TASKS4), TASKS4)
        assert len(six) == 4 and max(six.values()) - min(six.values()) <= 1 and sum(six.values()) == 6
    # Which strata get the remainder is drawn per epoch, so over epochs every stratum gets it.
    extra = Counter(t for e in range(20) for t, n in
                    _counts(epoch_prompt_indices(60, 6, seed=0, epoch=e, strata=TASKS4), TASKS4).items() if n == 2)
    assert set(extra) == set(TASKS4)


def test_stratified_batches_cycle_rare_strata_without_repeats():
    # The 2 single_object prompts fill a share of 4: both appear, each exactly twice (no repeat before exhausting).
    index = epoch_prompt_indices(60, 16, seed=1, epoch=0, strata=TASKS4)
    assert Counter(i for i in index if TASKS4[i] == "single_object") == {58: 2, 59: 2}
    counting = [i for i in index if TASKS4[i] == "counting"]
    assert len(counting) == 4 == len(set(counting))


def test_stratified_batches_are_deterministic_and_sharded():
    first = epoch_prompt_indices(60, 8, seed=0, epoch=3, strata=TASKS4)
    assert epoch_prompt_indices(60, 8, seed=0, epoch=3, strata=TASKS4) == first
    assert epoch_prompt_indices(60, 8, seed=0, epoch=4, strata=TASKS4) != first
    assert epoch_prompt_indices(60, 8, seed=1, epoch=3, strata=TASKS4) != first
    shards = [epoch_prompt_indices(60, 4, seed=0, epoch=3, rank=r, world_size=2, strata=TASKS4) for r in range(2)]
    assert shards[0] + shards[1] == first
    assert all(set(_counts(s, TASKS4).values()) == {1} for s in shards)  # each shard is balanced too
    with pytest.raises(ValueError, match="strata has 3 labels for 60 prompts"):
        epoch_prompt_indices(60, 8, seed=0, epoch=0, strata=["a", "b", "c"])


def test_balance_by_missing_key_is_a_one_line_error(tmp_path):
    from flowrl.config import Config
    from flowrl.recipes.build import load_prompt_splits

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a cat", "metadata": {"task": "animal"}}) + "\n"
                    + json.dumps({"prompt": "a dog"}) + "\n")
    cfg = Config()
    cfg.data.prompts, cfg.data.test_fraction = str(path), 0.0
    assert len(load_prompt_splits(cfg)[0]) == 2  # not balanced: no key needed
    cfg.data.balance_by = "task"
    with pytest.raises(ValueError, match=r"lack metadata key 'task' \(first: prompt 2, 'a dog'\)") as error:
        load_prompt_splits(cfg)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_round_robin_takes_one_row_per_label_in_turn():
    labels = ["b", "a", "b", "c", "b", "a"]  # rows of b: 0, 2, 4; a: 1, 5; c: 3
    assert round_robin(labels) == [0, 1, 3, 2, 5, 4]  # first appearance b, a, c; exhausted labels drop out
    assert round_robin(labels, order=["a", "b"]) == [1, 0, 5, 2, 4]  # given order; c is left out
    assert round_robin([None] * 3) == [0, 1, 2]
