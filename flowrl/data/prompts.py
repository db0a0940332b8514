"""Prompt sets: ``.txt`` (one prompt per line) or ``.jsonl`` (``{"prompt": ..., "metadata": {...}}``).

Metadata travels with each prompt to the rewards (OCR target text, a checklist DAG, a toy-world
scene spec, an editing prompt's ``source_image``: a relative path is made relative to the prompt file).
Train/test splits are deterministic under the seed, and each epoch's order is a pure function of
(seed, epoch), sharded by process rank so every process sees a disjoint slice of the same global
order — the result does not depend on the number of processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError("prompts and metadata differ in length")

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, index) -> "PromptSet":
        return PromptSet([self.prompts[i] for i in index], [self.metadata[i] for i in index])


def load_prompts(path: str | Path) -> PromptSet:
    """Read a ``.txt`` or ``.jsonl`` prompt file; a one-line error names the file and line."""
    path = Path(path)
    if not path.is_file():
        hint = (" (a directory)" if path.is_dir() else
                "; the published prompt sets (geneval, pickscore, ocr) are made by `flowrl data prepare NAME DIR`")
        raise FileNotFoundError(f"prompt file not found: {path}{hint}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{error.object[error.start]:02x}); save the prompt "
                         "file as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
    if path.suffix == ".jsonl":
        prompts, metadata = [], []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: invalid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each line needs a string field 'prompt'")
            meta = record.get("metadata", {})
            if meta is not None and not isinstance(meta, dict):
                raise ValueError(f"{path}:{number}: 'metadata' must be a JSON object {{...}}, got "
                                 f"{type(meta).__name__}")
            meta = dict(meta or {})
            source = meta.get("source_image")  # an editing prompt's source image(s): relative to this file
            if isinstance(source, str) and source and not Path(source).is_absolute():
                meta["source_image"] = os.path.normpath(path.parent / source)
            elif isinstance(source, list):  # several sources (qwen_image_edit_plus)
                meta["source_image"] = [os.path.normpath(path.parent / s) if isinstance(s, str) and s
                                        and not Path(s).is_absolute() else s for s in source]
            prompts.append(record["prompt"])
            metadata.append(meta)
        result = PromptSet(prompts, metadata)
    elif path.suffix == ".txt":
        result = PromptSet([line.strip() for line in lines if line.strip()])
    else:
        raise ValueError(f"unsupported prompt file {path}: use .txt or .jsonl")
    if not len(result):
        raise ValueError(f"prompt file {path} holds no prompts")
    return result


def train_test_split(prompts: PromptSet, test_fraction: float, seed: int) -> tuple[PromptSet, PromptSet]:
    """Deterministic split; the test set is never empty when ``test_fraction > 0`` and >= 2 prompts."""
    order = np.random.default_rng([seed, 0x5E7]).permutation(len(prompts))
    n_test = int(round(test_fraction * len(prompts)))
    if test_fraction > 0 and len(prompts) >= 2:
        n_test = min(max(n_test, 1), len(prompts) - 1)
    test, train = sorted(order[:n_test].tolist()), sorted(order[n_test:].tolist())
    return prompts.subset(train), prompts.subset(test)


def epoch_prompt_indices(num_prompts: int, per_batch: int, *, seed: int, epoch: int, rank: int = 0,
                         world_size: int = 1, strata: Sequence[Hashable] | None = None) -> list[int]:
    """Indices of this process's ``per_batch`` prompts at ``epoch``.

    The global batch is ``per_batch * world_size`` prompts drawn from a per-epoch permutation
    (cycled if the set is smaller); process ``rank`` takes the ``rank``-th contiguous slice.
    With ``strata`` (one label per prompt, e.g. its task) the global batch is stratified instead,
    see `stratified_order`.
    """
    global_batch = per_batch * world_size
    if strata is not None:
        if len(strata) != num_prompts:
            raise ValueError(f"strata has {len(strata)} labels for {num_prompts} prompts")
        order = stratified_order(strata, global_batch, seed=seed, epoch=epoch)
    else:
        rng = np.random.default_rng([seed, epoch, 0xDA7A])
        order = _cycled_permutation(rng, np.arange(num_prompts), global_batch)
    return order[rank * per_batch:(rank + 1) * per_batch].tolist()


def prompts_per_batch(groups_per_epoch: int, *, world_size: int, batches_per_epoch: int) -> int:
    """Each process's prompts per rollout batch when an epoch holds ``groups_per_epoch`` groups over all
    processes; raises a one-line ValueError naming the numbers when they do not divide evenly."""
    per_batch, rest = divmod(groups_per_epoch, world_size * batches_per_epoch)
    if rest or not per_batch:
        raise ValueError(f"sampling.groups_per_epoch={groups_per_epoch} does not split evenly over {world_size} "
                         f"processes x train.batches_per_epoch={batches_per_epoch}: use a multiple of "
                         f"{world_size * batches_per_epoch}")
    return per_batch


def stratified_order(strata: Sequence[Hashable], size: int, *, seed: int, epoch: int) -> np.ndarray:
    """``size`` prompt indices in which every stratum (distinct label) has an equal share.

    Shares differ by at most one: the strata that get the remainder come first in a per-epoch random
    order of the strata. Each stratum's prompts come from its own per-epoch permutation, cycled if the
    share is larger. The order deals the strata round-robin, so any contiguous slice (a rank's shard)
    is itself as balanced as its length allows. A pure function of (seed, epoch).
    """
    labels = sorted(set(strata), key=repr)
    members = {label: [] for label in labels}
    for index, label in enumerate(strata):
        members[label].append(index)
    rng = np.random.default_rng([seed, epoch, 0x57A7])
    turn = rng.permutation(len(labels))  # dealing order; its first `size % len` strata get one more
    drawn = [_cycled_permutation(rng, np.asarray(members[labels[j]]), -(-(size - k) // len(labels)))
             for k, j in enumerate(turn)]
    return np.array([drawn[k % len(labels)][k // len(labels)] for k in range(size)], dtype=np.int64)


def _cycled_permutation(rng: np.random.Generator, items: np.ndarray, size: int) -> np.ndarray:
    """``size`` items from fresh permutations of ``items``, concatenated: no repeats until exhausted."""
    if size <= 0:
        return items[:0]
    repeats = -(-size // len(items))
    return np.concatenate([items[rng.permutation(len(items))] for _ in range(repeats)])[:size]


def round_robin(labels: Sequence[Hashable], order: Sequence[Hashable] | None = None) -> list[int]:
    """Row indices taken one label at a time in turn, each label's rows in their own order; a label
    whose rows run out drops out. Labels come in ``order`` (rows of other labels are left out), else
    in order of first appearance. Any prefix is then as balanced over the labels as they allow."""
    queues: dict[Hashable, list[int]] = {label: [] for label in (order if order is not None else labels)}
    for index, label in enumerate(labels):
        if label in queues:
            queues[label].append(index)
    columns = [column for column in queues.values() if column]
    return [column[depth] for depth in range(max(map(len, columns), default=0)) for column in columns
            if depth < len(column)]
