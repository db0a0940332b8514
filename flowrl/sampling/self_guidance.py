"""Feature self-guidance: training-free diversity for a batch of images of one prompt (``sampling.self_guidance``).

Images of one prompt collapse onto a few looks because the transformer's inner features of those images are
nearly the same. At chosen denoising steps and transformer blocks this module pushes the image-token features
of rows that share a prompt (one group id) apart, then lets the block pull them back toward what it expects:

1. **Dispersal.** Each row's block output ``h_i`` (its image tokens, flattened: ``[L * D]``) has direction
   ``u_i = h_i / |h_i|``. The energy of a group is the log of the mean exponentiated cosine similarity over its
   ordered pairs of distinct rows, ``G = log mean_{i != j} exp(cos(u_i, u_j) / temperature)``; ``iterations``
   steps of projected gradient descent on the unit sphere, ``u_i <- normalise(u_i - scale * dG/du_i)``, spread
   the directions, and each row keeps its own norm, ``h~_i = |h_i| u_i``.
2. **Manifold step.** The dispersed features go through the same block once more (the block's residual update,
   read from the dispersed stream, is its own correction toward features it has seen) and the result is mixed
   back: ``h' = manifold_mix * block(h~) + (1 - manifold_mix) * h~``. Only image tokens change; the text stream
   the block wrote in the first pass is kept.

Source: "Don't Settle at the Mode! Mitigating Diversity Collapse in Pretrained Flow Models via Feature
Self-Guidance" (arXiv 2606.27371), its abstract and a public summary of its method: the LogSumExp cosine
energy with a temperature, gradient steps on the features (30 at rate 0.5 there), the second pass through the
same block mixed with weight beta (0.4 there), FLUX.1-dev's second block and t in [1.0, 0.8]. No public code
of the paper was found, so these choices are flowrl's: the gradient is taken on feature directions and each
row keeps its norm (cosine similarity ignores norms, and a step on the raw features would shrink as 1 / |h|, so
``scale`` would mean something different for every model and block); pairs are distinct rows; the whole
image-token block output of a row is one vector; the second pass reads the first pass's text stream (the
block's input text stream where the block writes none); under classifier-free guidance the unconditional and
conditional halves of the transformer batch are dispersed separately (each half holds the same groups).

``scale == 0`` installs nothing, so sampling is bit-identical to sampling without it. It changes the velocity
of every row as a function of the other rows of its group, so a policy-gradient log-probability recomputed
row by row would not be the one sampled: recipe grpo refuses it in rollouts, recipe nft (whose rollouts only
supply clean samples) accepts it.

Use: ``flowrl sample CONFIG --num-per-prompt 4 sampling.self_guidance.scale=0.1`` (``flowrl eval`` likewise;
training rollouts with ``sampling.self_guidance.in_rollouts=true``); ``scripts/bench/self_guidance_toy.py``
measures it on the toy model (results: ``docs/results.md``).

Supported transformers (:data:`GUIDED_BLOCKS`), their blocks indexed as one list in the order named: blocks
whose output holds the image tokens apart from the text, either as the second of ``(encoder_hidden_states,
hidden_states)`` (SD3, FLUX.1 and Kontext, FLUX.2's double-stream blocks, Qwen-Image) or as the whole output
(Wan's blocks, which read the text by cross-attention; Z-Image's noise refiner, the image-only blocks before its
joint layers). FLUX.2's single-stream blocks and Z-Image's joint layers carry text and image tokens in one
tensor, so they are not offered. Kontext's stream also holds the source image's tokens, which are dispersed
with the rest.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

# Transformer class -> its block lists that guidance may index, as one list in this order.
GUIDED_BLOCKS = {
    "SD3Transformer2DModel": ("transformer_blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),  # FLUX.1, Kontext
    "Flux2Transformer2DModel": ("transformer_blocks",),  # its single blocks hold text and image as one stream
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "WanTransformer3DModel": ("blocks",),
    "ZImageTransformer2DModel": ("noise_refiner",),  # image tokens alone; its main layers hold the caption too
}
ONE_IMAGE_ERROR = "self-guidance needs at least 2 images per prompt"


@dataclass(frozen=True)
class SelfGuidance:
    """The method's settings (see the module docstring); built from ``sampling.self_guidance``."""

    scale: float
    blocks: tuple[int, ...] = (1,)
    steps: tuple[int, ...] = (0, 1)
    iterations: int = 30
    temperature: float = 1.0
    manifold_mix: float = 0.4

    @classmethod
    def maybe(cls, scale: float, blocks: Sequence[int], steps: Sequence[int], iterations: int, temperature: float,
              manifold_mix: float) -> "SelfGuidance | None":
        """The settings, or None at ``scale == 0`` (nothing is installed then)."""
        if scale == 0:
            return None
        return cls(float(scale), tuple(blocks), tuple(steps), int(iterations), float(temperature), float(manifold_mix))


