"""GARDO's defences against reward hacking and mode collapse, as plain functions over one batch.

A proxy reward that is optimised alone is hacked (the proxy rises, what it stood for does not) and
collapses what the prompt leaves free. GARDO answers with two pieces used here:

- **Gated KL**: the KL to the reference binds only the samples whose proxy reward is least trustworthy,
  the most *uncertain* fraction: uncertainty is how much better a sample ranks in its group under the
  trained proxy than under the auxiliary rewards that are logged but not trained (its proxy win-rate
  minus its mean auxiliary win-rate). Samples the auxiliaries agree with train freely.
- **Diversity-aware advantage**: ``A_i <- A_i * d_i`` for ``A_i > 0``, with ``d_i`` the cosine distance
  from sample i to its nearest neighbour in its group in a feature space: a good sample that copies
  another earns less; negative advantages are left alone, so a bad sample is never excused.

Feature spaces (``gardo.features``, and the diversity guard's ``guard.features``): ``latent`` (the VAE latents the
rollout already holds; no extra model), any frozen image network of :data:`flowrl.features.FEATURE_NETWORKS` built
with ``feature_kwargs`` (``toy``, ``pixels``, ``clip``, ``dino``, ``inception``: one registry, so a name means the
same network here, in ``flowrl eval`` and in ``flowrl fit-reward``), or a dotted path ``package.module:Class`` built
with ``feature_kwargs`` and called as ``fn(images, latents) -> [N, D]``.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

import torch

from flowrl.features import FEATURE_NETWORKS


def win_rates(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] for each row the fraction of the other finite rows of its group it beats (ties count 1/2);
    NaN rows get NaN, a row alone in its group 1/2."""
    out = torch.full(rewards.shape, float("nan"), dtype=torch.float64)
    finite = torch.isfinite(rewards)
    values = rewards.double()
    for group in torch.unique(group_ids[finite]).tolist():
        rows = torch.nonzero(finite & (group_ids == group)).flatten()
        r = values[rows]
        if len(rows) == 1:
            out[rows] = 0.5
            continue
        beats = (r[:, None] > r[None, :]).double() + 0.5 * (r[:, None] == r[None, :]).double()
        out[rows] = (beats.sum(1) - 0.5) / (len(rows) - 1)  # minus the self-tie
    return out


def uncertainty(proxy: torch.Tensor, auxiliaries: dict[str, torch.Tensor], group_ids: torch.Tensor) -> torch.Tensor:
    """[N] GARDO's uncertainty: proxy win-rate minus the mean auxiliary win-rate (NaN where any is NaN)."""
    if not auxiliaries:
        raise ValueError("GARDO's uncertainty needs at least one auxiliary reward (a reward with weight 0)")
    aux = torch.stack([win_rates(r, group_ids) for r in auxiliaries.values()]).mean(0)
    return win_rates(proxy, group_ids) - aux


def gated_rows(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool [N]: the ``ceil(fraction * n)`` finite rows of highest ``scores`` (ties by row order);
    fraction 1 selects every finite row."""
    finite = torch.isfinite(scores)
    count = math.ceil(fraction * int(finite.sum()) - 1e-9)
    order = torch.argsort(torch.where(finite, scores, torch.full_like(scores, -math.inf)), descending=True, stable=True)
    gate = torch.zeros(scores.shape, dtype=torch.bool)
    gate[order[:count]] = True
    return gate & finite


def nearest_neighbour_distances(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] cosine distance (1 - cos, in [0, 2]) from each row's features [N, D] to its nearest other
    member of its group; 0 for a row alone in its group (no neighbour, no bonus)."""
    unit = torch.nn.functional.normalize(features.double().flatten(1), dim=1)
    similarity = unit @ unit.T
    same = group_ids[:, None] == group_ids[None, :]
    same.fill_diagonal_(False)
    nearest = torch.where(same, similarity, torch.full_like(similarity, -math.inf)).max(dim=1).values
    return torch.where(torch.isfinite(nearest), 1 - nearest, torch.zeros_like(nearest)).clamp(0, 2).float()


def diversity_weighted(advantages: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """``A * d`` where ``A > 0``; ``A`` unchanged elsewhere."""
    return torch.where(advantages > 0, advantages * distances.to(advantages), advantages)


def latent_features(images: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    return latents.flatten(1)  # [N, C*h*w]


class NetworkFeatures:
    """A frozen image network of :mod:`flowrl.features` as a feature function: the images, in chunks, on the
    network's device; the features back on the CPU, where the rollout's group ids are."""

    def __init__(self, network: torch.nn.Module, batch_size: int = 64):
        self.network, self.batch_size = network, batch_size
        self.device = next(network.parameters(), torch.empty(0)).device  # pixels has no parameters: the CPU

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.network(chunk.to(self.device)).cpu()
                          for chunk in images.split(self.batch_size)])  # [N, num_features]


# The feature spaces that are not image networks (the rest are flowrl.features.FEATURE_NETWORKS).
FEATURE_SPACES: dict[str, Callable[..., Callable]] = {"latent": lambda: latent_features}


def build_features(name: str, kwargs: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The feature function ``gardo.features`` (or ``guard.features``) names, built with its ``feature_kwargs``; a
    one-line error for an unknown name, a dotted path that does not import, or arguments the builder refuses."""
    known = sorted([*FEATURE_SPACES, *FEATURE_NETWORKS])
    if name in FEATURE_SPACES:
        factory = FEATURE_SPACES[name]
    elif name in FEATURE_NETWORKS:
        def factory(**network_kwargs):
            return NetworkFeatures(FEATURE_NETWORKS[name](**network_kwargs))
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"gardo.features={name!r} cannot be imported ({error}); give 'package.module:Class' "
                             f"of an importable module, or one of {known}") from None
    else:
        raise ValueError(f"unknown gardo.features {name!r}; choose one of {known} or a dotted path "
                         "'package.module:Class'")
    try:
        return factory(**kwargs)
    except TypeError as error:
        raise ValueError(f"gardo.features={name!r}: bad gardo.feature_kwargs ({error})") from None
