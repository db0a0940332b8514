"""flowrl.data.geneval: GenEval's templates and metadata, its published benchmark as the seed-0 eval split, a
train split that never shares a prompt with it, determinism, and records that load through flowrl.data."""

import json

import pytest

from flowrl.data.prompts import load_prompts
from flowrl.data.geneval import CLASSES, generate_split, prompt_key

# The first records of each task in GenEval's published prompts/evaluation_metadata.jsonl (commit af4902f),
# copied by hand: the eval split of seed 0 must hold them, in this order within each task.
PUBLISHED = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
     "prompt": "a photo of a bench and a sports ball"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "colors", "include": [{"class": "fire hydrant", "count": 1, "color": "blue"}],
     "prompt": "a photo of a blue fire hydrant"},
    {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                    {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a dog right of a teddy bear"},
    {"tag": "color_attr", "include": [{"class": "wine glass", "count": 1, "color": "purple"},
                                      {"class": "apple", "count": 1, "color": "black"}],
     "prompt": "a photo of a purple wine glass and a black apple"},
]
COUNTS = {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}
NUMBER_WORDS = {"two": 2, "three": 3, "four": 4}
TRAIN = 4000  # the first records of the 50,000: the full split takes seconds on a busy core


@pytest.fixture(scope="module")
def splits():
    return {"eval": generate_split("eval"), "train": generate_split("train", size=TRAIN)}


def first_of_each_tag(records):
    first = {}
    for record in records:
        first.setdefault(record["metadata"]["tag"], record["metadata"])
    return first


def test_seed_zero_eval_is_genevals_published_benchmark(splits):
    records = splits["eval"]
    assert len(records) == 553
    assert {tag: sum(r["metadata"]["tag"] == tag for r in records) for tag in COUNTS} == COUNTS
    first = first_of_each_tag(records)
    for expected in PUBLISHED:
        assert first[expected["tag"]] == expected
        assert list(first[expected["tag"]]) == list(expected)  # GenEval's key order too
    assert all(r["prompt"] == r["metadata"]["prompt"] for r in records)


def test_templates_match_their_metadata(splits):
    for record in splits["eval"] + splits["train"][:500]:
        meta, prompt = record["metadata"], record["prompt"]
        include = meta["include"]
        if meta["tag"] == "counting":  # "a photo of three dogs": include 3 dogs, exclude 4
            number, _ = prompt.removeprefix("a photo of ").split(" ", 1)
            count = NUMBER_WORDS[number]
            assert include == [{"class": include[0]["class"], "count": count}]
            assert meta["exclude"] == [{"class": include[0]["class"], "count": count + 1}]
        else:
            assert "exclude" not in meta and all(item["count"] == 1 for item in include)
        if meta["tag"] in ("colors", "color_attr"):
            assert all("person" != item["class"] and f"{item['color']} {item['class']}" in prompt for item in include)
        if meta["tag"] == "position":
            reference, placed = include
            relation, index = placed["position"]
            assert index == 0 and prompt.endswith(f"{relation} {'an' if reference['class'][0] in 'aeiou' else 'a'} "
                                                  f"{reference['class']}")
            assert f" {placed['class']} {relation} " in prompt


def test_counting_prompt_by_hand(splits):
    """GenEval's published line for "a photo of three sports balls", its plural and its exclude."""
    balls = [r["metadata"] for r in splits["eval"] if r["prompt"] == "a photo of three sports balls"]
    assert balls == [{"tag": "counting", "include": [{"class": "sports ball", "count": 3}],
                      "exclude": [{"class": "sports ball", "count": 4}], "prompt": "a photo of three sports balls"}]


def test_every_class_is_a_coco_name(splits):
    assert len(set(CLASSES)) == 80
    classes = {item["class"] for records in splits.values() for r in records
               for item in r["metadata"]["include"] + r["metadata"].get("exclude", [])}
    assert classes <= set(CLASSES) and len(classes) == 80


def test_train_shares_no_prompt_with_eval_even_reordered(splits):
    train, evaluation = splits["train"], splits["eval"]
    assert len(train) == TRAIN and "single_object" not in {r["metadata"]["tag"] for r in train}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    assert not {prompt_key(r["metadata"]) for r in train} & {prompt_key(r["metadata"]) for r in evaluation}
    other_eval = generate_split("eval", seed=1)  # another seed's train also avoids the published benchmark
    other_train = {prompt_key(r["metadata"]) for r in generate_split("train", seed=1, size=TRAIN)}
    assert not other_train & {prompt_key(r["metadata"]) for r in evaluation + other_eval}


def test_object_order_does_not_make_a_new_prompt():
    left = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                          {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    right = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["right of", 0]}]}
    assert prompt_key(left) == prompt_key(right)
    pair = [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 1, "color": "blue"}]
    assert prompt_key({"tag": "color_attr", "include": pair}) == prompt_key({"tag": "color_attr",
                                                                             "include": pair[::-1]})


def test_deterministic_for_a_seed(splits):
    assert generate_split("eval") == splits["eval"]
    assert generate_split("eval", seed=1) != splits["eval"]
    assert generate_split("train", size=TRAIN // 2) == splits["train"][:TRAIN // 2]  # a prefix of the same draws
    assert generate_split("train", seed=1, size=50) != splits["train"][:50]
    with pytest.raises(ValueError, match="unknown GenEval split"):
        generate_split("test")


def test_records_load_through_flowrl_data(splits, tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in splits["eval"]))
    prompts = load_prompts(path)
    assert prompts.prompts == [r["prompt"] for r in splits["eval"]]
    assert prompts.metadata == [r["metadata"] for r in splits["eval"]]
