"""What every CLIP flowrl runs shares: loading, tensor preprocessing, and batched embedding.

Why one module: CLIPScore, PickScore, HPSv2 and the LAION aesthetic predictor (``rewards/``) are all "embed
the image (and the prompt) with a CLIP, then compare or regress", and GARDO's ``clip`` feature space
(:mod:`flowrl.algorithms.gardo`) embeds the images alike, so it sits with the models, below both. Keeping
one loading path and one preprocessing path means a fix (a dtype, a crop offset, a transformers API change)
lands once.

Preprocessing runs on tensors, on the reward's device: the images arrive as float [N,3,H,W] in
[0,1] (often already on a GPU), so a PIL round trip per image would cost a device->host copy and
a Python loop. The steps match CLIP's own pipeline (shorter side -> bicubic resize with antialias,
center crop, mean/std normalise); the result is clamped to [0,1] after resizing because the
reference pipelines resize 8-bit images, where bicubic overshoot is clipped.

Two model families are wrapped behind one `ClipBackbone`:
  * transformers `CLIPModel` + tokenizer (CLIPScore, PickScore), from a hub id or local folder;
  * open_clip models (HPSv2, the aesthetic predictor's ViT-L/14), from a tag or checkpoint file.
Remote code is never trusted. A local path that does not exist is a one-line FileNotFoundError
naming the path and the kwarg to set; a download that fails (e.g. offline) is one line too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from flowrl.core.devices import resolve_device, resolve_dtype

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's normalisation, used by all four rewards
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
HUB_PREFIX = "hf:"  # "hf:owner/repo/path/in/repo.pth" names a single file on the Hugging Face hub


def _one_line(err: BaseException | str, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------ preprocessing

@dataclass(frozen=True)
class ImageSpec:
    """How a CLIP wants its pixels: shorter side -> `resize`, center crop to `crop` (h, w)."""

    resize: int
    crop: tuple[int, int]
    mean: tuple[float, ...] = OPENAI_MEAN
    std: tuple[float, ...] = OPENAI_STD


def _resized_hw(h: int, w: int, short: int) -> tuple[int, int]:
    """Shorter side -> `short`, aspect kept; the longer side is truncated as torchvision does."""
    if h <= w:
        return short, int(short * w / h)
    return int(short * h / w), short


def preprocess(images: torch.Tensor, spec: ImageSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N,3,H,W] in [0,1] (any device/dtype) -> normalised [N,3,crop_h,crop_w] in `dtype`.

    Interpolation runs in float32 (bicubic antialias has no half-precision CPU kernel, and the
    rounding would be visible); only the final tensor is cast.
    """
    x = images.float()  # [N, 3, H, W]
    h, w = x.shape[-2:]
    new_h, new_w = _resized_hw(h, w, spec.resize)
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp(0.0, 1.0)  # 8-bit reference pipelines clip bicubic overshoot
    ch, cw = spec.crop
    if new_h < ch or new_w < cw:
        raise ValueError(f"resize {spec.resize} is smaller than the crop {spec.crop}")
    top, left = int(round((new_h - ch) / 2.0)), int(round((new_w - cw) / 2.0))
    x = x[..., top:top + ch, left:left + cw]  # [N, 3, ch, cw]
    mean = torch.tensor(spec.mean, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, device=x.device).view(1, -1, 1, 1)
    x = (x - mean) / std
    return x.to(dtype) if dtype is not None else x


def _size_field(size: Any, key: str) -> int | None:
    """Read `key` from a processor size given as dict, SizeDict-like object or int."""
    if size is None:
        return None
    if isinstance(size, int):
        return size
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value is not None else None


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def spec_from_hf_processor(image_processor: Any) -> ImageSpec:
    """ImageSpec of a transformers CLIPImageProcessor (slow or fast)."""
    crop = image_processor.crop_size
    crop_hw = (_size_field(crop, "height"), _size_field(crop, "width"))
    short = _size_field(image_processor.size, "shortest_edge") or max(crop_hw)
    return ImageSpec(short, crop_hw, tuple(image_processor.image_mean), tuple(image_processor.image_std))


