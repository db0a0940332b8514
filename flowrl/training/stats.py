"""Per-epoch training statistics: weighted means of per-transition values and scalars, reduced over
processes once at the end of an epoch (one collective per kind, not one per micro-batch)."""

from __future__ import annotations

import torch
from accelerate import Accelerator


class StatsAccumulator:
    """Weighted means of per-transition statistics, reduced across processes at the end of an epoch."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.scalars: dict[str, list[float]] = {}
        self.scalar_reduce: dict[str, str] = {}

    def add(self, name: str, values: torch.Tensor, weights: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float((values.detach().float() * weights).sum())
        self.weights[name] = self.weights.get(name, 0.0) + float(weights.sum())

    def add_scalar(self, name: str, value: float, reduce: str = "mean") -> None:
        self.scalars.setdefault(name, []).append(value)
        self.scalar_reduce[name] = reduce

    def reduce(self, accelerator: Accelerator) -> dict[str, float]:
        names = sorted(self.sums)
        packed = torch.tensor([[self.sums[n], self.weights[n]] for n in names] or [[0.0, 0.0]], dtype=torch.float64)
        packed = accelerator.reduce(packed.to(accelerator.device), "sum").cpu()
        out = {n: float(packed[i, 0] / max(packed[i, 1], 1e-12)) for i, n in enumerate(names)}
        for name, values in sorted(self.scalars.items()):
            if self.scalar_reduce[name] == "max":
                tensor = torch.tensor([max(values)], dtype=torch.float64, device=accelerator.device)
                out[name] = float(accelerator.gather(tensor).max())
            else:
                tensor = torch.tensor(sum(values) / len(values), dtype=torch.float64, device=accelerator.device)
                out[name] = float(accelerator.reduce(tensor, "mean"))
        return out
