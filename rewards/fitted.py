"""A trainable artifact reward: a logistic head on frozen image features, fitted on clean against
artifact-containing images, used as a regulariser beside a preference reward.

The reward-hacking paper of ``../shared/PAPERS.md`` finds that preference and prompt-consistency rewards,
alone or ensembled, are hacked with artifact-prone images, and adds "a lightweight and adaptive artifact
reward model, trained on a small curated dataset of artifact-free and artifact-containing samples" as a
regulariser. This module is that reward in its plainest form:

- **features**: a frozen network of :mod:`flowrl.features` (``toy`` for the toy world, ``clip`` or ``dino``
  for real models), standardised with the training images' mean and std;
- **head**: L2-regularised logistic regression, ``min_w,b mean_i [softplus(z_i) - y_i z_i] + l2/2 |w|^2`` with
  ``z_i = <x_i, w> + b`` and ``y = 1`` for clean (the bias is not penalised), solved by Newton's method with a
  backtracking line search in float64 (:func:`fit_head`): convex, so one optimum, reached the same way on
  every machine;
- **score**: ``fitted = sigmoid(z)``, the head's probability that the image is clean, in [0, 1], higher is
  better, so it adds to a preference reward with a weight like any other.

Make the file with the command, which holds out a seeded share of each folder and prints the held-out
accuracy, then train with it beside the reward it regularises::

    flowrl fit-reward CLEAN_DIR ARTIFACT_DIR --out runs/artifact.safetensors --features toy
    flowrl train configs/toy/grpo_proxy_artifact.yaml

The file is plain safetensors: tensors ``weight`` [F], ``bias`` [1], ``mean`` [F], ``std`` [F]; metadata
``features`` (the network's registry name), ``feature_kwargs`` and ``classes`` (JSON), ``held_out_accuracy``
and the counts, so a reward file says what it was fitted on and how well it separates unseen images.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from flowrl.core.devices import resolve_device
from flowrl.features import FEATURE_NETWORKS, build_feature_network
from flowrl.core.media import image_files, read_rgb
from rewards.base import score_per_image

CLASSES = ("clean", "artifact")  # label 1 and label 0: the head's sigmoid is P(clean)
FORMAT = "flowrl.fitted_reward/1"  # metadata "format": what wrote the file, and which layout it has
MIN_PER_CLASS = 2  # one image to fit on and one held out


# ------------------------------------------------------------------------------------------ the head

def fit_head(features: torch.Tensor, labels: torch.Tensor, l2: float = 1e-3, *, max_iter: int = 100,
             tol: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression of ``labels`` [N] (1 or 0) on ``features`` [N, F] -> (weight [F], bias []), float64.

    Minimises ``mean_i [softplus(z_i) - y_i z_i] + l2/2 |w|^2``, ``z = features @ w + b``. Newton's method
    (``l2 > 0`` keeps the Hessian positive definite in ``w`` and the optimum finite even on separable data),
    each step halved until the loss falls by Armijo's rule, stopped when the largest gradient entry is
    under ``tol``."""
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0 (got {l2}): without it separable features send the weights to infinity")
    x = features.double()
    y = labels.double()
    n, f = x.shape
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], dim=1)  # [N, F+1], the bias last
    penalty = torch.full((f + 1,), float(l2), dtype=x.dtype)
    penalty[-1] = 0.0  # the bias is not penalised
    theta = torch.zeros(f + 1, dtype=x.dtype)

    def loss(t: torch.Tensor) -> torch.Tensor:
        z = design @ t  # [N]
        return (F.softplus(z) - y * z).mean() + 0.5 * (penalty * t * t).sum()

    for _ in range(max_iter):
        p = torch.sigmoid(design @ theta)  # [N]
        grad = design.T @ (p - y) / n + penalty * theta  # [F+1]
        if float(grad.abs().max()) < tol:
            break
        hessian = (design.T * (p * (1 - p))) @ design / n + torch.diag(penalty)  # [F+1, F+1]
        hessian += 1e-12 * torch.eye(f + 1, dtype=x.dtype)  # keeps the bias row solvable when every p saturates
        step = torch.linalg.solve(hessian, grad)
        current, slope, size = loss(theta), float(grad @ step), 1.0
        while float(loss(theta - size * step)) > float(current) - 1e-4 * size * slope and size > 1e-10:
            size /= 2
        theta = theta - size * step
    return theta[:-1], theta[-1]


