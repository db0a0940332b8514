"""Adv-GRPO's rewards from reference images: an adversarial discriminator trained during the run, and the
"image itself as reward", feature similarity to the references.

Adv-GRPO (``../shared/PAPERS.md``, "an adversarial reward that iteratively updates both the reward model and
the generator") supervises its reward model "using reference images as positive samples", so a policy that
drifts toward what a fixed reward over-rates is pushed back toward the references. Its public code
(github.com/showlab/Adv-GRPO, commit 8287f9085a59c4fc48f8e80dbf0528fcf734766e, ``train_dino`` in
``scripts/train_sd3_fast_dino_patch.py``) trains a small head on frozen DINO features with Adam (betas 0.5,
0.999), one step per discriminator epoch on an equal number of reference and generated images, with a hinge
loss on CLS logits (plus patch logits), and scores images by the head's raw output. Here:

- **features**: a frozen network of :mod:`flowrl.features` (``toy`` on the toy world, ``dino`` or ``clip`` for
  real models), standardised with the reference set's mean and std, computed once (the references do not
  change, so neither does the scale the head sees);
- **head**: logistic, ``z = <x, w> + b``, zero at the start (every image scores 0.5 until the first update);
- **update** (:meth:`AdversarialReward.update`): the policy's samples as negatives, as many references drawn
  without replacement (with it where there are fewer) as positives, then ``steps`` optimizer steps on the
  balanced logistic loss ``1/2 mean_pos softplus(-z) + 1/2 mean_neg softplus(z) + l2/2 |w|^2``. Logistic, not
  the reference's hinge: its sigmoid is a calibrated P(reference-like) in [0, 1], like the fitted reward's
  (``rewards/fitted.py``), so it weighs against other rewards on one scale; gradient steps, not a Newton
  refit: the paper's discriminator moves a little each round and keeps its history in the optimizer, which a
  refit to the optimum on one batch would throw away. Adam with the reference's betas by default; ``sgd`` for a
  plain step;
- **score**: ``adversarial = sigmoid(z)``, NaN for an image holding NaN/inf.

The draw is seeded by ``(seed, updates so far)``, so a run and its resume draw the same references.
:meth:`state_dict` holds the head, the optimizer state and the update count, JSON-safe (the run's trainer
state), and the run extra of :mod:`flowrl.recipes.reward_updates` calls :meth:`update` every ``update_every``
epochs with the epoch's rollouts.

:class:`ReferenceSimilarity` is the untrained variant: ``(1 + max_r cos(f(x), f(r))) / 2`` over the reference
set's features (``reduce="mean"`` for the mean over references), in [0, 1].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from flowrl.core.devices import resolve_device
from flowrl.features import build_feature_network
from flowrl.core.media import image_files
from rewards.base import score_per_image
from rewards.fitted import file_features, standardise

OPTIMIZERS = ("adam", "sgd")
ADAM_BETAS = (0.5, 0.999)  # Adv-GRPO's discriminator optimizer (GAN practice: a short first-moment memory)


def reference_features(folder: str | Path, network: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """[R, F] features of every image under ``folder``, or a one-line error for a missing or empty folder."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"references folder {folder} is not a directory; make one, e.g. the clean renders of "
                         "python -m tools.toy_artifacts runs/toy_artifacts --n 1000 (runs/toy_artifacts/clean)")
    files = image_files(folder)
    if not files:
        raise ValueError(f"references folder {folder} holds no images (png, jpg, jpeg, webp)")
    return file_features(network, files, device)


# ------------------------------------------------------------------------------------------ JSON-safe tensors

