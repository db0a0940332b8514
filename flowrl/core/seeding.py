"""Deterministic per-sample seeds.

Every random draw in a rollout comes from a generator seeded by a pure function of integers
(run seed, epoch, global row index, step), so a row's image does not depend on batch size, on how
rows are sharded across processes, or on what else ran before it.

A low module of its own: the model families draw their initial noise with it and the samplers their
step noise, and models sit below sampling.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a pure, well-mixed function of the integer ``keys``."""
    state = np.random.SeedSequence([int(k) & 0xFFFFFFFFFFFFFFFF for k in keys]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & 0x7FFFFFFFFFFFFFFF


def generators(seeds: Sequence[int], device="cpu") -> list[torch.Generator]:
    """One freshly seeded generator per seed (one per batch row)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
