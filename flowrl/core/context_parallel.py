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
* :func:`enable_context_parallel` hands the ring/ulysses sub-mesh to the transformer's ``enable_parallelism``
  (on CPU processes too: Ulysses over gloo, how the tests run it).

The row shards and seeds are then taken per *data* rank (:meth:`ContextLayout.data_rank`, ``data_world``):
the rows a one-context-process run gives its rank ``r`` are those every process of data rank ``r`` samples;
:class:`flowrl.training.row_shards.RowShards` answers that for the recipes.

A bottom leaf: it imports torch and diffusers, nothing else of flowrl.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

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


def context_parallel_models(transformer) -> list:
    """The diffusers models whose sequence is split: ``transformer`` itself where it has a context-parallel plan,
    else its direct submodules that have one (a two-expert Wan2.2 family's ``WanExperts``: both experts); empty
    where none has one."""
    if has_context_plan(type(transformer)):
        return [transformer]
    return [child for child in transformer.children() if has_context_plan(type(child))]


def check_context_plan(transformer, family: str) -> None:
    """One line where diffusers cannot split ``transformer``'s sequence (no ``_cp_plan``)."""
    if not context_parallel_models(transformer):
        raise ValueError(f"model family {family!r}: diffusers has no context-parallel plan (_cp_plan) for "
                         f"{type(transformer).__name__}, so its sequence cannot be split; set parallel.context "
                         "ulysses and ring to 1")


def check_heads(transformer, layout: ContextLayout) -> None:
    """One line where the Ulysses degree does not divide the attention heads (Ulysses hands each process a slice of
    the heads)."""
    for model in context_parallel_models(transformer):
        heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
        if isinstance(heads, int) and heads % layout.ulysses:
            raise ValueError(f"Ulysses degree {layout.ulysses} does not divide the {heads} attention heads of "
                             f"{type(model).__name__}: Ulysses gives each process a slice of the heads; pick a "
                             "Ulysses degree that divides them, or ring for the rest")


RING_BACKEND = "_native_flash"  # torch's flash kernel: returns the log-sum-exp ring attention merges by


def device_refusal(layout: ContextLayout, device_type: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why context parallelism of ``layout`` cannot run on processes of ``device_type`` with a transformer in
    ``dtype``, or None where it can.

    On CPU processes (gloo) Ulysses runs with diffusers' native (SDPA) attention, which is how it is tested; ring
    attention merges each process's partial attention by its log-sum-exp, which that backend does not return, so ring
    runs on torch's flash kernel (:data:`RING_BACKEND`), which needs a GPU and a 16-bit transformer."""
    if device_type == "cpu" and layout.ring > 1:
        return (f"ring attention (parallel.context.ring={layout.ring}) needs a GPU per process: it merges partial "
                "attention by its log-sum-exp, which the CPU's attention does not return; use ulysses on CPU")
    if layout.ring > 1 and dtype not in (torch.bfloat16, torch.float16):
        return (f"ring attention (parallel.context.ring={layout.ring}) runs on the flash kernel, which takes bfloat16 "
                f"or float16, and the transformer is {dtype}: set model.dtype bf16, or use ulysses")
    return None


def build_mesh(layout: ContextLayout, device_type: str):
    """The ("data", "ring", "ulysses") DeviceMesh over every process (collective: every process calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout.check_world()
    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)


@contextmanager
def _device_pick(device_type: str) -> Iterator[None]:
    """diffusers' ``enable_parallelism`` records each process's device as ``rank %
    torch.accelerator.device_count()``, which divides by zero on a machine without an accelerator. For CPU
    processes the count reads 1 (device ``cpu:0``) while it runs; nothing after it reads that device (the mesh,
    the gloo all-to-all and the attention are torch's own). Accelerator processes are left as they are."""
    if device_type != "cpu":
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(count(), 1)
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def enable_context_parallel(transformer, layout: ContextLayout, mesh) -> None:
    """Split ``transformer``'s sequence over this process's context group: diffusers' ``ContextParallelConfig`` on
    the mesh's ("ring", "ulysses") sub-mesh, for each of its models with a plan (:func:`context_parallel_models`).
    The transformer must then be called with ``return_dict=False`` (the plan gathers a tensor output) and every
    process of a group must feed it the same inputs. Gradients of a group's processes are partial (each holds its
    tokens' share): they sum over the group to the rows' gradient."""
    from diffusers import ContextParallelConfig

    models = context_parallel_models(transformer)
    if not models:
        raise ValueError(f"diffusers has no context-parallel plan (_cp_plan) for {type(transformer).__name__}")
    with _device_pick(mesh.device_type):
        for model in models:
            if layout.ring > 1:  # the native (SDPA) backend returns no log-sum-exp (device_refusal checks the dtype)
                model.set_attention_backend(RING_BACKEND)
            config = ContextParallelConfig(ulysses_degree=layout.ulysses, ring_degree=layout.ring,
                                           mesh=mesh["ring", "ulysses"])
            model.enable_parallelism(config=config)
