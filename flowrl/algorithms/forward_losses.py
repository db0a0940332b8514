"""Recipe nft's losses on clean latents at fresh (t, noise): DiffusionNFT, AWM, CRD and online DPO.

Each loss is a :class:`ForwardLoss` built from the config with its own options (``nft.loss``,
:data:`FORWARD_LOSSES`), and :func:`forward_process_loss` runs the model passes every one of them needs: the
noised sample (:func:`noised_sample`), the trained velocity, the old adapter's (``old()``: a context in which
the policy holds the old weights) and the base model's where the loss or ``train.beta`` asks. The math of each
loss, with its reference, is in :mod:`flowrl.algorithms.losses` (nft), :mod:`flowrl.algorithms.awm`,
:mod:`flowrl.algorithms.crd` and :mod:`flowrl.algorithms.dpo`; the recipe, :mod:`flowrl.recipes.nft`, says how
they train. Statistics go to a ``stats`` accumulator (``add(name, values, weights)``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowrl.algorithms.awm import awm_loss
from flowrl.algorithms.crd import crd_surrogate, crd_weights, implicit_reward, reward_adaptive_kl_weights
from flowrl.algorithms.dpo import PAIRINGS, dpo_loss, matching_error
from flowrl.algorithms.losses import nft_loss

if TYPE_CHECKING:
    from flowrl.config import NFTConfig


class ForwardLoss:
    """A forward-process loss, built from the config with its own options, and what the recipe does around it.

    ``loss(velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> [U]``: velocities and target
    [B, ...] (``old_velocity`` None unless ``needs_old``, ``ref_velocity`` the reference's, None unless
    ``needs_reference`` or train.beta > 0), the update weight ``advantage`` [U] and the noise level ``sigma`` [B],
    for U units of ``rows_per_unit`` rows each (:meth:`units`). The hooks' defaults are DiffusionNFT's and AWM's:
    one unit per sample, the clipped advantage over the clip is the weight, the KL anchor is the policy's guidance,
    unweighted."""

    name = ""
    needs_old = True  # compares with the old adapter's velocity
    needs_reference = False  # compares with the reference's velocity even at train.beta 0

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> ForwardLoss:
        raise NotImplementedError

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        raise NotImplementedError

    def units(self, scores: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor,
              accelerator: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [U, R], weights [U]): what one term of the loss trains on, R rows of this process's rollouts at one
        shared (t, noise), from the rows' ``scores`` [N] (advantages), ``group_ids`` [N] and ``keep`` [N] (scored).
        Every process must get the same U (its optimizer steps take the same micro-batches). Default: each sample
        alone, weighted by whether it was scored."""
        return torch.arange(len(keep)).unsqueeze(1), keep.float()

    def update_weights(self, advantage: torch.Tensor) -> torch.Tensor:
        """[pairs] the weights the update trains on. A MARBLE-balanced sum can leave [-1, 1], where NFT's optimality
        r = (1 + a) / 2 would leave [0, 1] and its loss lose its bounded minimum: clamped (the measuring passes are
        inside already, so only the update is affected, and only where it binds)."""
        return advantage.clamp(-1.0, 1.0)

    def kl_guidance(self, guidance: float) -> float:
        """The CFG scale of train.beta's KL anchor (the base model), given the policy's."""
        return guidance

    def kl_weights(self, clipped: torch.Tensor, beta: float) -> torch.Tensor | None:
        """[B] per-sample factors on the KL, from the rows' clipped advantages over the clip; None: 1."""
        return None

    def chunk_weights(self, log_ratios, chunk, clipped, keep, traj, stats) -> torch.Tensor | None:
        """[pairs] weights measured for one optimizer step's ``chunk`` (``log_ratios()`` gives its implicit
        log-ratios), in place of the clipped advantages; None: the clipped advantages (MARBLE-balanced where on)."""
        return None

    def idle(self) -> str | None:
        """Why this epoch's update had nothing to train on, where it had not (None: it had)."""
        return None

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        """The epoch's size of the update weights ``clipped`` [N]."""
        return {f"{self.name}/advantage_abs": float(clipped.abs().mean())}


@dataclass
class NftLoss(ForwardLoss):
    """DiffusionNFT with optimality ``r = (1 + advantage) / 2``; ``adaptive``: its adaptive weighting."""

    strength: float = 1.0
    adaptive: bool = True
    name = "nft"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> NftLoss:
        return cls(strength=cfg.nft.strength, adaptive=cfg.nft.adaptive_weighting)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return nft_loss(velocity, old_velocity, target, 0.5 + 0.5 * advantage, strength=self.strength,
                        sigma=sigma if self.adaptive else None)

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        return {"nft/optimality_abs_dev": float(0.5 * clipped.abs().mean())}


@dataclass
class AwmLoss(ForwardLoss):
    """AWM's clipped surrogate on its matching log-probability, with ``kl * ||v - v_old||^2`` toward the old
    adapter (:func:`flowrl.algorithms.awm.awm_loss`)."""

    kl: float = 1.0
    weighting: str = "ghuber"
    power: float = 0.25
    clip_range: float = 1.0
    name = "awm"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> AwmLoss:
        n = cfg.nft
        return cls(kl=n.awm_kl, weighting=n.awm_weighting, power=n.awm_ghuber_power, clip_range=n.awm_clip_range)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return awm_loss(velocity, old_velocity, target, advantage, sigma, kl_weight=self.kl, weighting=self.weighting,
                        power=self.power, clip_range=self.clip_range)


@dataclass
class CrdLoss(ForwardLoss):
    """CRD's surrogate ``c err(v)`` with ``advantage`` the detached weight ``c`` of
    :func:`flowrl.algorithms.crd.crd_weights`: its gradient is the reward-matching loss's. Each chunk's weights
    are measured first (its implicit log-ratios, centred per group and timestep slot); they are unbounded by
    construction and pass unclamped. The KL anchors to the base model with CFG, weighted by the reward."""

    adaptive: bool = True
    beta: float = 1.0
    timesteps_per_sample: int = 1
    anchor_guidance: float | None = None
    reward_adaptive_kl: bool = True
    name = "crd"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> CrdLoss:
        n = cfg.nft
        return cls(adaptive=n.adaptive_weighting, beta=n.crd_beta, timesteps_per_sample=n.timesteps_per_sample,
                   anchor_guidance=n.crd_kl_guidance if n.crd_kl_guidance is not None else cfg.sampling.guidance_scale,
                   reward_adaptive_kl=n.crd_reward_adaptive_kl)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return crd_surrogate(velocity, target, advantage, adaptive=self.adaptive)

    def update_weights(self, advantage: torch.Tensor) -> torch.Tensor:
        return advantage

    def kl_guidance(self, guidance: float) -> float:
        return guidance if self.anchor_guidance is None else self.anchor_guidance

    def kl_weights(self, clipped: torch.Tensor, beta: float) -> torch.Tensor | None:
        return reward_adaptive_kl_weights(clipped, beta) if self.reward_adaptive_kl else None

    def chunk_weights(self, log_ratios, chunk, clipped, keep, traj, stats) -> torch.Tensor:
        k = self.timesteps_per_sample
        return crd_weights(log_ratios(), clipped.repeat(k), chunk, traj.group_ids.repeat(k), keep.repeat(k),
                           num_rows=traj.num_rows, beta=self.beta, stats=stats)


@dataclass
class DpoLoss(ForwardLoss):
    """Online DPO (:mod:`flowrl.algorithms.dpo`): each unit is a preference pair of one group, winner and loser at
    one shared (t, noise), scored by their flow-matching errors against the reference's: the base model (adapter
    off), or the adapter of the last refresh with ``nft.dpo_ref_update_every`` (the recipe passes it to
    :func:`forward_process_loss` as ``reference``). The old adapter plays no part; the advantages only rank a
    group's rollouts.

    ``pairing`` (``nft.dpo_pairs``): ``best_worst`` (one pair per group, Flow-GRPO's; the default) or ``all`` (every
    winner/loser pair, up to g^2 / 4 per group of g on a binary reward, each two trained and two reference rows).
    The default by measurement: configs/toy/dpo.yaml at lr 3e-4, seed 0, 420 s of training wall-clock each (both
    runs side by side on 2 busy cores), held-out strict ToyEval task mean from 0.105: ``best_worst`` ran 19 epochs
    (5-8 pairs an epoch) and ended at 0.117 (0.129 at its best point); ``all`` paired 247-336 rows an epoch, took
    4-13x as long per epoch, ran 3 epochs and stayed at 0.105. Per second of training, one pair per group is the
    better buy; ``all`` is there for rewards where a group's middle carries signal."""

    beta: float = 100.0
    pairing: str = "best_worst"
    name = "dpo"
    needs_old = False
    needs_reference = True
    pairs = 0.0  # this epoch's preference pairs over every process

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> DpoLoss:
        return cls(beta=cfg.nft.dpo_beta, pairing=cfg.nft.dpo_pairs)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        error = matching_error(velocity, target).reshape(-1, 2)  # [U, 2] (winner, loser)
        ref_error = matching_error(ref_velocity, target).reshape(-1, 2)  # [U, 2]
        return dpo_loss(error[:, 0], error[:, 1], ref_error[:, 0], ref_error[:, 1], beta=self.beta)

    def units(self, scores, group_ids, keep, accelerator):
        pairs = PAIRINGS[self.pairing](scores.masked_fill(~keep, float("nan")), group_ids)  # [P, 2]
        # Every process trains on as many units as the one with the most pairs: the rest are weight-0 fillers.
        most = int(accelerator.gather(torch.tensor([len(pairs)], device=accelerator.device)).max())
        self.pairs = accelerator.reduce(torch.tensor(float(len(pairs)), device=accelerator.device), "sum").item()
        filler = pairs[:1] if len(pairs) else torch.zeros(1, 2, dtype=torch.long)
        weights = torch.cat([torch.ones(len(pairs)), torch.zeros(max(most, 1) - len(pairs))])  # [U]
        return torch.cat([pairs, filler.expand(len(weights) - len(pairs), 2)]), weights

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        return {"dpo/pairs": self.pairs}

    def idle(self) -> str | None:
        if self.pairs:
            return None
        return ("nft.loss=dpo found no preference pair (every group's rewards tied); give the reward more resolution, "
                "raise sampling.group_size, or use nft.loss=nft")


FORWARD_LOSSES: dict[str, type[ForwardLoss]] = {"nft": NftLoss, "awm": AwmLoss, "crd": CrdLoss, "dpo": DpoLoss}


@torch.no_grad()
def implicit_log_ratio(policy, old, x0, cond, *, guidance: float, noise_seed: list[int],
                       sigma: torch.Tensor | None, adaptive: bool) -> torch.Tensor:
    """[B] one (t, noise) estimate of log pi_theta(x0) - log pi_old(x0) from the flow-matching errors of the
    trained and the ``old`` adapter (:func:`flowrl.algorithms.crd.implicit_reward`), at the same noise
    :func:`forward_process_loss` draws for ``noise_seed``."""
    noised, target, sigma = noised_sample(x0, noise_seed, sigma, policy)
    with policy.local_forward():
        velocity = policy.velocity(noised, sigma, cond, guidance).float()
        with (old or nullcontext)():
            old_velocity = policy.velocity(noised, sigma, cond, guidance).float()
    return implicit_reward(velocity, old_velocity, target, adaptive=adaptive)


def noised_sample(x0, noise_seed: list[int], sigma: torch.Tensor | None, policy, *, rows_per_unit: int = 1):
    """(x_t [B, ...] in the policy's dtype, target eps - x0, sigma [B]) for clean latents ``x0`` at fresh
    noise, and ``t ~ U(0, 1)`` when ``sigma`` [B / rows_per_unit] is not given, from a generator seeded by
    ``noise_seed`` (reproducible on any device). Each run of ``rows_per_unit`` consecutive rows (a preference pair's
    winner and loser) shares one (t, noise), as Diffusion-DPO's pairs do."""
    device = policy.device
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence(noise_seed).generate_state(1)[0]))
    units = x0.shape[0] // rows_per_unit
    drawn = torch.rand(units, generator=generator)  # [U], drawn either way: one noise stream per seed
    sigma = drawn if sigma is None else sigma.float()
    noise = torch.randn((units, *x0.shape[1:]), generator=generator, dtype=torch.float32)
    sigma = sigma.repeat_interleave(rows_per_unit)  # [B]
    noise = noise.repeat_interleave(rows_per_unit, dim=0)  # [B, ...]
    x0 = x0.to(device=device, dtype=torch.float32)
    noise, sigma = noise.to(device), sigma.to(device)
    column = sigma.reshape(-1, *(1,) * (x0.ndim - 1))  # [B, 1, ...]: image [B, C, h, w] or video [B, C, F, h, w]
    noised = ((1 - column) * x0 + column * noise).to(policy.dtype)  # x_t = (1 - t) x0 + t eps
    return noised, noise - x0, sigma