def spec_from_hf_model(model: Any) -> ImageSpec:
    """ImageSpec from a CLIPModel's config alone (no processor): CLIP's defaults at its image size."""
    size = int(model.config.vision_config.image_size)
    return ImageSpec(size, (size, size))


def spec_from_open_clip(model: Any) -> ImageSpec:
    """ImageSpec of an open_clip model (its preprocess_cfg; OpenAI defaults when absent)."""
    import open_clip

    cfg = open_clip.get_model_preprocess_cfg(model)
    mode = cfg.get("resize_mode", "shortest")
    if mode != "shortest":
        raise ValueError(f"open_clip resize_mode {mode!r} is not supported (only 'shortest')")
    crop = _pair(cfg.get("size", model.visual.image_size))
    return ImageSpec(max(crop), crop, tuple(cfg.get("mean", OPENAI_MEAN)), tuple(cfg.get("std", OPENAI_STD)))


# -------------------------------------------------------------------------------- backbone

def _features(out: Any, embeds_attr: str) -> torch.Tensor:
    """A get_*_features result -> [N, D]. transformers < 5 returns the tensor; >= 5 returns an
    output object whose `pooler_output` holds the projected embedding."""
    if isinstance(out, torch.Tensor):
        return out
    for attr in (embeds_attr, "pooler_output"):
        value = getattr(out, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find {embeds_attr} in {type(out).__name__}")


class ClipBackbone:
    """One CLIP behind one interface: L2-normalised image and text embeddings, in float32.

    `family` is "hf" (transformers CLIPModel) or "open_clip". The model is moved to `device` and
    cast to `dtype` in place; `logit_scale` is read before the cast (bf16 would round exp() by ~1%).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, spec: ImageSpec, family: str,
                 device: torch.device, dtype: torch.dtype) -> None:
        if family not in ("hf", "open_clip"):
            raise ValueError(f"family must be 'hf' or 'open_clip', got {family!r}")
        scale = getattr(model, "logit_scale", None)
        self.logit_scale = float(scale.detach().float().exp()) if scale is not None else float("nan")
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer, self.spec, self.family = tokenizer, spec, family
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """[N,3,H,W] in [0,1] -> [N, D] float32, unit norm."""
        pixels = preprocess(images.to(self.device), self.spec, self.dtype)  # [N, 3, h, w]
        if self.family == "hf":
            feats = _features(self.model.get_image_features(pixel_values=pixels), "image_embeds")
        else:
            feats = self.model.encode_image(pixels)
        return F.normalize(feats.float(), dim=-1)

    def _tokens(self, texts: list[str]) -> dict[str, torch.Tensor]:
        if self.tokenizer is None:
            raise ValueError("this CLIP has no tokenizer; pass tokenizer= to embed prompts")
        if self.family == "open_clip":
            return {"text": self.tokenizer(texts).to(self.device)}  # [U, context_length]
        # Always pad to CLIP's fixed context (77), as CLIP was trained: a prompt's embedding then
        # cannot depend on which other prompts share its batch.
        max_len = min(getattr(self.tokenizer, "model_max_length", 77),
                      self.model.config.text_config.max_position_embeddings)  # 77 for CLIP
        enc = self.tokenizer(texts, padding="max_length", truncation=True, max_length=max_len,
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"].to(self.device),
                "attention_mask": enc["attention_mask"].to(self.device)}

    @torch.no_grad()
    def embed_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """[N] prompts -> [N, D] float32, unit norm. Each distinct prompt is encoded once: a GRPO
        batch holds G images per prompt, so this saves (G-1)/G of the text tower."""
        slot = {t: i for i, t in enumerate(dict.fromkeys(texts))}  # prompt -> row, first-seen order
        tokens = self._tokens(list(slot))
        if self.family == "hf":
            feats = _features(self.model.get_text_features(**tokens), "text_embeds")
        else:
            feats = self.model.encode_text(tokens["text"])
        feats = F.normalize(feats.float(), dim=-1)  # [U, D]
        index = torch.tensor([slot[t] for t in texts], device=feats.device)
        return feats[index]  # [N, D]

    def cosine(self, images: torch.Tensor, texts: Sequence[str]) -> torch.Tensor:
        """[N] cosine similarity of each image with its own prompt, float32."""
        return (self.embed_images(images) * self.embed_texts(texts)).sum(-1)


# ---------------------------------------------------------------------------------- files

def _looks_local(spec: str) -> bool:
    """A path the user clearly means as local (hub ids are 'owner/name', never these)."""
    expanded = os.path.expanduser(spec)
    return (spec.startswith(("/", "./", "../", "~", "\\")) or os.path.exists(expanded)
            or spec.endswith((".pt", ".pth", ".bin", ".safetensors")))


def resolve_file(spec: str, kwarg: str) -> str:
    """A local file path, or "hf:owner/repo/file" downloaded (or found in the cache) -> local path.

    One-line FileNotFoundError naming `kwarg` when the file is missing or cannot be fetched.
    """
    if spec.startswith(HUB_PREFIX):
        parts = spec[len(HUB_PREFIX):].split("/")
        if len(parts) < 3 or not all(parts):
            raise ValueError(f"{kwarg}={spec!r}: expected {HUB_PREFIX}owner/repo/path/to/file")
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]))
        except Exception as err:  # offline, missing repo/file, auth...
            raise FileNotFoundError(f"could not fetch {spec} from the Hugging Face hub "
                                    f"({type(err).__name__}: {_one_line(err, 160)}); download it and "
                                    f"set {kwarg}=<local path>") from None
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kwarg}: no such file {path!r}; set {kwarg}= to an existing file "
                                f"or to {HUB_PREFIX}owner/repo/file")
    return path


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """.safetensors or a torch pickle read with weights_only=True (never arbitrary code)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"cannot read {path!r} with torch.load(weights_only=True) "
                             f"({type(err).__name__}: {_one_line(err, 160)}); "
                             "convert it to .safetensors") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} holds a {type(state).__name__}, expected a state dict")
    return {k.removeprefix("module."): v for k, v in state.items()}


