"""Sequence (context) parallelism: the device mesh world = data x ring x ulysses, and diffusers' context parallelism
applied to a transformer on it.

A 720p Wan clip is ~76k latent tokens; one GPU's attention activations for it do not fit beside the weights, so
each row's tokens are split over a *context group* of ``ring x ulysses`` processes (diffusers' Ulysses all-to-all
and ring attention, ``ContextParallelConfig`` + ``enable_parallelism``). Those processes hold the same row: they
must sample the same prompts with the same seeds and count once for data parallelism. This module owns that
arithmetic, one place for it:

* :class:`ContextLayout` holds the degrees and answers which processes share a context group, which data-parallel
  rank a process is, and the mesh's shape; its checks raise one-line ``ValueError`` s the caller turns into config
  errors.
* :func:`build_mesh` makes the torch ``DeviceMesh`` ("data", "ring", "ulysses"), the data dimension outermost, so a
  context group is consecutive ranks: the ranks of one node, whose links carry the all-to-all.
* :func:`enable_context_parallel` hands the ring/ulysses sub-mesh to the transformer's ``enable_parallelism``.

The row shards and seeds are then taken per *data* rank (:meth:`ContextLayout.data_rank`, ``data_world``):
the rows a one-context-process run gives its rank ``r`` are those every process of data rank ``r`` samples.

A bottom leaf: it imports torch and diffusers, nothing else of flowrl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MESH_DIMS = ("data", "ring", "ulysses")


@dataclass(frozen=True)
class ContextLayout:
    """``world`` processes as data x ring x ulysses (``ulysses = ring = 1``: plain data parallelism)."""

    world: int
    ulysses: int = 1
    ring: int = 1

    @property
    def degree(self) -> int:
        """Processes per context group: each row's sequence is split over this many."""
        return self.ulysses * self.ring

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: distinct row shards (each context group samples one)."""
        return self.world // self.degree

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return self.data_world, self.ring, self.ulysses

    def check_world(self) -> None:
        """One line where the context degree does not divide the process count."""
        if self.world % self.degree:
            raise ValueError(f"context parallelism of {self.degree} processes (ulysses {self.ulysses} x ring "
                             f"{self.ring}) does not divide the {self.world} processes of this launch: pick degrees "
                             f"whose product divides {self.world}")

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of process ``rank``: its context group's index (the row shard it samples)."""
        return rank // self.degree

    def context_group(self, rank: int) -> list[int]:
        """The processes that hold the same rows as ``rank`` (its context group, ``rank`` included)."""
        first = self.data_rank(rank) * self.degree
        return list(range(first, first + self.degree))

    def check_sequence(self, tokens: int | None, what: str = "latent tokens") -> None:
        """One line where a row's attention sequence does not split evenly over the context group (``tokens``
        None: not known before the run, nothing to check)."""
        if tokens is not None and self.enabled and tokens % self.degree:
            raise ValueError(f"{tokens} {what} per row do not split over a context group of {self.degree} "
                             f"processes: pick a resolution or frame count whose token count "
                             f"{self.degree} divides, or other degrees")


def latent_tokens(latent_shape: tuple[int, ...], patch_size) -> int | None:
    """Attention tokens of one row from its latent shape ``[1, C, (T,) H, W]`` and the transformer's patch size
    (an int for images, a (t, h, w) tuple for video); None where the layout is not one of those (packed latents)."""
    spatial = tuple(latent_shape[2:])
    if len(spatial) not in (2, 3) or patch_size is None:
        return None
    patch = (patch_size,) * len(spatial) if isinstance(patch_size, int) else tuple(patch_size)
    if len(patch) != len(spatial):
        return None
    return math.prod(s // p for s, p in zip(spatial, patch))


def has_context_plan(transformer_class: type) -> bool:
    """Whether diffusers knows how to split this transformer's sequence (its ``_cp_plan``)."""
    return getattr(transformer_class, "_cp_plan", None) is not None


def check_context_plan(transformer_class: type, family: str) -> None:
    if not has_context_plan(transformer_class):
        raise ValueError(f"model family {family!r}: diffusers has no context-parallel plan (_cp_plan) for "
                         f"{transformer_class.__name__}, so its sequence cannot be split; set parallel.context "
                         "ulysses and ring to 1")


def accelerator_missing(device_type: str) -> str | None:
    """Why diffusers' context parallelism cannot start for processes on ``device_type``, or None where it can:
    diffusers picks each process's device as ``rank % torch.accelerator.device_count()``, which has no value
    without an accelerator, and its attention all-to-all then runs on that device."""
    if device_type == "cpu" or not torch.accelerator.is_available() or torch.accelerator.device_count() == 0:
        return ("context parallelism needs a GPU per process: diffusers' enable_parallelism picks each process's "
                "device among the accelerators, and this run has none")
    return None


def build_mesh(layout: ContextLayout, device_type: str):
    """The ("data", "ring", "ulysses") DeviceMesh over every process (collective: every process calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout.check_world()
    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)


def enable_context_parallel(transformer, layout: ContextLayout, mesh) -> None:
    """Split ``transformer``'s sequence over this process's context group: diffusers' ``ContextParallelConfig`` on
    the mesh's ("ring", "ulysses") sub-mesh. The transformer must then be called with ``return_dict=False`` (the
    plan gathers a tensor output) and every process of a group must feed it the same inputs. Gradients of a
    group's processes are partial (each holds its tokens' share): they are summed over the group."""
    from diffusers import ContextParallelConfig

    if not has_context_plan(type(transformer)):
        raise ValueError(f"diffusers has no context-parallel plan (_cp_plan) for {type(transformer).__name__}")
    config = ContextParallelConfig(ulysses_degree=layout.ulysses, ring_degree=layout.ring,
                                   mesh=mesh["ring", "ulysses"])
    transformer.enable_parallelism(config=config)
