"""Prompt files, deterministic splits, and per-epoch shuffling sharded across processes."""

import json

import pytest

from flowrl.data import PromptSet, epoch_prompt_indices, load_prompts, train_test_split


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
