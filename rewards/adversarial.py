"""Adv-GRPO's rewards from reference images: an adversarial discriminator trained during the run, and the
"image itself as reward", feature similarity to the references.

Adv-GRPO (``../shared/PAPERS.md``, "an adversarial reward that iteratively updates both the reward model and
the generator") supervises its reward model "using reference images as positive samples", so a policy that
drifts toward what a fixed reward over-rates is pushed back toward the references. What its public code computes
(github.com/showlab/Adv-GRPO, commit 8287f9085a59c4fc48f8e80dbf0528fcf734766e: ``train_dino`` and the epoch loop
of ``scripts/train_sd3_fast_dino_patch.py``, ``dino_patch_cotrain_score`` and ``image_similarity_score`` of
``adv_grpo/rewards.py``, the preset ``dino_cotrain_sd3_patch_fast`` of ``config/grpo.py``), and what flowrl does:

- **schedule** (script lines 1097-1118: ``train_d``, ``d_times``, 10 in the preset): after sampling and scoring
  an epoch, the discriminator takes its step when ``(epoch + 1) % d_times != 0`` and the generator's update is
  then skipped; the generator trains only on epochs ``d_times - 1, 2 d_times - 1, ...`` (9, 19, ...), where the
  discriminator rests. Epoch 0 trains the discriminator. Here ``policy_every`` is ``d_times`` and means the same
  (:meth:`AdversarialReward.updates_on`, :meth:`AdversarialReward.policy_updates_on`); the run extra of
  :mod:`flowrl.recipes.reward_updates` asks the reward and skips the policy update on the other epochs.
  ``policy_every: 1`` is flowrl's joint schedule instead (the policy every epoch, the discriminator after it every
  ``update_every`` epochs), where the script's ``d_times = 1`` would never train its discriminator;
- **features**: the script's frozen DINOv2 ViT-B/14 (timm, 518 px) gives a CLS token and patch tokens. Here a
  network of :mod:`flowrl.features` gives them (:func:`feature_tokens`): ``dino`` its CLS and patch tokens (at its
  own ``size``, 224 by default), ``toy`` with ``pool="mean"`` its global feature and the last layer's positions;
  networks without patch tokens (``pixels``, ``clip``, ``toy`` with ``pool="stats"``) need ``patch_weight: 0``.
  Every token is scaled to unit length (``x / (|x| + 1e-6)``), as the script's reward does;
- **head** (script lines 592-603 and 750): the script's ``DINOHead``, ``Linear(F, 512) -> GELU ->
  Linear(512, 1)``, one head for the CLS and the patch tokens, PyTorch's default initialisation (drawn from
  ``seed`` here); Adam, lr 1e-4, betas (0.5, 0.999);
- **reward** (``dino_patch_cotrain_score``, rewards.py lines 375-434): ``0.7 z(CLS) + 0.3 mean_j z(patch_j)``
  over 64 patch tokens drawn uniformly with replacement for each image (fewer tokens than 64: that many draws),
  raw logits. The script draws them from the global RNG on every call; here each scoring call draws from its own
  generator seeded by ``(seed, calls so far)``, so a run, its resume and a repeat score alike
  (:func:`patch_indices`); ``output: probability`` gives the sigmoid of that logit instead, in [0, 1], for
  summing with other [0, 1] rewards;
- **update** (``train_dino``, script lines 156-232): one step per discriminator epoch on the epoch's samples
  (negatives) against as many references (positives), CLS loss plus 0.3 times the patch loss on 64 freshly drawn
  patches per image (drawn from ``(seed, updates so far)`` here). The script's loss is the hinge
  ``relu(1 - z_pos) + relu(1 + z_neg)``; here the logistic ``softplus(-z_pos) + softplus(z_neg)`` is kept
  (halved and balanced over both sides, in both terms, as the script's): its logits are log-odds, so
  ``output: probability`` is P(reference-like), a calibrated number on the [0, 1] scale of the other rewards,
  where a hinge's logits only aim at the margin +-1;
- **positives** (script lines 862-889): the script pairs each prompt with its own reference images (its
  ``prompt2img`` JSON: Qwen-Image renders of that prompt). Here a prompt's metadata ``reference_images`` (a path
  or a list of paths, relative ones under ``reference_root``) are its references: each prompt's rows get its
  references in a seeded order, each used once before any repeats (the script uses its 8 references for each
  batch of 8 samples); rows of prompts without any draw from the ``references`` folder. A one-line log says which
  is used;
- ``reference_similarity`` (the script's eval metric ``image_similarity``, rewards.py lines 147-203, fed at script
  lines 378-398): max cosine of an image's feature to its prompt's references (:func:`per_prompt_similarity`),
  the whole folder for prompts without any.

What still differs, and why:

- the script trains its head on raw DINO tokens but scores unit-length ones; here both see unit-length tokens, so
  the reward is the head that was trained;
- logistic loss for the hinge (above); float32 for bf16; the draws are seeded (above);
- the script resizes images to 518 px for DINO; flowrl's ``dino`` network takes its ``size`` (518 in
  ``configs/sd35_medium/grpo_adversarial.yaml``);
- the script's discriminator steps on each process's own samples, DDP averaging the gradients; here every process
  updates on the images of all processes, one step on the whole batch;
- a scoring call's draw depends on the rows it holds, so the reward's ``batch_size`` and the number of processes
  change which patches an image gets (as the script's per-process RNG does): N processes score like one only with
  ``patch_weight: 0``;
- ``image_similarity`` in the script takes the max over the references of every prompt of its eval batch (each
  prompt's first reference), as a raw cosine; here the max over the image's own prompt's references, as
  ``(1 + cos) / 2`` in [0, 1] (``reduce="mean"`` for the mean).

:meth:`AdversarialReward.state_dict` holds the head, the optimizer state and the draw counters, JSON-safe
(tensors as base64 of their bytes, exact), saved in the run's trainer state.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flowrl.core.devices import resolve_device
from flowrl.core.media import image_files, read_rgb
from flowrl.features import DinoFeatures, ToyFeatures, build_feature_network
from flowrl.rewards_api import check_batch
from rewards.base import chunked, score_finite, score_per_image

logger = logging.getLogger("flowrl.rewards")

REFERENCES_KEY = "reference_images"  # metadata key: a prompt's own reference image path(s)
OPTIMIZERS = ("adam", "sgd")
OUTPUTS = ("logit", "probability")
ADAM_BETAS = (0.5, 0.999)  # Adv-GRPO's discriminator optimizer (GAN practice: a short first-moment memory)
HIDDEN = 512  # the width of Adv-GRPO's DINOHead
PATCHES = 64  # patch tokens drawn per image, in the reward and in the update
PATCH_WEIGHT = 0.3  # the patch term's weight: 1 - cls_weight (0.7) in the reward, patch_loss_weight in the loss
POLICY_EVERY = 10  # Adv-GRPO's d_times
UNIT_EPS = 1e-6  # x / (|x| + eps), as the reference's reward scales its tokens


# ------------------------------------------------------------------------------------------ references

def reference_folder_files(folder: str | Path) -> list[Path]:
    """The image files under ``folder``, or a one-line error for a missing or empty folder."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"references folder {folder} is not a directory; make one, e.g. the clean renders of "
                         "python -m tools.toy_artifacts runs/toy_artifacts --n 1000 (runs/toy_artifacts/clean)")
    files = image_files(folder)
    if not files:
        raise ValueError(f"references folder {folder} holds no images (png, jpg, jpeg, webp)")
    return files


