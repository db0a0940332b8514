"""Per-epoch training statistics: weighted means of per-transition values and scalars, kept on the device and
reduced over processes once at the end of an epoch (one collective and one host read per kind, not one per
micro-batch: on a GPU every read of a device value waits for the queue to drain; see
``scripts/bench/host_syncs.py``)."""

from __future__ import annotations

import torch
from accelerate import Accelerator


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class StatsAccumulator:
    """Weighted means of per-transition statistics, reduced across processes at the end of an epoch."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}  # [] on the values' device
        self.weights: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, list[torch.Tensor]] = {}
        self.scalar_reduce: dict[str, str] = {}

    def add(self, name: str, values: torch.Tensor, weights: torch.Tensor) -> None:
        """Add ``values`` [B] with ``weights`` [B] (no host read: the sums stay on the device)."""
        dtype = _accumulation_dtype(values.device)
        weights = weights.detach().to(values.device, dtype)
        total = (values.detach().to(dtype) * weights).sum()
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.weights[name] = self.weights[name] + weights.sum() if name in self.weights else weights.sum()

    def add_scalar(self, name: str, value: float | torch.Tensor, reduce: str = "mean") -> None:
        """One value per call (a Python number or a 0-d tensor, read at the end of the epoch), reduced by mean or
        max over calls and processes."""
        self.scalars.setdefault(name, []).append(torch.as_tensor(value).detach())
        self.scalar_reduce[name] = reduce

    def reduce(self, accelerator: Accelerator) -> dict[str, float]:
        device = accelerator.device
        dtype = _accumulation_dtype(device)
        names = sorted(self.sums)
        packed = (torch.stack([torch.stack([self.sums[n].to(device, dtype), self.weights[n].to(device, dtype)])
                               for n in names]) if names else torch.zeros(1, 2, dtype=dtype, device=device))
        packed = accelerator.reduce(packed, "sum").cpu()
        out = {n: float(packed[i, 0] / max(float(packed[i, 1]), 1e-12)) for i, n in enumerate(names)}
        for name, values in sorted(self.scalars.items()):
            stacked = torch.stack([v.to(device, dtype) for v in values])  # [calls]
            if self.scalar_reduce[name] == "max":
                out[name] = float(accelerator.gather(stacked.max().reshape(1)).max())
            else:
                out[name] = float(accelerator.reduce(stacked.mean(), "mean"))
        return out
