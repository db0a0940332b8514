"""Bit-for-bit comparisons of two runs' checkpoint files, shared by the resume tests of LoRA and full weights."""

from pathlib import Path

import torch
from safetensors.torch import load_file


def assert_same_safetensors(run_a: Path, run_b: Path, names) -> None:
    """Each file of ``names`` (relative to the run directories) holds the same keys and tensors, bit for bit."""
    for name in names:
        a, b = load_file(Path(run_a) / name), load_file(Path(run_b) / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def assert_same_optimizer_state(path_a: Path, path_b: Path) -> None:
    """Two ``optimizer.pt`` files hold the same per-parameter state: tensors bit for bit, the rest equal."""
    a, b = (torch.load(path, weights_only=True)["state"] for path in (path_a, path_b))
    assert a.keys() == b.keys()
    for index, entry in a.items():
        for key, value in entry.items():
            other = b[index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (index, key)