def standardise(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], std [F]) of ``features`` [N, F]; a constant feature gets std 1, so it standardises to 0."""
    mean = features.mean(dim=0)
    std = features.std(dim=0, unbiased=False)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))


# ------------------------------------------------------------------------------------------ the file

def _check_features(name: str) -> None:
    if name not in FEATURE_NETWORKS:
        raise ValueError(f"unknown feature network {name!r}; choose one of {', '.join(sorted(FEATURE_NETWORKS))}")


def save_head(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> Path:
    """Write the reward file atomically (a temporary file beside it, then ``os.replace``): an interrupted
    write never leaves half a file under the name a config points at."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(temporary),
                  metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def load_head(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata with the JSON fields decoded) of a reward file, or a one-line error saying what is
    wrong and how to make a good one."""
    from safetensors import safe_open

    from flowrl.core.safe_io import check_safetensors

    path = Path(path).expanduser()
    remedy = f"write one with: flowrl fit-reward CLEAN_DIR ARTIFACT_DIR --out {path}"
    if not path.is_file():
        raise FileNotFoundError(f"fitted reward file not found: {path}; {remedy}")
    try:
        check_safetensors(path, "fitted reward file")
    except ValueError as error:
        raise ValueError(f"{error}; {remedy}") from None
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        raw = dict(handle.metadata() or {})
    missing = [k for k in ("weight", "bias", "mean", "std") if k not in tensors]
    missing += [f"metadata {k!r}" for k in ("features", "feature_kwargs", "classes") if k not in raw]
    if missing:
        raise ValueError(f"{path} is not a fitted reward file (no {', '.join(missing)}); {remedy}")
    try:
        metadata = {**raw, "feature_kwargs": json.loads(raw["feature_kwargs"]), "classes": json.loads(raw["classes"])}
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: metadata is not valid JSON ({error.msg}); {remedy}") from None
    if metadata["features"] not in FEATURE_NETWORKS:
        raise ValueError(f"{path} names the feature network {metadata['features']!r}, which flowrl.features does "
                         f"not know (known: {', '.join(sorted(FEATURE_NETWORKS))}); refit it with flowrl fit-reward "
                         "--features NAME")
    f = tensors["weight"].shape
    if len(f) != 1 or any(tensors[k].shape != f for k in ("mean", "std")) or tensors["bias"].numel() != 1:
        raise ValueError(f"{path}: weight, mean and std must be [F] and bias one number, got "
                         f"{ {k: tuple(v.shape) for k, v in tensors.items()} }; {remedy}")
    return tensors, metadata


# ------------------------------------------------------------------------------------------ features of files

@torch.no_grad()
def file_features(network: torch.nn.Module, files: Sequence[Path], device: torch.device,
                  batch_size: int = 32) -> torch.Tensor:
    """[N, F] float32 features of image files, read ``batch_size`` at a time (a folder of large images never
    sits in memory whole); images of one size within a batch go through the network together."""
    rows: list[torch.Tensor] = []
    for start in range(0, len(files), batch_size):
        images = [read_rgb(file) for file in files[start:start + batch_size]]  # each [3, H, W]
        out = torch.empty(len(images), network.num_features)
        for size in {tuple(image.shape) for image in images}:
            index = [i for i, image in enumerate(images) if tuple(image.shape) == size]
            batch = torch.stack([images[i] for i in index]).to(device)  # [B, 3, H, W]
            out[index] = network(batch).float().cpu()
        rows.append(out)
    return torch.cat(rows) if rows else torch.empty(0, network.num_features)


def _held_out_split(n: int, share: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit indices, held-out indices) of ``n`` images: a seeded permutation, at least one image on each side."""
    order = torch.randperm(n, generator=generator)
    held = min(n - 1, max(1, round(share * n)))
    return order[held:].sort().values, order[:held].sort().values


# ------------------------------------------------------------------------------------------ the reward

