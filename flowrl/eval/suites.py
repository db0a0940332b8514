"""Diversity benchmark suites and their per-axis scores, after DivGenBench's four axes.

Preference mode collapse shows up as a model filling in what a prompt leaves open the same way every
time: one face, one style, one composition, one lighting. A suite is a prompt file whose records name,
in ``metadata["axes"]``, the axes each prompt leaves free (and a ``task``, so tables split by it):

- **layout**: where things are. Scored by the spread of each image's foreground centroid;
- **tonal**: brightness and contrast. Scored by the spread of each image's luminance mean and std;
- **style**: the rendering style. Scored by the dispersion of CLIP zero-shot style probabilities;
- **identity**: who or which subject. Scored by the spread of subject embeddings (a face or DINO network).

Each score is computed within a prompt's group of images (seeds differ, prompt fixed) and averaged over
the prompts that leave that axis free; higher is more diverse. Style and identity need a model; without
one they are reported as not measured. DivGenBench itself scores each axis with a dedicated model
(face recognition for identity, a style classifier, detectors for layout, colour statistics for tone);
the pixel statistics here are cheaper stand-ins for layout and tone that need no model, and the model
based axes take whichever network the config names. Shipped suites (``assets/benchmarks/``):
``divgen.jsonl`` (10 prompts per axis) and ``toy_diversity.jsonl`` (the toy world's prompts, whose free
attributes are also measured exactly by :mod:`flowrl.toy.diversity`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from flowrl.data.prompts import PromptSet, load_prompts
from flowrl.eval.metrics import pairwise_cosine_distance, per_group

AXES = ("identity", "style", "layout", "tonal")
STYLE_PROBES = ("a photograph", "an oil painting", "a watercolor painting", "a pencil sketch", "an anime drawing",
                "a 3D render", "pixel art", "a vintage photograph", "a comic book illustration", "a minimalist poster")
GENEVAL = "geneval"  # the bare suite name of the generated GenEval evaluation split
UNIFORM_SPREAD = math.sqrt(2 / 12)  # centroid spread of positions uniform over the frame: var 1/12 per coordinate


def load_suite(path: str | Path) -> PromptSet:
    """A suite's prompts; a one-line error for an empty file or an unknown axis.

    ``geneval`` (a bare name, no such file) is the generated GenEval evaluation split
    (:func:`flowrl.data.geneval.generate_split`). GenEval records name their task ``tag``, which
    :func:`flowrl.data.tasks.task_of` reads as the task, so a GenEval judge's overall score is the mean of its task
    means."""
    suite = _generated_geneval() if str(path) == GENEVAL and not Path(path).exists() else load_prompts(path)
    for number, metadata in enumerate(suite.metadata, start=1):
        unknown = [a for a in prompt_axes(metadata) if a not in AXES]
        if unknown:
            raise ValueError(f"{path}: prompt {number} names unknown axes {unknown}; use {list(AXES)}")
    return suite


def _generated_geneval() -> PromptSet:
    """The generated GenEval eval split, or a one-line error where this install has no generator."""
    try:
        from flowrl.data.geneval import generate_split
    except ImportError:
        raise ValueError("suite 'geneval' needs flowrl.data.geneval, which this install lacks; pass a "
                         "GenEval-format .jsonl instead (e.g. --suite assets/prompts/geneval_train.jsonl)") from None
    records = generate_split("eval", seed=0)
    return PromptSet([r["prompt"] for r in records], [dict(r["metadata"]) for r in records])


def prompt_axes(metadata: dict) -> list[str]:
    """The axes a prompt leaves free: ``metadata["axes"]`` (a list) or ``metadata["axis"]`` (one)."""
    axes = metadata.get("axes", metadata.get("axis", []))
    return [axes] if isinstance(axes, str) else list(axes)


def _spread(rows: torch.Tensor) -> torch.Tensor:
    """sqrt of the summed population variance of ``rows [n, d]``; NaN for a single row."""
    if len(rows) < 2:
        return torch.tensor(float("nan"))
    return rows.var(dim=0, unbiased=False).sum().sqrt()


def foreground_centroids(images: torch.Tensor) -> torch.Tensor:
    """Centre of mass ``[N, 2]`` (x, y in [0, 1]) of each image's difference from its border colour.

    The border's median colour stands in for the background; an image equal to it everywhere has its
    centroid at the centre."""
    n, _, h, w = images.shape
    border = torch.cat([images[..., 0, :], images[..., -1, :], images[..., :, 0], images[..., :, -1]], dim=-1)
    background = border.median(dim=-1).values  # [N, 3]
    weight = (images - background[..., None, None]).abs().sum(dim=1)  # [N, H, W]
    total = weight.sum(dim=(1, 2))  # [N]
    ys = (torch.arange(h, dtype=images.dtype, device=images.device) + 0.5) / h
    xs = (torch.arange(w, dtype=images.dtype, device=images.device) + 0.5) / w
    cx = (weight.sum(dim=1) * xs).sum(dim=1) / total.clamp_min(1e-12)
    cy = (weight.sum(dim=2) * ys).sum(dim=1) / total.clamp_min(1e-12)
    empty = total <= 1e-6
    return torch.stack([torch.where(empty, 0.5, cx), torch.where(empty, 0.5, cy)], dim=1)


def layout_spread(images: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per group ``[G]``: spread of foreground centroids over positions uniform in the frame (about 1);
    0 when every image puts its content in the same place."""
    return per_group(foreground_centroids(images), group_ids, _spread) / UNIFORM_SPREAD