def prompt_reference_files(metadata: Mapping[str, Any] | None, root: str | None) -> list[Path]:
    """A prompt's own references, ``metadata["reference_images"]`` (a path or a list), relative paths under
    ``root``; [] where it has none; a missing file is a one-line error naming it."""
    value = (metadata or {}).get(REFERENCES_KEY)
    if value is None:
        return []
    paths = [value] if isinstance(value, (str, Path)) else list(value)
    files = [Path(root).expanduser() / p if root is not None and not Path(p).is_absolute() else Path(p).expanduser()
             for p in paths]
    for file in files:
        if not file.is_file():
            raise ValueError(f"reference image not found: {file} (metadata '{REFERENCES_KEY}'; relative paths are "
                             "under the reward's reference_root, else the working directory)")
    return files


def read_resized(files: Sequence[Path], size: tuple[int, int]) -> torch.Tensor:
    """[R, 3, H, W] images of ``files`` in [0, 1], each resized (bilinear, antialiased) to ``size`` where it
    differs, as the reference resizes its references to the generated images' size."""
    images = []
    for file in files:
        image = read_rgb(file)  # [3, h, w]
        if tuple(image.shape[-2:]) != tuple(size):
            image = F.interpolate(image[None], size=size, mode="bilinear", antialias=True,
                                  align_corners=False)[0].clamp(0.0, 1.0)
        images.append(image)
    return torch.stack(images)


