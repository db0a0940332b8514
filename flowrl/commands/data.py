"""``flowrl data prepare NAME OUT``: write a full prompt set (train and eval files) that flowrl.data.prompts loads.

The shipped files under assets/prompts/ are small samples for smoke runs; this command makes the sets the
published recipes train on:

- ``geneval``: OUT/train.jsonl and OUT/eval.jsonl from flowrl.data.geneval (offline; eval.jsonl is GenEval's
  published 553-prompt benchmark at the default seed, train.jsonl shares no prompt with it).
- ``pickscore``: OUT/train.txt and OUT/eval.txt from Pick-a-Pic v1's train captions, made as Flow-GRPO made
  its dataset/pickscore (``prpocess.py``: the unique captions of at least six words, shuffled, 2,048 for test,
  the rest for train). Flow-GRPO's shuffle was unseeded, so its exact split cannot be rebuilt; this one is
  seeded. The captions come from ``yuvalkirstain/pickapic_v1_no_images`` (Pick-a-Pic v1 without the images:
  the same rows, a 170 MB download instead of the image parquet files) through the ``datasets`` library (the
  ``data`` extra). Flow-GRPO later recommends the SFW subset ``CarperAI/pickapic_v1_no_images_training_sfw``.
- ``ocr``: OUT/train.txt and OUT/eval.txt, Flow-GRPO's OCR prompts (text in quotes, which the ``ocr`` reward
  reads as the target). Their only public source is the flow_grpo repository, so they are downloaded from it
  pinned to a commit and checked against the blob ids that commit's tree records (and a sha256).

Bad input is one line (a ValueError, which the command line prints): an unknown NAME, files already in OUT
(``--force`` overwrites), no network or ``HF_HUB_OFFLINE=1`` (the line says what to download and where to put
it). Every file's content is in memory before the first file is written, and each is written to a temporary
name and renamed, so a failure leaves no file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

PICKAPIC = "yuvalkirstain/pickapic_v1_no_images"
PICKSCORE_TEST_SIZE = 2048  # Flow-GRPO's dataset/pickscore/test.txt
PICKSCORE_MIN_SPACES = 5  # Flow-GRPO keeps captions with at least five spaces (six words)
FLOW_GRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
OCR_URL = f"https://raw.githubusercontent.com/yifan123/flow_grpo/{FLOW_GRPO_COMMIT}/dataset/ocr/{{name}}"
OCR_FILES = {  # our file: (flow_grpo's file, git blob id in the commit's tree, sha256 or None)
    "train.txt": ("train.txt", "3ce0521b77b0a9031191d66ecc36ebaaf27a3922", None),
    "eval.txt": ("test.txt", "8deb4f8d8f2e863f45353354243669b3c991a6a2",
                 "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc"),
}


class Unavailable(ValueError):
    """The source cannot be reached (offline, hub offline, a missing package): the line says what to do."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _geneval(seed: int) -> dict[str, str]:
    from flowrl.data.geneval import generate_split

    return {f"{split}.jsonl": "".join(json.dumps(record) + "\n" for record in generate_split(split, seed))
            for split in ("train", "eval")}


def _pickscore(seed: int, out: Path) -> dict[str, str]:
    import numpy as np

    try:
        from datasets import load_dataset
    except ImportError:
        raise Unavailable("pickscore needs the datasets package: pip install 'flowrl[data]'") from None
    try:  # under HF_HUB_OFFLINE=1 datasets reads its cache and touches no network
        captions = load_dataset(PICKAPIC, split="train").unique("caption")
    except OSError as error:  # offline and not cached, the hub unreachable (ConnectionError is an OSError)
        raise Unavailable(f"pickscore could not load the Hugging Face dataset {PICKAPIC} ({type(error).__name__}): "
                          f"with network access run 'hf download --repo-type dataset {PICKAPIC}' (the cache "
                          f"HF_HUB_OFFLINE=1 reads) or unset HF_HUB_OFFLINE, then rerun to write "
                          f"{out / 'train.txt'} and {out / 'eval.txt'}") from None
    captions = sorted({c.strip() for c in captions if c and c.strip().count(" ") >= PICKSCORE_MIN_SPACES
                       and "\n" not in c.strip()})  # sorted: unique() keeps no guaranteed order
    captions = [captions[i] for i in np.random.default_rng(seed).permutation(len(captions))]
    return {"train.txt": "".join(c + "\n" for c in captions[PICKSCORE_TEST_SIZE:]),
            "eval.txt": "".join(c + "\n" for c in captions[:PICKSCORE_TEST_SIZE])}


def _ocr(seed: int, out: Path) -> dict[str, str]:
    del seed  # a fixed published set
    urls = {ours: OCR_URL.format(name=theirs) for ours, (theirs, _, _) in OCR_FILES.items()}
    fix = ("download " + " and ".join(f"{url} as {out / ours}" for ours, url in urls.items()))
    if _offline():
        raise Unavailable(f"ocr needs the network (HF_HUB_OFFLINE is set): {fix}")
    files = {}
    for ours, (_, blob_id, sha256) in OCR_FILES.items():
        try:
            with urllib.request.urlopen(urls[ours], timeout=60) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as error:
            raise Unavailable(f"ocr could not download {urls[ours]} ({error}): {fix}") from None
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's id of the file's content
        if blob != blob_id or (sha256 and hashlib.sha256(data).hexdigest() != sha256):
            raise ValueError(f"{urls[ours]} does not match flow_grpo commit {FLOW_GRPO_COMMIT[:12]} (git blob "
                             f"{blob}, expected {blob_id}): refusing to write it")
        files[ours] = data.decode("utf-8")
    return files


DATASETS: dict[str, tuple[tuple[str, ...], Callable[..., dict[str, str]]]] = {
    "geneval": (("train.jsonl", "eval.jsonl"), lambda seed, out: _geneval(seed)),
    "ocr": (("train.txt", "eval.txt"), _ocr),
    "pickscore": (("train.txt", "eval.txt"), _pickscore),
}


def _write_atomically(out: Path, files: dict[str, str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    temporary = {name: out / f".{name}.tmp" for name in files}
    try:
        for name, text in files.items():
            temporary[name].write_text(text, encoding="utf-8")
        for name in files:  # every file is complete before the first rename
            os.replace(temporary[name], out / name)
    finally:
        for path in temporary.values():
            path.unlink(missing_ok=True)
    return [out / name for name in files]


def run_data_prepare(args) -> list[Path]:
    """Build NAME's files in memory, then write them into OUT; returns the paths written."""
    if args.name not in DATASETS:
        raise ValueError(f"unknown dataset {args.name!r}; known: {', '.join(DATASETS)}")
    out = Path(args.out)
    names, build = DATASETS[args.name]
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    existing = [str(out / name) for name in names if (out / name).exists()]
    if existing and not args.force:
        raise ValueError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass --force "
                         "to overwrite")
    files = build(args.seed, out)
    return _write_atomically(out, files)
