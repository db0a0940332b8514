r"""GenEval-style prompts with their metadata: an eval split that is GenEval's own benchmark, and a train split
that shares no prompt with it.

The templates, the 80 COCO class names, the ten colours, the counts and the four relations reproduce GenEval's
generator: github.com/djghosh13/geneval, ``prompts/create_prompts.py`` and ``prompts/object_names.txt`` at
commit af4902f24d3ca90ebbb446dd9891a59e0f82725f (the prompts folder last changed in cfaff69). The six tasks:

===============  ======================================================  =========================================
tag              prompt                                                  include (and exclude)
===============  ======================================================  =========================================
single_object    a photo of a bench                                      [{class, count: 1}]
two_object       a photo of a bench and a sports ball                    [{A, 1}, {B, 1}]
counting         a photo of three dogs  (counts 2-4)                     [{dog, 3}]; exclude [{dog, 4}]
colors           a photo of a blue fire hydrant  (never a person)        [{class, 1, color}]
position         a photo of a dog right of a teddy bear                  [{teddy bear, 1}, {dog, 1, position:
                 (left of, right of, above, below)                        [right of, 0]}]
color_attr       a photo of a purple wine glass and a black apple        [{A, 1, color}, {B, 1, color}]
===============  ======================================================  =========================================

Each record is ``{"prompt": ..., "metadata": {"tag", "include", "exclude"?, "prompt"}}``: the metadata is
GenEval's own line of ``evaluation_metadata.jsonl``, so flowrl.data.prompts's jsonl loader hands a GenEval judge
exactly what GenEval's evaluator reads.

Eval split. ``generate_split("eval", seed)`` runs GenEval's procedure (all 80 single objects, then 100 draws
of each other task, exact duplicates dropped) with GenEval's random generator seeded ``43 + seed``, drawing
the random numbers in GenEval's order. Seed 0 (the default) is GenEval's default seed 43, and its output is
GenEval's published ``prompts/evaluation_metadata.jsonl`` record for record: the same 553 prompts in the same
order (checked against the file with numpy 2.4). Flow-GRPO's ``dataset/geneval/test_metadata.jsonl`` is those
553 prompts, each four times (GenEval scores four images per prompt). Other seeds give other GenEval-style
suites of the same templates and classes. GenEval's file holds bare records (no ``{"prompt", "metadata"}``
wrapper), which flowrl.data.prompts would read without metadata; to score a run on the published benchmark, prepare
it in flowrl's shape and point the eval suite (or a run's held-out set) at it::

    flowrl data prepare geneval data/geneval
    flowrl eval CONFIG eval.suite=data/geneval/eval.jsonl --checkpoint RUN_DIR
    flowrl train CONFIG data.prompts=data/geneval/train.jsonl data.test_prompts=data/geneval/eval.jsonl

and to check it against the published file, whose records are the metadata of eval.jsonl's lines::

    curl -LO https://raw.githubusercontent.com/djghosh13/geneval/af4902f24d3ca90ebbb446dd9891a59e0f82725f/prompts/evaluation_metadata.jsonl
    python -c "import json; print([json.loads(l)['metadata'] for l in open('data/geneval/eval.jsonl')] == \
    [json.loads(l) for l in open('evaluation_metadata.jsonl')])"   # True

Train split. ``generate_split("train", seed)`` draws 50,000 records from the same template functions, the
five tasks besides single_object in equal shares (single_object has 80 prompts and the eval split holds all
of them). A draw is rejected when it matches a prompt of the eval split of the same seed or of the published
benchmark (seed 0), with Flow-GRPO's rule that prompts differing only in object order are the same prompt
("a photo of A and B" = "a photo of B and A"; "A left of B" = "B right of A"), so a train split never leaks
into the benchmark. Prompts repeat, as in Flow-GRPO's training files (its ``dataset/merge_genevaltask.py``
samples 50,000 records per task mix with replacement; its ``train_metadata.jsonl`` is generated with GenEval's
script and filtered against the test prompts, flow_grpo issue #4): counting has only 240 distinct prompts,
so equal task shares need repeats. 50,000 is that script's size.

Deterministic for a seed: numpy's ``default_rng`` and nothing else.
"""

from __future__ import annotations

import json
from typing import Iterator, Literal

import numpy as np

