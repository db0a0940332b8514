"""Prompt sets: ``.txt`` (one prompt per line) or ``.jsonl`` (``{"prompt": ..., "metadata": {...}}``).

Metadata travels with each prompt to the rewards (OCR target text, a checklist DAG, a toy-world
scene spec). Train/test splits are deterministic under the seed, and each epoch's order is a pure
function of (seed, epoch), sharded by process rank so every process sees a disjoint slice of the
same global order — the result does not depend on the number of processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

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
        raise FileNotFoundError(f"prompt file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
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
            prompts.append(record["prompt"])
            metadata.append(dict(record.get("metadata", {})))
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
                         world_size: int = 1) -> list[int]:
    """Indices of this process's ``per_batch`` prompts at ``epoch``.

    The global batch is ``per_batch * world_size`` prompts drawn from a per-epoch permutation
    (cycled if the set is smaller); process ``rank`` takes the ``rank``-th contiguous slice.
    """
    global_batch = per_batch * world_size
    rng = np.random.default_rng([seed, epoch, 0xDA7A])
    repeats = -(-global_batch // num_prompts)
    order = np.concatenate([rng.permutation(num_prompts) for _ in range(repeats)])[:global_batch]
    return order[rank * per_batch:(rank + 1) * per_batch].tolist()