# -------------------------------------------------------------------------------- loaders

def load_hf_clip(model_id: str, processor_id: str | None = None, *, device: Any = "auto",
                 dtype: Any = None, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 model_kwarg: str = "model_id", processor_kwarg: str = "processor_id") -> ClipBackbone:
    """transformers CLIPModel + tokenizer/image processor from a hub id or local folder.

    `processor_id` defaults to `model_id` (PickScore keeps its processor in the CLIP-H repo).
    An injected `model` (tests, callers that already hold one) skips loading; its ImageSpec then
    comes from its config (CLIP defaults), and `tokenizer` must be given to embed text.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if model is not None:
        return ClipBackbone(model, tokenizer, spec_from_hf_model(model), "hf", device, dtype)
    from transformers import CLIPModel, CLIPProcessor

    def _load(loader: Callable[[str], Any], ident: str, kwarg: str) -> Any:
        if _looks_local(ident) and not os.path.isdir(os.path.expanduser(ident)):
            raise FileNotFoundError(f"{kwarg}: no such folder {ident!r}; set {kwarg}= to a local "
                                    "CLIP folder or a hub id")
        try:
            return loader(os.path.expanduser(ident))  # trust_remote_code stays False
        except Exception as err:  # offline, a missing repo, files of another format
            raise FileNotFoundError(f"cannot load {kwarg}={ident!r} ({type(err).__name__}: {_one_line(err, 200)}); "
                                    f"download it (huggingface-cli download {ident} --local-dir DIR) and set "
                                    f"{kwarg}=DIR") from None

    processor = _load(CLIPProcessor.from_pretrained, processor_id or model_id,
                      processor_kwarg if processor_id else model_kwarg)
    loaded = _load(CLIPModel.from_pretrained, model_id, model_kwarg)
    spec = spec_from_hf_processor(processor.image_processor)
    return ClipBackbone(loaded, tokenizer or processor.tokenizer, spec, "hf", device, dtype)


def load_open_clip(arch: str, pretrained: str | None, *, device: Any = "auto", dtype: Any = None,
                   quick_gelu: bool | None = None, model: torch.nn.Module | None = None,
                   tokenizer: Any = None, kwarg: str = "pretrained") -> ClipBackbone:
    """open_clip `arch` with weights from a known tag (e.g. "openai") or a checkpoint file.

    Checkpoint files are read by open_clip with torch.load(weights_only=True) or safetensors;
    "hf:owner/repo/file" is fetched first. quick_gelu=None takes the tag's setting (OpenAI
    weights need QuickGELU; open_clip's plain "ViT-L-14" config would otherwise use GELU).
    """
    import open_clip

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if model is None:
        tag_cfg = open_clip.get_pretrained_cfg(arch, pretrained) if pretrained else {}
        if pretrained and not tag_cfg:
            pretrained = resolve_file(pretrained, kwarg)
        if quick_gelu is None:
            quick_gelu = bool(tag_cfg.get("quick_gelu", False))
        try:
            model = open_clip.create_model(arch, pretrained=pretrained, device="cpu",
                                           force_quick_gelu=quick_gelu, weights_only=True)
        except Exception as err:
            raise RuntimeError(f"open_clip could not build {arch!r} with {kwarg}={pretrained!r} "
                               f"({type(err).__name__}: {_one_line(err, 200)})") from None
        tokenizer = tokenizer or open_clip.get_tokenizer(arch)
    elif tokenizer is None:
        tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=getattr(model, "context_length", 77))
    return ClipBackbone(model, tokenizer, spec_from_open_clip(model), "open_clip", device, dtype)


# --------------------------------------------------------------- tiny models (tests, benchmarks)

def _seeded(seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def tiny_hf_clip(seed: int = 0, image_size: int = 32, patch: int = 8, width: int = 32, layers: int = 2,
                 heads: int = 2, projection_dim: int = 16) -> tuple[torch.nn.Module, Any]:
    """A random transformers CLIPModel of CLIP's architecture, shrunk, and the real CLIP tokenizer.

    The text vocabulary is CLIP's (49408 ids), so tokenisation is exactly that of the released
    models; the scores are noise.
    """
    from transformers import CLIPConfig, CLIPModel

    from flowrl.models.tiny import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                 num_attention_heads=heads, hidden_act="quick_gelu")
    config = CLIPConfig(
        text_config=dict(tower, vocab_size=len(tokenizer), max_position_embeddings=77,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(tower, image_size=image_size, patch_size=patch),
        projection_dim=projection_dim,
    )
    return _seeded(seed, lambda: CLIPModel(config)), tokenizer


def tiny_open_clip(seed: int = 0, embed_dim: int = 16, image_size: int = 32, patch: int = 8,
                   width: int = 32, layers: int = 2, heads: int = 2,
                   quick_gelu: bool = False) -> tuple[torch.nn.Module, Any]:
    """A random open_clip CLIP (same classes as ViT-H-14 / ViT-L-14, shrunk) and its BPE tokenizer."""
    import open_clip

    vision = dict(layers=layers, width=width, head_width=width // heads, patch_size=patch, image_size=image_size)
    text = dict(context_length=77, vocab_size=49408, width=width, heads=heads, layers=layers)
    model = _seeded(seed, lambda: open_clip.model.CLIP(embed_dim, vision, text, quick_gelu=quick_gelu))
    return model, open_clip.tokenizer.SimpleTokenizer(context_length=77)
