"""The ``geneval`` reward: GenEval's judge in process, as ToyEval is the toy world's.

Why in process: Flow-GRPO's GenEval recipe needs the judge on every rollout batch; an HTTP judge
(``rewards.remote``) still works, but this one needs no second environment. The rules are
:mod:`rewards.geneval.rules` (GenEval's ``evaluate``), the models :mod:`rewards.geneval.models`.

Output, in ToyEval's shape: ``geneval`` (strict, 1 or 0 per image: GenEval's ``correct``) and the partial
sub-scores ``geneval/count``, ``/color``, ``/position``, ``/exclude`` and ``/partial`` (fractions of clauses;
NaN where the prompt has none of that kind), plus ``geneval/flow_grpo``, the dense score Flow-GRPO trains on
(train on it with ``key: geneval/flow_grpo``). Per-task means and the overall score (the mean of the task
means, GenEval's "Overall score") are what :func:`flowrl.data.tasks.by_task` makes of these where prompts
carry a task (``flowrl eval`` reads GenEval's ``tag`` as the task). Images holding NaN/inf score NaN.

Batching: every image of a call goes through the detector ``batch_size`` at a time, then every object whose
colour a clause asks for goes through CLIP in one batch; an image's score never depends on its batch mates.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

import rewards.geneval.rules as rules
from flowrl.core.devices import resolve_device, resolve_dtype
from flowrl.rewards_api import check_batch
from rewards.geneval.models import CLIP_PRETRAINED, DETECTOR_ID, ColorClassifier, Detector, clip_weights


class GenEval:
    """Reward protocol: GenEval()(images [N,3,H,W] in [0,1], prompts, GenEval metadata) -> {key: Tensor[N]}.

    ``detector``: hub id or local folder of a transformers Mask2Former COCO-instance model;
    ``clip_pretrained``: open_clip's tag for ViT-L-14 ("openai") or a local checkpoint file. ``model``,
    ``processor``, ``clip_model`` and ``clip_tokenizer`` inject already-built models (tests, shared models).
    The thresholds default to GenEval's (:mod:`rewards.geneval.rules`)."""

    name = "geneval"

    def __init__(self, detector: str = DETECTOR_ID, clip_pretrained: str = CLIP_PRETRAINED, device: Any = "auto",
                 dtype: Any = "float32", batch_size: int = 8, clip_batch_size: int = 256,
                 threshold: float = rules.THRESHOLD, counting_threshold: float = rules.COUNTING_THRESHOLD,
                 max_objects: int = rules.MAX_OBJECTS, max_overlap: float = rules.MAX_OVERLAP,
                 position_threshold: float = rules.POSITION_THRESHOLD, detector_size: dict | None = None,
                 model: torch.nn.Module | None = None, processor: Any = None,
                 clip_model: torch.nn.Module | None = None, clip_tokenizer: Any = None) -> None:
        if batch_size < 1 or clip_batch_size < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_size} and {clip_batch_size}")
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        self.select = dict(threshold=float(threshold), counting_threshold=float(counting_threshold),
                           max_objects=int(max_objects), max_overlap=float(max_overlap))
        self.position_threshold = float(position_threshold)
        if clip_model is None:  # both weights found before either model is built: a missing one fails fast
            clip_pretrained = clip_weights(clip_pretrained)
        self.detector = Detector(detector, device=device, dtype=dtype, model=model, processor=processor,
                                 size=detector_size, batch_size=batch_size,
                                 min_score=min(self.select["threshold"], self.select["counting_threshold"]))
        self.colors = ColorClassifier(clip_pretrained, device=device, dtype=dtype, model=clip_model,
                                      tokenizer=clip_tokenizer, batch_size=clip_batch_size)

    def score_detections(self, meta: Mapping[str, Any], det: rules.Detections) -> dict[str, float]:
        """One image's strict score and sub-scores from its detections (colours already in ``det.colors``)."""
        return rules.judge(meta, det, position_threshold=self.position_threshold, **self.select)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        n = check_batch(images, prompts, metadata)
        specs = [rules.check_metadata(p, m) for p, m in zip(prompts, metadata)]  # bad metadata: one line, first
        keys = ["strict", *rules.SUBSCORES]
        rows: list[dict[str, float]] = [{k: math.nan for k in keys} for _ in range(n)]
        finite = torch.isfinite(images.flatten(1)).all(1).cpu()  # [N]
        todo = [i for i in range(n) if finite[i]]
        if todo:
            pixels = images[todo].float().clamp(0, 1)
            pixels = (pixels * 255).round() / 255  # [M, 3, H, W] on 8-bit levels, as GenEval reads PNGs
            dets = self.detector(pixels)
            kept = [rules.select_objects(d, specs[i]["tag"], **self.select) for i, d in zip(todo, dets)]
            queries = [(slot, k) for slot, (i, d, objects) in enumerate(zip(todo, dets, kept))
                       for k in rules.color_queries(specs[i], objects)]
            colors = self.colors(pixels, [(slot, dets[slot].boxes[k], dets[slot].masks[k], dets[slot].labels[k])
                                          for slot, k in queries])
            for (slot, k), color in zip(queries, colors):
                dets[slot].colors[k] = color
            for slot, i in enumerate(todo):
                rows[i] = rules.judge(specs[i], dets[slot], kept[slot], position_threshold=self.position_threshold)
        out = {}
        for k in keys:
            out[self.name if k == "strict" else f"{self.name}/{k}"] = torch.tensor([r[k] for r in rows],
                                                                                   dtype=torch.float32)  # [N]
        return out