# ------------------------------------------------------------------------------------------ tokens

def has_patch_tokens(network: nn.Module) -> bool:
    """Whether :func:`feature_tokens` gives ``network``'s patch tokens (dino; toy with pool="mean")."""
    return isinstance(network, DinoFeatures) or (isinstance(network, ToyFeatures) and network.pool == "mean")


def feature_tokens(network: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """[N, 1 + P, F] float32 tokens of images [N, 3, H, W]: the image's global token first (DINO's CLS; the toy
    network's pooled feature, the mean of its positions), then its P patch tokens; P = 0 for networks without
    them (:func:`has_patch_tokens`). Token 0 is ``network(images)``."""
    if isinstance(network, ToyFeatures) and network.pool == "mean":
        x = images.float() * 2.0 - 1.0  # [N, 3, H, W], as ToyFeatures.forward
        for i, weight in enumerate(network.weights):
            x = F.conv2d(x, weight, stride=2, padding=1)  # [N, C_i, H / 2^(i+1), W / 2^(i+1)]
            if i < len(network.weights) - 1:
                x = F.relu(x)
        patches = x.flatten(2).transpose(1, 2)  # [N, h * w, F]
        return torch.cat([patches.mean(dim=1, keepdim=True), patches], dim=1)
    if isinstance(network, DinoFeatures):
        hidden: list[torch.Tensor] = []
        handle = network.model.register_forward_hook(lambda module, args, out: hidden.append(out.last_hidden_state))
        try:
            network(images)
        finally:
            handle.remove()
        registers = int(getattr(network.model.config, "num_register_tokens", 0) or 0)  # DINOv2 with registers
        tokens = hidden[0].float()  # [N, 1 + registers + P, F]
        return torch.cat([tokens[:, :1], tokens[:, 1 + registers:]], dim=1)
    return network(images).float()[:, None]  # [N, 1, F]


def unit(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens [..., F] scaled to unit length, ``x / (|x| + 1e-6)`` (the reference's reward)."""
    return tokens / (tokens.norm(dim=-1, keepdim=True) + UNIT_EPS)


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of ints (e.g. (seed, stream, count)), so each draw has its own stream."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> 1))


def patch_indices(num_images: int, num_patches: int, generator: torch.Generator) -> torch.Tensor | None:
    """[N, min(64, P)] patch indices, drawn uniformly with replacement for each image (the reference's
    ``torch.randint(0, N, (B, n_select))``); None without patch tokens."""
    if num_patches == 0:
        return None
    return torch.randint(num_patches, (num_images, min(PATCHES, num_patches)), generator=generator)


def drawn_patches(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N, D, F] the patch tokens of ``tokens`` [N, 1 + P, F] at ``index`` [N, D] (patch numbers, 0-based)."""
    patches = tokens[:, 1:]  # [N, P, F]
    return patches.gather(1, index.to(tokens.device)[..., None].expand(-1, -1, patches.shape[-1]))


# ------------------------------------------------------------------------------------------ JSON-safe tensors

def _encode(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: shape, dtype and its bytes in base64 (exact, and a fraction of a list of floats)."""
    array = tensor.detach().cpu().contiguous().numpy()
    return {"shape": list(array.shape), "dtype": str(array.dtype), "base64": base64.b64encode(array.tobytes()).decode()}


def _decode(state: Mapping[str, Any]) -> torch.Tensor:
    array = np.frombuffer(base64.b64decode(state["base64"]), dtype=np.dtype(state["dtype"])).copy()
    return torch.from_numpy(array).reshape(state["shape"])


# ------------------------------------------------------------------------------------------ the head

class DiscriminatorHead:
    """Adv-GRPO's head ``Linear(F, hidden) -> GELU -> Linear(hidden, 1)`` on unit tokens and its optimizer;
    :meth:`step` takes one step of the balanced logistic loss on (positives, negatives)."""

    def __init__(self, num_features: int, *, lr: float, optimizer: str = "adam", l2: float = 0.0,
                 patch_weight: float = PATCH_WEIGHT, hidden: int = HIDDEN, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        if lr <= 0 or l2 < 0 or hidden < 1 or not 0 <= patch_weight <= 1:
            raise ValueError(f"lr must be > 0, l2 >= 0, hidden >= 1 and patch_weight in [0, 1], got lr={lr}, l2={l2}, "
                             f"hidden={hidden}, patch_weight={patch_weight}")
        self.net = nn.Sequential(nn.Linear(num_features, hidden), nn.GELU(), nn.Linear(hidden, 1))
        generator = seeded_generator(seed, 0x4EAD)
        with torch.no_grad():  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), here from the seed
            for layer in (self.net[0], self.net[2]):
                bound = layer.in_features ** -0.5
                for param in (layer.weight, layer.bias):
                    param.copy_(torch.rand(param.shape, generator=generator) * 2 * bound - bound)
        self.net.to(device)
        self.l2, self.patch_weight = l2, patch_weight
        params = list(self.net.parameters())
        self.optimizer = (torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS) if optimizer == "adam"
                          else torch.optim.SGD(params, lr=lr))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[...] logits of unit tokens [..., F]."""
        return self.net(tokens).squeeze(-1)

    def reward_logits(self, tokens: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """[N] the reference's reward: ``(1 - patch_weight) z(token 0) + patch_weight mean_j z(patch index_j)``
        of unit tokens [N, 1 + P, F], patches at ``index`` [N, D]; z(token 0) alone without patches."""
        first = self.logits(tokens[:, 0])  # [N]
        if index is None or self.patch_weight == 0:
            return first
        return (1 - self.patch_weight) * first + self.patch_weight * self.logits(drawn_patches(tokens, index)).mean(1)

    def loss(self, positives: torch.Tensor, negatives: torch.Tensor, positive_index: torch.Tensor | None = None,
             negative_index: torch.Tensor | None = None) -> torch.Tensor:
        """``L(token 0) + patch_weight L(drawn patches) + l2/2 sum |W|^2`` on unit tokens [N, 1 + P, F], with
        ``L = 1/2 mean softplus(-z_pos) + 1/2 mean softplus(z_neg)`` (the reference's structure with the logistic
        loss in place of its hinge; biases are not penalised)."""
        def balanced(z_pos: torch.Tensor, z_neg: torch.Tensor) -> torch.Tensor:
            return 0.5 * F.softplus(-z_pos).mean() + 0.5 * F.softplus(z_neg).mean()

        loss = balanced(self.logits(positives[:, 0]), self.logits(negatives[:, 0]))
        if positive_index is not None and negative_index is not None and self.patch_weight > 0:
            loss = loss + self.patch_weight * balanced(self.logits(drawn_patches(positives, positive_index)),
                                                       self.logits(drawn_patches(negatives, negative_index)))
        penalty = sum((layer.weight * layer.weight).sum() for layer in (self.net[0], self.net[2]))
        return loss + 0.5 * self.l2 * penalty

    def step(self, positives: torch.Tensor, negatives: torch.Tensor, positive_index: torch.Tensor | None = None,
             negative_index: torch.Tensor | None = None) -> float:
        """One optimizer step on unit tokens positives [P, 1 + T, F] (label 1) and negatives [N, 1 + T, F]
        (label 0), patches at the indices -> the loss before it."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(positives, negatives, positive_index, negative_index)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the weights and the optimizer's per-parameter state (Adam's moments and step count)."""
        state = self.optimizer.state_dict()["state"]
        return {"params": {name: _encode(p) for name, p in self.net.state_dict().items()},
                "optimizer": {str(i): {k: _encode(torch.as_tensor(v)) for k, v in s.items()} for i, s in state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict({name: _decode(value) for name, value in state["params"].items()})
        device = next(self.net.parameters()).device
        inner = {int(i): {k: _decode(v).to(device) if k != "step" else _decode(v) for k, v in s.items()}
                 for i, s in state["optimizer"].items()}
        self.optimizer.load_state_dict({"state": inner, "param_groups": self.optimizer.state_dict()["param_groups"]})


# ------------------------------------------------------------------------------------------ the rewards

class _ReferenceReward:
    """What both rewards share: the frozen feature network, the fallback folder's files and each prompt's own
    references, and a one-line log of which are used."""

    name: str

    def __init__(self, references: str | None, reference_root: str | None, features: str,
                 feature_kwargs: Mapping[str, Any] | None, device: Any, batch_size: int) -> None:
        self.device = resolve_device(device)
        self.network = build_feature_network(features, **dict(feature_kwargs or {})).to(self.device)
        self.folder = None if references is None else Path(references).expanduser()
        self.folder_files = [] if references is None else reference_folder_files(references)
        self.reference_root, self.batch_size = reference_root, batch_size
        self._logged: set[str] = set()

    def references_of(self, metadata: Sequence[Mapping[str, Any] | None]) -> list[list[Path] | None]:
        """Each row's own references (None: the row's prompt has none, so the folder stands in); a row with
        neither is a one-line error. Says once in the log which are used."""
        own = [prompt_reference_files(m, self.reference_root) or None for m in metadata]
        fallback = sum(files is None for files in own)
        if fallback and self.folder is None:
            raise ValueError(f"{self.name}: {fallback} of {len(own)} prompts carry no metadata '{REFERENCES_KEY}' and "
                             "no references folder is set; give the prompts references or set references: FOLDER")
        source = (f"the references folder {self.folder} (no prompt carries metadata '{REFERENCES_KEY}')"
                  if fallback == len(own) else
                  f"each prompt's metadata '{REFERENCES_KEY}'" + (f", the folder {self.folder} for prompts without"
                                                                  if fallback else ""))
        if source not in self._logged:
            self._logged.add(source)
            logger.warning("%s: references from %s", self.name, source)
        return own


class AdversarialReward(_ReferenceReward):
    """Reward protocol and :class:`flowrl.rewards_api.TrainableReward`: ``{"adversarial": [N]}``, the head's
    hybrid logit (``output: probability``: its sigmoid); :meth:`update` trains the head on the policy's samples
    against the references, on the epochs of the schedule (:meth:`updates_on`)."""

    name = "adversarial"

    def __init__(self, references: str | None = None, reference_root: str | None = None, features: str = "toy",
                 feature_kwargs: Mapping[str, Any] | None = None, policy_every: int = POLICY_EVERY,
                 update_every: int = 1, lr: float = 1e-4, steps: int = 1, l2: float = 0.0, optimizer: str = "adam",
                 patch_weight: float = PATCH_WEIGHT, hidden: int = HIDDEN, output: str = "logit", seed: int = 0,
                 device: Any = "auto", batch_size: int = 64) -> None:
        if policy_every < 1 or update_every < 1 or steps < 1:
            raise ValueError(f"policy_every, update_every and steps must be >= 1, got {policy_every}, {update_every} "
                             f"and {steps}")
        if policy_every > 1 and update_every != 1:
            raise ValueError(f"update_every={update_every} needs policy_every: 1 (with policy_every={policy_every} the "
                             "discriminator trains on every epoch the policy does not)")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        super().__init__(references, reference_root, features, feature_kwargs, device, batch_size)
        if patch_weight > 0 and not has_patch_tokens(self.network):
            raise ValueError(f"adversarial: features {features!r} give no patch tokens; use dino or toy with "
                             "pool: mean, or set patch_weight: 0 (the head then scores the global feature alone)")
        self.policy_every, self.update_every, self.steps, self.output = policy_every, update_every, steps, output
        self.seed, self.updates, self.calls = seed, 0, 0
        self.head = DiscriminatorHead(self.network.num_features, lr=lr, optimizer=optimizer, l2=l2,
                                      patch_weight=patch_weight, hidden=hidden, seed=seed, device=self.device)

    # --- the schedule (Adv-GRPO's d_times) ---------------------------------------------------------------------
    def updates_on(self, epoch: int) -> bool:
        """Whether the discriminator trains on epoch ``epoch``'s rollouts: every epoch the policy does not
        (``(epoch + 1) % policy_every != 0``); joint (``policy_every: 1``): every ``update_every``-th epoch."""
        if self.policy_every > 1:
            return (epoch + 1) % self.policy_every != 0
        return (epoch + 1) % self.update_every == 0

    def policy_updates_on(self, epoch: int) -> bool:
        """Whether the policy trains on epoch ``epoch``: epochs ``policy_every - 1, 2 policy_every - 1, ...``."""
        return (epoch + 1) % self.policy_every == 0

    # --- scoring -------------------------------------------------------------------------------------------------
    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 1 + P, F] unit tokens of images [N, 3, H, W]."""
        return unit(feature_tokens(self.network, images.to(self.device)))

    @torch.no_grad()
    def score(self, images: torch.Tensor) -> torch.Tensor:
        """[N] the reward of images [N, 3, H, W]; this call's patches drawn from ``(seed, calls so far)``."""
        tokens = self.tokens(images)  # [N, 1 + P, F]
        index = patch_indices(len(tokens), tokens.shape[1] - 1, seeded_generator(self.seed, 0x5C0E, self.calls))
        self.calls += 1
        logits = self.head.reward_logits(tokens, index)  # [N]
        return logits if self.output == "logit" else torch.sigmoid(logits)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        return score_per_image(self.name, self.score, images, prompts, metadata, self.batch_size)

    # --- training ------------------------------------------------------------------------------------------------
    def positives(self, metadata: Sequence[Mapping[str, Any] | None], size: tuple[int, int],
                  generator: torch.Generator) -> torch.Tensor:
        """[N, 3, H, W] one reference per row: each prompt's rows take its own references in a seeded order, each
        once before any repeats; rows of prompts without any take folder images, drawn likewise."""
        own = self.references_of(metadata)
        pools: dict[tuple[Path, ...], list[int]] = {}  # rows sharing one pool of references
        for row, files in enumerate(own):
            pools.setdefault(tuple(files) if files is not None else (), []).append(row)
        chosen: list[Path] = [Path()] * len(own)
        for key, rows in pools.items():  # in the order of their first rows, so the draws are reproducible
            files = list(key) or self.folder_files
            order = torch.cat([torch.randperm(len(files), generator=generator)
                               for _ in range(-(-len(rows) // len(files)))])  # each file once per round
            for row, i in zip(rows, order.tolist()):
                chosen[row] = files[i]
        return read_resized(chosen, size)

    def update(self, images: torch.Tensor, prompts: Sequence[str],
               metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, float]:
        """``steps`` head steps on ``images`` [N, 3, H, W] (negatives; rows holding NaN/inf are left out) against
        one reference per row (:meth:`positives`) -> {"disc_loss": the loss before the first step,
        "disc_accuracy": the balanced accuracy of the CLS logits before it}; {} when no image is finite."""
        finite = torch.isfinite(images.flatten(1)).all(dim=1)
        if not bool(finite.any()):
            return {}
        kept = finite.nonzero().flatten().tolist()
        generator = seeded_generator(self.seed, 0xD15C, self.updates)
        references = self.positives([metadata[i] for i in kept], tuple(images.shape[-2:]), generator)  # [N, 3, H, W]
        with torch.no_grad():
            negatives = torch.cat([self.tokens(images[kept][i:i + self.batch_size])
                                   for i in range(0, len(kept), self.batch_size)])  # [N, 1 + P, F]
            positives = torch.cat([self.tokens(references[i:i + self.batch_size])
                                   for i in range(0, len(kept), self.batch_size)])  # [N, 1 + P, F]
            accuracy = 0.5 * (float((self.head.logits(positives[:, 0]) > 0).float().mean())
                              + float((self.head.logits(negatives[:, 0]) < 0).float().mean()))
        num_patches, losses = negatives.shape[1] - 1, []
        for _ in range(self.steps):
            losses.append(self.head.step(positives, negatives, patch_indices(len(positives), num_patches, generator),
                                         patch_indices(len(negatives), num_patches, generator)))
        self.updates += 1
        return {"disc_loss": losses[0], "disc_accuracy": accuracy}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the head, its optimizer state, the update count and the scoring calls so far."""
        return {"head": self.head.state_dict(), "updates": self.updates, "calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.updates, self.calls = int(state["updates"]), int(state["calls"])


class ReferenceSimilarity(_ReferenceReward):
    """``{"reference_similarity": [N]}``: ``(1 + cos) / 2`` of an image's features to the nearest of its prompt's
    references (``reduce="max"``) or averaged over them (``"mean"``), in [0, 1]; prompts without references of
    their own are compared with the whole ``references`` folder. No training."""

    name = "reference_similarity"

    def __init__(self, references: str | None = None, reference_root: str | None = None, features: str = "toy",
                 feature_kwargs: Mapping[str, Any] | None = None, reduce: str = "max", device: Any = "auto",
                 batch_size: int = 64) -> None:
        if reduce not in ("max", "mean"):
            raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
        super().__init__(references, reference_root, features, feature_kwargs, device, batch_size)
        self.reduce = reduce
        self._unit_features: dict[Path, torch.Tensor] = {}  # [F] per reference file, computed once

    def unit_references(self, files: Sequence[Path]) -> torch.Tensor:
        """[R, F] unit features of reference ``files``, each computed once per run."""
        for file in dict.fromkeys(files):  # one at a time: references may differ in size; networks resize them
            if file not in self._unit_features:
                features = self.network(read_rgb(file)[None].to(self.device)).float()  # [1, F]
                self._unit_features[file] = F.normalize(features, dim=-1)[0]
        return torch.stack([self._unit_features[file] for file in files])

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        check_batch(images, prompts, metadata)

        def score_chunk(x: torch.Tensor, chunk_prompts: Sequence[str], chunk_metadata: Sequence[dict]):
            own = self.references_of(chunk_metadata)
            pools = {files: self.unit_references(list(files) if files else self.folder_files)
                     for files in {tuple(f) if f is not None else () for f in own}}
            groups = [pools[tuple(f) if f is not None else ()] for f in own]

            def fn(pixels: torch.Tensor) -> torch.Tensor:
                unit_features = F.normalize(self.network(pixels.to(self.device)).float(), dim=-1)  # [N, F]
                return per_prompt_similarity(unit_features, groups, self.reduce)

            return {self.name: score_finite(x, fn)}

        return chunked(score_chunk, images, prompts, metadata, self.batch_size)


def similarity(unit_features: torch.Tensor, unit_references: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """[N] ``(1 + cos) / 2`` of unit features [N, F] to unit references [R, F], max or mean over references."""
    cosines = unit_features @ unit_references.T  # [N, R]
    best = cosines.amax(dim=1) if reduce == "max" else cosines.mean(dim=1)
    return ((1.0 + best) / 2.0).clamp(0.0, 1.0)


def per_prompt_similarity(unit_features: torch.Tensor, references: Sequence[torch.Tensor],
                          reduce: str = "max") -> torch.Tensor:
    """[N] :func:`similarity` of each unit feature [N, F] to its own unit references ``references[i]`` [R_i, F]
    (the references of row i's prompt)."""
    return torch.stack([similarity(unit_features[i:i + 1], refs.to(unit_features.device), reduce)[0]
                        for i, refs in enumerate(references)])