def dispersal_energy(directions: torch.Tensor, group_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over groups of ``log mean_{i != j} exp(cos(u_i, u_j) / temperature)``; ``directions`` ``[N, D]``,
    ``group_ids`` ``[N]``. A scalar; groups of one row contribute nothing."""
    unit = F.normalize(directions, dim=1)  # [N, D]
    cos = unit @ unit.T / temperature  # [N, N]
    energy = directions.new_zeros(())
    for group in group_ids.unique():
        rows = (group_ids == group).nonzero().squeeze(1)  # [n]
        n = len(rows)
        if n < 2:
            continue
        distinct = ~torch.eye(n, dtype=torch.bool, device=directions.device)  # [n, n]
        logits = cos[rows][:, rows][distinct]  # [n (n - 1)]
        energy = energy + torch.logsumexp(logits, dim=0) - math.log(n * (n - 1))
    return energy


def disperse(features: torch.Tensor, group_ids: torch.Tensor, *, scale: float, iterations: int,
             temperature: float) -> torch.Tensor:
    """Step 1 of the module docstring: ``features`` ``[N, ...]`` (a row per image) spread apart within each
    group by ``iterations`` projected gradient steps on their directions; each row keeps its norm. float32
    inside, returned in the input dtype."""
    flat = features.reshape(len(features), -1).float()  # [N, D]
    norms = flat.norm(dim=1, keepdim=True)  # [N, 1]
    directions = flat / norms.clamp_min(1e-12)
    group_ids = group_ids.to(features.device)
    with torch.enable_grad():
        for _ in range(iterations):
            u = directions.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(dispersal_energy(u, group_ids, temperature), u)
            directions = F.normalize(u.detach() - scale * grad, dim=1)
    return (directions * norms).reshape(features.shape).to(features.dtype)


def guided_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks in the order ``blocks`` indexes them (:data:`GUIDED_BLOCKS`; a wrapper class such
    as FSDP2's is looked through by its bases)."""
    names = next((GUIDED_BLOCKS[c.__name__] for c in type(transformer).__mro__ if c.__name__ in GUIDED_BLOCKS), None)
    if names is None:
        raise ValueError(f"self-guidance does not know the blocks of {type(transformer).__name__}; it supports "
                         f"{', '.join(GUIDED_BLOCKS)}")
    return [block for name in names for block in getattr(transformer, name)]


class GuidanceHooks:
    """Forward hooks on the chosen blocks for one transformer call on rows of the given groups."""

    def __init__(self, guidance: SelfGuidance, transformer: torch.nn.Module, group_ids: torch.Tensor):
        self.guidance = guidance
        self.group_ids = group_ids  # [N] rows of the rollout, on the CPU (moved only when a hook runs)
        self.in_second_pass = False
        blocks = guided_blocks(transformer)
        bad = [b for b in guidance.blocks if not 0 <= b < len(blocks)]
        if bad:
            raise ValueError(f"self-guidance blocks {bad} out of range: {type(transformer).__name__} has "
                             f"{len(blocks)} blocks (0..{len(blocks) - 1})")
        self.handles = [blocks[b].register_forward_hook(self.hook, with_kwargs=True) for b in guidance.blocks]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def batch_groups(self, batch: int, device: torch.device) -> torch.Tensor:
        """Group ids ``[batch]`` of the transformer's batch: the rollout's rows, repeated with new ids for
        every further copy (the CFG halves)."""
        rows = len(self.group_ids)
        if batch % rows:
            raise ValueError(f"self-guidance: a transformer batch of {batch} rows does not hold the {rows} rows "
                             "of the rollout a whole number of times")
        offset = int(self.group_ids.max()) + 1
        return torch.cat([self.group_ids + copy * offset for copy in range(batch // rows)]).to(device)

    def hook(self, module, args, kwargs, output):
        if self.in_second_pass:
            return None
        two_streams = isinstance(output, tuple)
        if two_streams and len(output) != 2 or two_streams and args:
            raise ValueError(f"self-guidance supports blocks that return (text, image) streams, called with "
                             f"keywords, or the image tokens alone; {type(module).__name__} is neither")
        text, image = output if two_streams else (None, output)  # [B, L_text, D] or None, [B, L_image, D]
        g = self.guidance
        groups = self.batch_groups(image.shape[0], image.device)  # [B]
        dispersed = disperse(image, groups, scale=g.scale, iterations=g.iterations, temperature=g.temperature)
        if g.manifold_mix > 0:
            projected = self.second_pass(module, args, kwargs, dispersed, text)
            dispersed = g.manifold_mix * projected + (1 - g.manifold_mix) * dispersed
        return (text, dispersed) if two_streams else dispersed

    def second_pass(self, module, args, kwargs, dispersed: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
        """The block once more on the dispersed image tokens (the first positional argument, or ``hidden_states``),
        reading the text stream the first pass wrote."""
        if args:
            args = (dispersed, *args[1:])
        else:
            kwargs = dict(kwargs, hidden_states=dispersed)
            if text is not None:
                kwargs["encoder_hidden_states"] = text
        self.in_second_pass = True  # module(...) runs every hook of the block (FSDP's too) but not this one again
        try:
            out = module(*args, **kwargs)
        finally:
            self.in_second_pass = False
        return out[1] if isinstance(out, tuple) else out


@contextlib.contextmanager
def installed(guidance: SelfGuidance | None, transformer: torch.nn.Module | None, step: int,
              group_ids: torch.Tensor) -> Iterator[GuidanceHooks | None]:
    """The hooks of ``guidance`` on ``transformer`` around denoising step ``step`` of rows ``group_ids`` ``[N]``;
    nothing is installed without guidance or at a step it does not guide."""
    if guidance is None or step not in guidance.steps:
        yield None
        return
    if (torch.unique(group_ids, return_counts=True)[1] < 2).any():
        raise ValueError(ONE_IMAGE_ERROR)
    hooks = GuidanceHooks(guidance, transformer, group_ids)
    try:
        yield hooks
    finally:
        hooks.remove()