def forward_process_loss(policy, old, x0, cond, advantage, weights, *, guidance: float, beta: float,
                         noise_seed: list[int], stats, sigma: torch.Tensor | None = None,
                         loss: ForwardLoss | None = None, scale: float = 1.0, kl_guidance: float | None = None,
                         kl_weights: torch.Tensor | None = None, strength: float = 1.0,
                         adaptive: bool = True, rows_per_unit: int = 1, reference=None) -> torch.Tensor:
    """Summed (not averaged) forward-process loss ``scale * loss + beta * KL`` of clean latents
    ``x0`` [B, C, h, w] at (t, fresh noise), with ``advantage`` [B] the clipped advantage over the clip
    (``2r - 1`` for DiffusionNFT's optimality ``r``: 1 trains toward the samples like plain flow matching)
    and ``old()`` a context in which the policy holds the old adapter's weights (None: the live weights). ``loss``: a :class:`ForwardLoss`
    (default: DiffusionNFT's at ``strength``, ``adaptive``).

    A unit is ``rows_per_unit`` consecutive rows of ``x0`` at one shared (t, noise): one sample (1), or a
    preference pair's winner and loser (2, loss dpo). ``advantage``, ``weights``, ``sigma`` and ``kl_weights`` are
    per unit [U]; the loss returns [U], and the KL is each unit's mean over its rows.

    The KL is ``||v - v_ref||^2`` to the reference at guidance ``kl_guidance`` (default: the policy's
    ``guidance``), times ``kl_weights`` [B] when given; the reference, the KL's and DPO's alike (one pass), is the
    context ``reference()`` puts its weights in (DPO's refreshed adapter, ``nft.dpo_ref_update_every``), by
    default the base model (adapter off, ``policy.reference``); ``scale`` does not act on it, as in
    DiffusionNFT and Flow-Factory's CRD. The noise, and ``t ~ U(0, 1)`` when ``sigma`` [B] is not given, come
    from a generator seeded by ``noise_seed`` (reproducible on any device).
    """
    device = policy.device
    loss = loss if loss is not None else NftLoss(strength=strength, adaptive=adaptive)
    noised, target, sigma = noised_sample(x0, noise_seed, sigma, policy, rows_per_unit=rows_per_unit)
    old_velocity = None  # [B, ...] the old adapter's, for the losses that compare with it
    if loss.needs_old:
        with torch.no_grad(), (old or nullcontext)(), policy.local_forward():
            old_velocity = policy.velocity(noised, sigma, cond, guidance).float()
    velocity = policy.velocity(noised, sigma, cond, guidance).float()
    ref_velocity = None  # [B, ...] the reference's (the base model unless moved): train.beta's anchor, DPO's
    if beta > 0 or loss.needs_reference:
        with torch.no_grad(), (reference or policy.reference)():
            anchor_guidance = guidance if kl_guidance is None else kl_guidance
            ref_velocity = policy.velocity(noised, sigma, cond, anchor_guidance).float()
    value = loss(velocity, old_velocity, target, advantage.to(device), sigma, ref_velocity=ref_velocity)  # [U]
    weights = weights.to(device)
    kl = torch.zeros_like(value)
    if beta > 0:
        kl = ((velocity - ref_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim)))  # [B]
        kl = kl.reshape(-1, rows_per_unit).mean(1)  # [U]
    kl_factor = 1.0 if kl_weights is None else kl_weights.to(device)
    total = scale * value + beta * kl_factor * kl
    stats.add(f"loss/{loss.name}", value, weights)
    stats.add("loss/kl", kl, weights)
    if old_velocity is not None:  # how far the trained velocity is from the old adapter's (AWM's regulariser)
        stats.add("loss/ema_kl", ((velocity.detach() - old_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim))),
                  weights)
    stats.add("loss/total", total, weights)
    return (total * weights).sum()
