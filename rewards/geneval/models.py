"""GenEval's two models: the Mask2Former instance detector and the CLIP colour classifier, batched.

Why apart from the rules (:mod:`rewards.geneval.rules`): loading, preprocessing and post-processing are where
this judge differs from GenEval's own scripts, and the differences are listed here.

Detector. GenEval runs mmdetection's Mask2Former Swin-S COCO-instance model (config
mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco); flowrl runs the transformers port of the Swin-S COCO-instance
Mask2Former, ``facebook/mask2former-swin-small-coco-instance`` (trained by Mask2Former's authors, not the
mmdetection checkpoint, so scores can differ a little from published GenEval numbers). Preprocessing follows
mmdetection's test pipeline: the shorter side to 800 (the longer at most 1333), ImageNet mean/std. The
transformers image processor also rounds the resized size up to a multiple of 32 where mmdetection pads
instead; the two agree whenever the resized sides are multiples of 32 (512 x 512 -> 800 x 800, for one).
Post-processing is mmdetection's ``MaskFormerFusionHead.instance_postprocess``, written out here because
the transformers ``post_process_instance_segmentation`` upsamples every mask to a fixed 384 x 384 whatever
the input size: mask logits upsampled (bilinear) to the processed size, resized to the image, the top 100
(query, class) pairs by class probability, binary masks at logit > 0, score = class probability x mean mask
probability inside the mask, box = the mask's extent (x2, y2 one past the last pixel).

Colour. GenEval's colour step is open_clip ViT-L-14 with OpenAI's weights, zero-shot over 10 colours with 3
templates per class (clip_benchmark's ``zero_shot_classifier``: unit text embeddings averaged over templates,
renormalised; the colour is the argmax of the cosine), on each object composited over grey #999 through its
mask and cropped to its box, through CLIP's own resize-and-crop (:func:`flowrl.models.clip.preprocess`).
GenEval runs CLIP under fp16 autocast; ``dtype`` picks the precision here (float32 by default).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from flowrl.models.clip import ClipBackbone, load_open_clip, preprocess
from rewards.geneval.rules import CLASSES, COLOR_TEMPLATES, COLORS, Detections

DETECTOR_ID = "facebook/mask2former-swin-small-coco-instance"
CLIP_ARCH, CLIP_PRETRAINED = "ViT-L-14", "openai"
CLIP_HUB_ID = "timm/vit_large_patch14_clip_224.openai"  # where open_clip fetches the "openai" ViT-L-14 weights
CLIP_DOWNLOAD = (f"download {CLIP_HUB_ID} (huggingface-cli download {CLIP_HUB_ID} --local-dir DIR) and set "
                 "kwargs.clip_pretrained=<its open_clip weights file, e.g. DIR/open_clip_pytorch_model.bin>")
DETECTOR_SIZE = {"shortest_edge": 800, "longest_edge": 1333}  # mmdetection's test scale (1333, 800)
TOP_K = 100  # mmdetection's test_cfg.max_per_image
GREY = 153 / 255  # GenEval's background #999
LABEL_ALIASES = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard",
                 "motorbike": "motorcycle", "aeroplane": "airplane", "sofa": "couch", "pottedplant": "potted plant",
                 "diningtable": "dining table", "tvmonitor": "tv", "hair dryer": "hair drier"}
"""Other spellings of GenEval's names in detectors' label maps (COCO's own short names first)."""


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def class_names(id2label: dict[int, str]) -> list[str | None]:
    """GenEval's name of each detector class id (None for a class GenEval does not know); every one of
    GenEval's 80 classes must be there, else a one-line ValueError."""
    names: list[str | None] = [None] * (max(id2label) + 1 if id2label else 0)
    for index, label in id2label.items():
        name = " ".join(str(label).replace("_", " ").replace("-", " ").lower().split())
        name = LABEL_ALIASES.get(name, name)
        names[int(index)] = name if name in CLASSES else None
    missing = [c for c in CLASSES if c not in names]
    if missing:
        raise ValueError(f"geneval: the detector's labels lack {len(missing)} of GenEval's classes "
                         f"(e.g. {missing[:3]}); use a COCO instance-segmentation model")
    return names


class Detector:
    """Mask2Former -> one :class:`Detections` per image, GenEval's class names, top :data:`TOP_K` pairs."""

    def __init__(self, path: str = DETECTOR_ID, *, device: torch.device, dtype: torch.dtype,
                 model: torch.nn.Module | None = None, processor: Any = None, size: dict | None = None,
                 batch_size: int = 8, min_score: float = 0.0) -> None:
        from transformers import Mask2FormerImageProcessor

        size = dict(size or DETECTOR_SIZE)
        if model is None:
            model, processor = _load_detector(path, size), None
        self.processor = processor or Mask2FormerImageProcessor(size=size, size_divisor=32)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.names = class_names(dict(model.config.id2label))
        self.device, self.dtype, self.batch_size = device, dtype, int(batch_size)
        self.min_score = float(min_score)  # detections at or below it are dropped: no rule can count them

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> list[Detections]:
        """``images [N, 3, H, W]`` in [0, 1], already on 8-bit levels -> N detections, ``batch_size`` at a time."""
        out: list[Detections] = []
        for chunk in images.split(self.batch_size):
            out += self._detect(chunk)
        return out

    def _detect(self, images: torch.Tensor) -> list[Detections]:
        height, width = images.shape[-2:]
        pixels = (images * 255).round().to(torch.uint8).cpu()  # [B, 3, H, W]: what a PNG holds
        inputs = self.processor(images=list(pixels), return_tensors="pt")
        outputs = self.model(pixel_values=inputs["pixel_values"].to(self.device, self.dtype),
                             pixel_mask=inputs["pixel_mask"].to(self.device))
        logits = outputs.class_queries_logits.float()  # [B, Q, C + 1]: the last class is "no object"
        masks = outputs.masks_queries_logits  # [B, Q, h, w] at a quarter of the processed size
        valid = inputs["pixel_mask"]  # [B, Hp, Wp]: 1 on the image, 0 on padding
        dets = []
        for b in range(len(images)):
            rows, cols = int(valid[b].any(1).sum()), int(valid[b].any(0).sum())
            full = F.interpolate(masks[b:b + 1].float(), size=valid.shape[-2:], mode="bilinear", align_corners=False)
            full = F.interpolate(full[..., :rows, :cols], size=(height, width), mode="bilinear",
                                 align_corners=False)[0]  # [Q, H, W]
            dets.append(self._instances(logits[b], full))
        return dets

    def _instances(self, logits: torch.Tensor, masks: torch.Tensor) -> Detections:
        """mmdetection's instance post-processing of one image: ``logits [Q, C + 1]``, ``masks [Q, H, W]``."""
        probs = logits.softmax(-1)[:, :-1]  # [Q, C]
        num_classes = probs.shape[1]
        top, index = probs.flatten().topk(min(TOP_K, probs.numel()), sorted=False)  # [K]
        labels, query = index % num_classes, index // num_classes
        mask_logits = masks[query]  # [K, H, W]
        binary = mask_logits > 0
        inside = binary.flatten(1).float()
        mask_score = (mask_logits.sigmoid().flatten(1) * inside).sum(1) / (inside.sum(1) + 1e-6)  # [K]
        scores = top * mask_score  # [K]
        names = [self.names[i] if i < len(self.names) else None for i in labels.tolist()]
        keep = [k for k, (name, score) in enumerate(zip(names, scores.tolist()))
                if name is not None and score > self.min_score]
        return Detections(_mask_boxes(binary[keep]).cpu(), scores[keep].cpu(), [names[k] for k in keep],
                          binary[keep])


def _mask_boxes(binary: torch.Tensor) -> torch.Tensor:
    """``[K, H, W]`` bool -> ``[K, 4]`` float (x1, y1, x2 + 1, y2 + 1), zeros for an empty mask (mmdet's mask2bbox)."""
    from torchvision.ops import masks_to_boxes

    boxes = torch.zeros(len(binary), 4, device=binary.device)
    filled = binary.flatten(1).any(1)
    if bool(filled.any()):
        boxes[filled] = masks_to_boxes(binary[filled]).float() + torch.tensor([0.0, 0.0, 1.0, 1.0],
                                                                              device=binary.device)
    return boxes


def _load_detector(path: str, size: dict) -> torch.nn.Module:
    if importlib.util.find_spec("scipy") is None:  # transformers' Mask2Former builds its matcher with scipy
        raise ModuleNotFoundError("geneval: scipy is not installed: pip install 'flowrl[rewards]'", name="scipy")
    from transformers import Mask2FormerForUniversalSegmentation

    local = os.path.expanduser(path)
    try:
        return Mask2FormerForUniversalSegmentation.from_pretrained(local)
    except Exception as err:  # offline, no such folder, not a Mask2Former
        raise FileNotFoundError(
            f"geneval: cannot load the detector {path!r} ({type(err).__name__}: {_one_line(err)}); download "
            f"{DETECTOR_ID} (huggingface-cli download {DETECTOR_ID} --local-dir DIR) and set "
            "kwargs.detector=DIR") from None


def clip_weights(pretrained: str) -> str:
    """open_clip's tag ("openai") -> the weights file, downloaded or from the cache; a path stays a path.

    One line naming the hub repository and the kwarg when the file cannot be had (offline, say)."""
    import open_clip

    cfg = open_clip.get_pretrained_cfg(CLIP_ARCH, pretrained)
    if not cfg:
        if not os.path.isfile(os.path.expanduser(pretrained)):
            raise FileNotFoundError(f"geneval: clip_pretrained={pretrained!r} is neither an open_clip tag of "
                                    f"{CLIP_ARCH} nor a file; {CLIP_DOWNLOAD}")
        return os.path.expanduser(pretrained)
    try:
        return open_clip.pretrained.download_pretrained(cfg)
    except Exception as err:  # offline, no network, no such repo
        raise FileNotFoundError(f"geneval: cannot fetch the colour CLIP (open_clip {CLIP_ARCH} {pretrained!r}) "
                                f"({type(err).__name__}: {_one_line(err)}); {CLIP_DOWNLOAD}") from None


class ColorClassifier:
    """CLIP zero-shot colour of detected objects, every crop of a call in one batch."""

    def __init__(self, pretrained: str = CLIP_PRETRAINED, *, device: torch.device, dtype: torch.dtype,
                 model: torch.nn.Module | None = None, tokenizer: Any = None, batch_size: int = 256) -> None:
        if model is None:
            pretrained = clip_weights(pretrained)  # fetched (or found) before ViT-L-14 is built: fails fast
        self.backbone: ClipBackbone = load_open_clip(CLIP_ARCH, pretrained, device=device, dtype=dtype,
                                                     quick_gelu=True, model=model, tokenizer=tokenizer,
                                                     kwarg="clip_pretrained")
        self.batch_size = int(batch_size)
        self._text: dict[str, torch.Tensor] = {}  # class name -> [10, D] colour directions

    @torch.no_grad()
    def _directions(self, classes: Sequence[str]) -> None:
        """Embed the colour prompts of every class not seen yet, in one text batch."""
        new = [c for c in dict.fromkeys(classes) if c not in self._text]
        if not new:
            return
        texts = [t.format(color=color, cls=c) for c in new for color in COLORS for t in COLOR_TEMPLATES]
        tokens = self.backbone.tokenizer(texts).to(self.backbone.device)  # [U*10*3, 77]
        emb = F.normalize(self.backbone.model.encode_text(tokens).float(), dim=-1)  # [U*10*3, D]
        emb = F.normalize(emb.view(len(new), len(COLORS), len(COLOR_TEMPLATES), -1).mean(2), dim=-1)  # [U, 10, D]
        self._text.update({c: emb[i] for i, c in enumerate(new)})

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, queries: Sequence[tuple[int, torch.Tensor, torch.Tensor, str]]
                 ) -> list[str]:
        """Colour of each ``(image index, box [4], mask [H, W] bool, class)`` of ``images [N, 3, H, W]``."""
        if not queries:
            return []
        self._directions([q[3] for q in queries])
        spec, device = self.backbone.spec, self.backbone.device
        crops = []
        for index, box, mask, _ in queries:
            image = images[index].to(device)  # [3, H, W]
            image = torch.where(mask.to(device), image, torch.full_like(image, GREY))
            x1, y1, x2, y2 = (int(round(float(v))) for v in box)  # PIL's crop rounds the box
            x2, y2 = max(x2, x1 + 1), max(y2, y1 + 1)  # an empty mask's zero box: one pixel, not a crash
            crops.append(preprocess(image[None, :, y1:y2, x1:x2], spec, self.backbone.dtype))  # [1, 3, 224, 224]
        pixels = torch.cat(crops)  # [M, 3, 224, 224]
        feats = torch.cat([self.backbone.model.encode_image(p).float() for p in pixels.split(self.batch_size)])
        feats = F.normalize(feats, dim=-1)  # [M, D]
        text = torch.stack([self._text[q[3]] for q in queries])  # [M, 10, D]
        best = torch.einsum("md,mkd->mk", feats, text).argmax(1)  # [M]
        return [COLORS[i] for i in best.tolist()]