class FittedReward:
    """Reward protocol: ``FittedReward(path)(images [N,3,H,W] in [0,1], prompts, metadata) -> {"fitted": [N]}``,
    the fitted head's P(clean); NaN for an image holding NaN/inf."""

    name = "fitted"

    def __init__(self, path: str, device: Any = "auto", batch_size: int = 64) -> None:
        tensors, self.metadata = load_head(path)
        self.device = resolve_device(device)
        self.network = build_feature_network(self.metadata["features"], **self.metadata["feature_kwargs"])
        self.network = self.network.to(self.device)
        if tensors["weight"].shape[0] != self.network.num_features:
            raise ValueError(f"{path}: the head has {tensors['weight'].shape[0]} weights but the feature network "
                             f"{self.metadata['features']!r} gives {self.network.num_features} features; refit it")
        self.weight, self.mean, self.std = (tensors[k].float().to(self.device) for k in ("weight", "mean", "std"))
        self.bias = float(tensors["bias"].reshape(()))
        self.batch_size = batch_size

    @torch.no_grad()
    def p_clean(self, images: torch.Tensor) -> torch.Tensor:
        """[N] P(clean) of images [N, 3, H, W] in [0, 1]."""
        features = self.network(images.to(self.device)).float()  # [N, F]
        return torch.sigmoid((features - self.mean) / self.std @ self.weight + self.bias)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        return score_per_image(self.name, self.p_clean, images, prompts, metadata, self.batch_size)

    @classmethod
    def fit(cls, clean_dir: str | Path, artifact_dir: str | Path, out: str | Path, *, features: str = "toy",
            feature_kwargs: Mapping[str, Any] | None = None, held_out: float = 0.2, seed: int = 0,
            l2: float = 1e-3, device: Any = "auto", force: bool = False) -> dict[str, Any]:
        """Fit the head on the images of ``clean_dir`` against those of ``artifact_dir`` and write ``out``.

        Each folder (every png/jpg/jpeg/webp under it) is split by a permutation seeded with ``seed``:
        ``held_out`` of it is kept aside, the rest fits the standardisation and the head. Returns the
        summary: held-out accuracy (correct/total), fit accuracy and the counts. Every input is checked
        before any image is read, and nothing is written unless the fit finished."""
        out = Path(out)
        _check_features(features)
        if out.suffix != ".safetensors":
            raise ValueError(f"--out {out}: the reward file is safetensors; give a name ending in .safetensors")
        if out.exists() and not force:
            raise ValueError(f"{out} already exists; pass --force to overwrite it")
        if not 0.0 < held_out < 1.0:
            raise ValueError(f"--held-out must lie in (0, 1), got {held_out}: the accuracy is measured on held-out "
                             "images")
        files = {}
        for label, folder in zip(CLASSES, (clean_dir, artifact_dir)):
            if not Path(folder).is_dir():
                raise FileNotFoundError(f"{label} folder {folder} is not a directory")
            files[label] = image_files(folder)
            if len(files[label]) < MIN_PER_CLASS:
                raise ValueError(f"{label} folder {folder} holds {len(files[label])} images (png, jpg, webp); the "
                                 f"head needs at least {MIN_PER_CLASS} per class, one to fit and one held out")
        device = resolve_device(device)
        network = build_feature_network(features, **dict(feature_kwargs or {})).to(device)
        generator = torch.Generator().manual_seed(seed)
        parts = {"fit": ([], []), "held_out": ([], [])}  # split -> (features [n, F] per class, labels)
        for label in CLASSES:
            x = file_features(network, files[label], device)  # [n, F]
            bad = (~torch.isfinite(x).all(dim=1)).nonzero()[:, 0].tolist()
            if bad:  # a head fitted on them would hold non-finite weights and score every image NaN
                raise ValueError(f"feature network {features!r} gave non-finite features for {len(bad)} of the "
                                 f"{len(x)} {label} images (first: {files[label][bad[0]]}); check --feature-kwargs and "
                                 "the images")
            fit_index, held_index = _held_out_split(len(x), held_out, generator)
            for split, index in (("fit", fit_index), ("held_out", held_index)):
                parts[split][0].append(x[index])
                parts[split][1].append(torch.full((len(index),), float(label == CLASSES[0])))
        (x_fit, y_fit), (x_held, y_held) = ((torch.cat(a), torch.cat(b)) for a, b in parts.values())
        mean, std = standardise(x_fit)
        weight, bias = fit_head((x_fit - mean) / std, y_fit, l2)

        def correct(x: torch.Tensor, y: torch.Tensor) -> int:
            z = ((x.double() - mean.double()) / std.double()) @ weight + bias
            return int(((z > 0).double() == y.double()).sum())

        counts = {split: {label: int((y == float(label == CLASSES[0])).sum()) for label in CLASSES}
                  for split, y in (("fit", y_fit), ("held_out", y_held))}
        summary = {"held_out_correct": correct(x_held, y_held), "held_out_total": len(y_held),
                   "fit_correct": correct(x_fit, y_fit), "fit_total": len(y_fit), "counts": counts}
        summary["held_out_accuracy"] = summary["held_out_correct"] / summary["held_out_total"]
        metadata = {"format": FORMAT, "features": features, "feature_kwargs": dict(feature_kwargs or {}),
                    "classes": list(CLASSES), "held_out_accuracy": repr(summary["held_out_accuracy"]),
                    "held_out_correct": str(summary["held_out_correct"]),
                    "held_out_total": str(summary["held_out_total"]), "counts": counts, "l2": repr(float(l2)),
                    "seed": str(seed)}
        if not all(bool(torch.isfinite(t).all()) for t in (weight, bias, mean, std)):
            raise ValueError(f"the fitted head on {features!r} features is not finite (features too large or "
                             "degenerate); try other --features or --feature-kwargs, or a larger --l2")
        summary["path"] = save_head(out, {"weight": weight, "bias": bias.reshape(1), "mean": mean, "std": std},
                                    metadata)
        return summary