def _encode(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: shape, dtype and its values (float32 values round-trip exactly through JSON floats)."""
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "values": tensor.detach().cpu().flatten().tolist()}


def _decode(state: Mapping[str, Any]) -> torch.Tensor:
    return torch.tensor(state["values"], dtype=getattr(torch, state["dtype"])).reshape(state["shape"])


# ------------------------------------------------------------------------------------------ the head

class DiscriminatorHead:
    """A logistic head ``z = <x, w> + b`` on features [N, F] and its optimizer; :meth:`step` takes one step of
    the balanced logistic loss on (positives, negatives)."""

    def __init__(self, num_features: int, *, lr: float, optimizer: str = "adam", l2: float = 0.0,
                 device: torch.device | str = "cpu") -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        if lr <= 0 or l2 < 0:
            raise ValueError(f"lr must be > 0 and l2 >= 0, got lr={lr}, l2={l2}")
        self.weight = torch.zeros(num_features, device=device, requires_grad=True)  # [F]
        self.bias = torch.zeros((), device=device, requires_grad=True)
        self.l2 = l2
        params = [self.weight, self.bias]
        self.optimizer = (torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS) if optimizer == "adam"
                          else torch.optim.SGD(params, lr=lr))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[N] logits of features [N, F]."""
        return features @ self.weight + self.bias

    def loss(self, positives: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """``1/2 mean softplus(-z_pos) + 1/2 mean softplus(z_neg) + l2/2 |w|^2`` (the bias is not penalised)."""
        return (0.5 * F.softplus(-self.logits(positives)).mean() + 0.5 * F.softplus(self.logits(negatives)).mean()
                + 0.5 * self.l2 * (self.weight * self.weight).sum())

    def step(self, positives: torch.Tensor, negatives: torch.Tensor) -> float:
        """One optimizer step on positives [P, F] (label 1) and negatives [N, F] (label 0) -> the loss before it."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(positives, negatives)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the weights and the optimizer's per-parameter state (Adam's moments and step count)."""
        state = self.optimizer.state_dict()["state"]
        return {"weight": _encode(self.weight), "bias": _encode(self.bias),
                "optimizer": {str(i): {k: _encode(v) for k, v in s.items()} for i, s in state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self.weight.copy_(_decode(state["weight"]))
            self.bias.copy_(_decode(state["bias"]))
        device = self.weight.device
        inner = {int(i): {k: _decode(v).to(device) if k != "step" else _decode(v) for k, v in s.items()}
                 for i, s in state["optimizer"].items()}
        self.optimizer.load_state_dict({"state": inner, "param_groups": self.optimizer.state_dict()["param_groups"]})


# ------------------------------------------------------------------------------------------ the rewards

class _ReferenceReward:
    """What both rewards share: the frozen feature network and the references' features [R, F]."""

    name: str

    def __init__(self, references: str, features: str, feature_kwargs: Mapping[str, Any] | None, device: Any,
                 batch_size: int) -> None:
        self.device = resolve_device(device)
        self.network = build_feature_network(features, **dict(feature_kwargs or {})).to(self.device)
        self.references = reference_features(references, self.network, self.device).to(self.device)  # [R, F]
        self.batch_size = batch_size

    def score(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        return score_per_image(self.name, self.score, images, prompts, metadata, self.batch_size)


class AdversarialReward(_ReferenceReward):
    """Reward protocol and :class:`flowrl.rewards_api.TrainableReward`: ``{"adversarial": [N]}``, the head's
    P(reference-like) in [0, 1]; :meth:`update` trains the head on the policy's samples against the references."""

    name = "adversarial"

    def __init__(self, references: str, features: str = "toy", feature_kwargs: Mapping[str, Any] | None = None,
                 update_every: int = 1, lr: float = 1e-3, steps: int = 1, l2: float = 0.0, optimizer: str = "adam",
                 seed: int = 0, device: Any = "auto", batch_size: int = 64) -> None:
        if update_every < 1 or steps < 1:
            raise ValueError(f"update_every and steps must be >= 1, got {update_every} and {steps}")
        super().__init__(references, features, feature_kwargs, device, batch_size)
        self.mean, self.std = standardise(self.references)  # [F] each, fixed for the run
        self.update_every, self.steps, self.seed, self.updates = update_every, steps, seed, 0
        self.head = DiscriminatorHead(self.network.num_features, lr=lr, optimizer=optimizer, l2=l2,
                                      device=self.device)

    def standardised(self, images: torch.Tensor) -> torch.Tensor:
        """[N, F] standardised features of images [N, 3, H, W]."""
        return (self.network(images.to(self.device)).float() - self.mean) / self.std

    @torch.no_grad()
    def score(self, images: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head.logits(self.standardised(images)))  # [N]

    def update(self, images: torch.Tensor, prompts: Sequence[str],
               metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, float]:
        """``steps`` head steps on ``images`` [N, 3, H, W] (negatives; rows holding NaN/inf are left out) against
        as many references -> {"disc_loss": the loss before the first step, "disc_accuracy": the balanced
        accuracy before it}; {} when no image is finite."""
        finite = torch.isfinite(images.flatten(1)).all(dim=1)
        if not bool(finite.any()):
            return {}
        with torch.no_grad():
            negatives = torch.cat([self.standardised(images[finite][i:i + self.batch_size])
                                   for i in range(0, int(finite.sum()), self.batch_size)])  # [N, F]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.updates)
        r, n = len(self.references), len(negatives)
        index = (torch.randperm(r, generator=generator)[:n] if r >= n
                 else torch.randint(r, (n,), generator=generator))
        positives = ((self.references[index.to(self.references.device)] - self.mean) / self.std)  # [N, F]
        with torch.no_grad():
            accuracy = 0.5 * (float((self.head.logits(positives) > 0).float().mean())
                              + float((self.head.logits(negatives) < 0).float().mean()))
        losses = [self.head.step(positives, negatives) for _ in range(self.steps)]
        self.updates += 1
        return {"disc_loss": losses[0], "disc_accuracy": accuracy}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the head, its optimizer state and the update count."""
        return {"head": self.head.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.updates = int(state["updates"])


class ReferenceSimilarity(_ReferenceReward):
    """``{"reference_similarity": [N]}``: ``(1 + cos) / 2`` of an image's features to the nearest reference's
    (``reduce="max"``) or averaged over references (``"mean"``), in [0, 1]. No training."""

    name = "reference_similarity"

    def __init__(self, references: str, features: str = "toy", feature_kwargs: Mapping[str, Any] | None = None,
                 reduce: str = "max", device: Any = "auto", batch_size: int = 64) -> None:
        if reduce not in ("max", "mean"):
            raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
        super().__init__(references, features, feature_kwargs, device, batch_size)
        self.reduce = reduce
        self.unit_references = F.normalize(self.references, dim=-1)  # [R, F]

    @torch.no_grad()
    def score(self, images: torch.Tensor) -> torch.Tensor:
        return similarity(F.normalize(self.network(images.to(self.device)).float(), dim=-1), self.unit_references,
                          self.reduce)


def similarity(unit_features: torch.Tensor, unit_references: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """[N] ``(1 + cos) / 2`` of unit features [N, F] to unit references [R, F], max or mean over references."""
    cosines = unit_features @ unit_references.T  # [N, R]
    best = cosines.amax(dim=1) if reduce == "max" else cosines.mean(dim=1)
    return ((1.0 + best) / 2.0).clamp(0.0, 1.0)
