"""Which rows this process holds, and how every process's rows are gathered once: :class:`RowShards`, built from the
launch's :class:`~flowrl.core.context_parallel.ContextLayout` and handed to every step that splits work by process.

Why one object: with sequence (context) parallelism a *context group* of ``degree`` consecutive processes holds the
same rows, each process a slice of their tokens (``parallel.context``, docs/scaling.md section 8). For the rows,
seeds, gathers and sums of a recipe the launch is then ``data_world`` processes, not ``world``: a group samples its
data rank's prompts with its data rank's seeds, and a gather keeps one copy of each group's rows, so advantages,
logged means and counts equal those of a plain data-parallel launch of ``data_world`` processes. Asking this object
instead of the accelerator keeps that rule in one place; without context parallelism (``degree`` 1) it answers
exactly as the accelerator does.

It answers the accelerator's collective calls under their accelerate names (``gather``, ``reduce``,
``gather_object``, ``process_index``, ``num_processes``, ``device``), so helpers that take "an accelerator" for
collectives only (the dense credit rules, DPO's pairs, the diversity guard) take it as it is. What stays per
process (backward, gradient sync, checkpoint RNG files, the main process's writes) still goes to the accelerator.
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

from flowrl.core.context_parallel import ContextLayout


class RowShards:
    """This process's share of the rows: data rank ``process_index`` of ``num_processes`` (``data_world``)."""

    def __init__(self, accelerator, layout: ContextLayout | None = None):
        self.accelerator = accelerator
        self.layout = layout or ContextLayout(world=accelerator.num_processes)

    @property
    def process_index(self) -> int:
        """The data rank: which row shard (prompts, seeds, run-wide row and group ids) this process samples."""
        return self.layout.data_rank(self.accelerator.process_index)

    @property
    def num_processes(self) -> int:
        """Distinct row shards over the launch (``data_world``)."""
        return self.layout.data_world

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def gradient_scale(self) -> float:
        """The factor on a loss already divided by its weight summed over every row once (``reduce(..., "sum")``),
        so that the optimizer sees the data-parallel gradient, the mean over all rows.

        DDP and FSDP2 average the gradients over all ``world`` processes. Without context parallelism that is the
        mean over ``data_world`` shards, and the factor ``data_world`` turns it into the sum of the shards' losses
        over the total weight. With a context group of ``degree`` processes each process's gradient is only its
        tokens' share of its rows' gradient: diffusers gathers the transformer's output with a backward that keeps
        each process's own slice (``AllGatherFunction`` in ``diffusers/hooks/context_parallel.py``), so a group's
        gradients sum to its rows' gradient, and the average over ``world = data_world x degree`` processes is that
        sum over ``degree`` too small. Scaling by ``degree`` as well gives the data-parallel update: the factor is
        ``data_world x degree``, the launch's ``world``."""
        return float(self.layout.data_world * self.layout.degree)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every row once: the processes' ``tensor`` ``[N, ...]`` concatenated in data-rank order, ``[N_all, ...]``
        with ``N_all = data_world x N``, one copy per context group (its first process's; the group's processes hold
        the same rows)."""
        gathered = self.accelerator.gather(tensor)  # [world * N, ...]
        if not self.layout.enabled:
            return gathered
        per_group = gathered.reshape(self.layout.data_world, self.layout.degree, *tensor.shape)
        return per_group[:, 0].reshape(self.layout.data_world * tensor.shape[0], *tensor.shape[1:])

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """``tensor`` summed (each row once), averaged or maximised over the row shards."""
        if not self.layout.enabled:
            return self.accelerator.reduce(tensor, reduction)
        if reduction == "sum":
            return self.gather(tensor.reshape(1, *tensor.shape)).sum(dim=0)  # [data_world, ...] -> [...]
        return self.accelerator.reduce(tensor, reduction)  # mean, max: copies of a group's value change nothing

    def gather_object(self, items: list) -> list:
        """Every row's ``items`` once (a list of equal length on every process), in data-rank order."""
        gathered = gather_object(items) if self.accelerator.num_processes > 1 else list(items)
        if not self.layout.enabled:
            return gathered
        n = len(items)
        return [item for rank in range(0, self.layout.world, self.layout.degree)
                for item in gathered[rank * n:(rank + 1) * n]]