def tonal_statistics(images: torch.Tensor) -> torch.Tensor:
    """Brightness (luminance mean) and contrast (luminance std) of each image ``[N, 2]``, Rec. 601 weights."""
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=images.dtype, device=images.device)
    luminance = (images * weights[:, None, None]).sum(dim=1).flatten(1)  # [N, H*W]
    return torch.stack([luminance.mean(dim=1), luminance.std(dim=1, unbiased=False)], dim=1)


def tonal_spread(images: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per group ``[G]``: sqrt(var(brightness) + var(contrast)), in [0, ~0.7]; 0 for one tone throughout."""
    return per_group(tonal_statistics(images), group_ids, _spread)


def style_dispersion(probabilities: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per group ``[G]``: normalised entropy of the group's mean style distribution (``probabilities [N, K]``),
    in [0, 1]; 0 when every image is the same single style, 1 when the group uses all K evenly."""
    def entropy(rows: torch.Tensor) -> torch.Tensor:
        p = rows.mean(dim=0).clamp_min(1e-12)
        return -(p * p.log()).sum() / math.log(probabilities.shape[1])

    return per_group(probabilities.double(), group_ids, entropy).float()


class StyleProbe:
    """CLIP zero-shot probabilities over :data:`STYLE_PROBES` (open_clip; a local checkpoint or a tag).

    ``pretrained=None`` builds random weights, for tests only."""

    def __init__(self, model: str = "ViT-B-32", pretrained: str | None = None, device: str = "cpu",
                 probes: tuple[str, ...] = STYLE_PROBES):
        from flowrl.features import build_feature_network

        import open_clip

        self.images = build_feature_network("clip", model=model, pretrained=pretrained, device=device)
        tokens = open_clip.get_tokenizer(model)([f"{p}" for p in probes]).to(device)
        with torch.no_grad():
            text = self.images.model.encode_text(tokens).float()
        self.text = torch.nn.functional.normalize(text, dim=-1)  # [K, D]
        self.scale = float(self.images.model.logit_scale.exp()) if hasattr(self.images.model, "logit_scale") else 100.0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` in [0, 1] -> style probabilities ``[N, K]``."""
        embeddings = self.images(images).to(self.text)  # [N, D], unit norm
        return (self.scale * embeddings @ self.text.T).softmax(dim=-1)


def axis_scores(images: torch.Tensor, group_ids: torch.Tensor, group_axes: dict[int, list[str]], *,
                style_probe=None, identity_network=None) -> tuple[dict[str, float], list[str]]:
    """``{"axis/<axis>": mean score over the groups that leave it free}`` and the axes not measured.

    ``group_axes`` maps each group id to its prompt's free axes. Style needs ``style_probe`` (images ->
    ``[N, K]`` probabilities) and identity an ``identity_network`` (images -> features); an axis some
    prompt names but no model scores is returned in the second list."""
    ids = torch.unique(group_ids).tolist()
    wanted = [a for a in AXES if any(a in group_axes.get(g, []) for g in ids)]
    scorers = {"layout": lambda: layout_spread(images, group_ids), "tonal": lambda: tonal_spread(images, group_ids)}
    if style_probe is not None:
        scorers["style"] = lambda: style_dispersion(style_probe(images), group_ids)
    if identity_network is not None:
        scorers["identity"] = lambda: pairwise_cosine_distance(identity_network(images).float(), group_ids)
    scores, missing = {}, []
    for axis in wanted:
        if axis not in scorers:
            missing.append(axis)
            continue
        per_group = scorers[axis]().cpu()  # [G], in the order of `ids`
        chosen = torch.tensor([axis in group_axes.get(g, []) for g in ids])
        scores[f"axis/{axis}"] = float(torch.nanmean(per_group[chosen]))
    return scores, missing