CLASSES = (  # GenEval's prompts/object_names.txt: the 80 COCO class names, in its order
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITIONS = ("left of", "right of", "above", "below")
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
MAX_COUNT = 4  # GenEval's counting prompts ask for 2 to 4 objects
PER_TASK = 100  # GenEval's draws per task besides single_object (duplicates are then dropped)
GENEVAL_SEED = 43  # GenEval's default seed: the eval split of seed 0 is its published file
TRAIN_SIZE = 50_000
TRAIN_TASKS = ("two_object", "counting", "colors", "position", "color_attr")
_PERSON = CLASSES.index("person")  # no "[colour] person" prompts in GenEval


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"  # GenEval's rule, "skis" -> "skises" included


def _record(tag: str, include: list[dict], prompt: str, exclude: list[dict] | None = None) -> dict:
    record = {"tag": tag, "include": include}  # GenEval's key order: tag, include, exclude, prompt
    if exclude is not None:
        record["exclude"] = exclude
    record["prompt"] = prompt
    return record


def _two_object(rng: np.random.Generator) -> dict:
    a, b = (CLASSES[i] for i in rng.choice(len(CLASSES), size=2, replace=False))
    return _record("two_object", [{"class": a, "count": 1}, {"class": b, "count": 1}],
                   f"a photo of {_article(a)} and {_article(b)}")


def _counting(rng: np.random.Generator) -> dict:
    name = CLASSES[rng.choice(len(CLASSES))]
    count = int(rng.integers(2, MAX_COUNT, endpoint=True))
    return _record("counting", [{"class": name, "count": count}], f"a photo of {NUMBERS[count]} {_plural(name)}",
                   exclude=[{"class": name, "count": count + 1}])


def _colors(rng: np.random.Generator) -> dict:
    name = CLASSES[(rng.choice(len(CLASSES) - 1) + 1 + _PERSON) % len(CLASSES)]
    color = COLORS[rng.choice(len(COLORS))]
    return _record("colors", [{"class": name, "count": 1, "color": color}], f"a photo of {_article(color)} {name}")


def _position(rng: np.random.Generator) -> dict:
    a, b = (CLASSES[i] for i in rng.choice(len(CLASSES), size=2, replace=False))
    relation = POSITIONS[rng.choice(len(POSITIONS))]  # a is `relation` b: b is the reference, listed first
    return _record("position", [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
                   f"a photo of {_article(a)} {relation} {_article(b)}")


def _color_attr(rng: np.random.Generator) -> dict:
    a, b = (CLASSES[(i + _PERSON) % len(CLASSES)] for i in rng.choice(len(CLASSES) - 1, size=2, replace=False) + 1)
    color_a, color_b = (COLORS[i] for i in rng.choice(len(COLORS), size=2, replace=False))
    return _record("color_attr", [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1,
                   "color": color_b}], f"a photo of {_article(color_a)} {a} and {_article(color_b)} {b}")


TEMPLATES = {"two_object": _two_object, "counting": _counting, "colors": _colors, "position": _position,
             "color_attr": _color_attr}


def prompt_key(metadata: dict) -> tuple:
    """What makes two GenEval prompts the same prompt: the tag and the set of included objects, so object
    order does not count, and a position prompt is the set of both objects' relations to the other."""
    if metadata["tag"] == "position":
        reference, placed = metadata["include"]
        relation = placed["position"][0]
        objects = {(placed["class"], relation), (reference["class"], INVERSE[relation])}
    else:
        objects = {tuple(sorted(item.items())) for item in metadata["include"]}
    return metadata["tag"], frozenset(objects)


def _suite(rng: np.random.Generator) -> Iterator[dict]:
    """GenEval's generate_suite: every class once as a single object, then PER_TASK draws of each task."""
    for i in rng.choice(len(CLASSES), size=len(CLASSES), replace=False):
        yield _record("single_object", [{"class": CLASSES[i], "count": 1}], f"a photo of {_article(CLASSES[i])}")
    for template in TEMPLATES.values():  # GenEval's task order: two_object, counting, colors, position, color_attr
        for _ in range(PER_TASK):
            yield template(rng)


def _eval_metadata(seed: int) -> list[dict]:
    unique, seen = [], set()
    for record in _suite(np.random.default_rng(GENEVAL_SEED + seed)):
        text = json.dumps(record, sort_keys=True)  # GenEval drops exact duplicates (it compares YAML dumps)
        if text not in seen:
            seen.add(text)
            unique.append(record)
    return unique


def _train_metadata(seed: int, blocked: set[tuple], size: int) -> list[dict]:
    rng = np.random.default_rng([seed, 0x7EA1])  # a stream apart from every eval split's
    records = []
    for index in range(size):
        template = TEMPLATES[TRAIN_TASKS[index % len(TRAIN_TASKS)]]
        record = template(rng)
        while prompt_key(record) in blocked:
            record = template(rng)
        records.append(record)
    return records


def generate_split(split: Literal["train", "eval"], seed: int = 0, *, size: int | None = None) -> list[dict]:
    """``[{"prompt": ..., "metadata": {GenEval's record}}]`` for ``split``; a pure function of (split, seed).
    The train split shares no prompt (up to object order) with the eval split of its seed nor with GenEval's
    published benchmark (the eval split of seed 0). ``size`` (train only, default TRAIN_SIZE) cuts the train
    split short: it is the first ``size`` records of the full one, since records are drawn one after another."""
    if split == "eval":
        if size is not None:
            raise ValueError("the eval split has GenEval's size; size= cuts only the train split")
        metadata = _eval_metadata(seed)
    elif split == "train":
        blocked = {prompt_key(record) for s in {seed, 0} for record in _eval_metadata(s)}
        metadata = _train_metadata(seed, blocked, TRAIN_SIZE if size is None else size)
    else:
        raise ValueError(f"unknown GenEval split {split!r}: use 'train' or 'eval'")
    return [{"prompt": record["prompt"], "metadata": record} for record in metadata]
