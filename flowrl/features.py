"""Pluggable frozen image feature networks: FID/KID and the diversity metrics of :mod:`flowrl.eval.metrics`,
and the features under the fitted reward's head (``rewards/fitted.py``); a leaf, so reward plugins may import it.

Every network is an ``nn.Module`` that stays in eval mode with gradients off, has an int ``num_features``,
and maps images ``[N, 3, H, W]`` float in [0, 1] (any size: each resizes itself) to ``[N, num_features]``
float32. Pick one by name with :func:`build_feature_network`:

- ``toy``: a small fixed random conv net, for the toy world and tests; no files needed (``pool="stats"`` adds
  each layer's texture statistics);
- ``pixels``: downsampled raw pixels, the crudest baseline;
- ``clip``: an open_clip image tower, unit-norm embeddings (semantic diversity, CLIP-FID);
- ``dino``: a transformers DINOv2 (or any ViT with a CLS token), the CLS embedding (FD-DINOv2);
- ``inception``: the standard FID InceptionV3 pool features, needs torch-fidelity (``pip install 'flowrl[fid]'``).

Nothing is downloaded: weights come from local files (the hub is out of reach on the training machines).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class FeatureNetwork(nn.Module):
    """Base of the feature networks: frozen, and never leaves eval mode (a parent's ``.train()`` included),
    so dropout can never make two evaluations of one image differ."""

    num_features: int

    def train(self, mode: bool = True) -> FeatureNetwork:
        return super().train(False)

    def _freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()


def _resize(images: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """Resize the shorter side to fit ``size`` (antialiased), then centre-crop to it, as CLIP-style
    preprocessing does; images already of that size are returned as they are."""
    h, w = images.shape[-2:]
    if (h, w) == tuple(size):
        return images
    scale = max(size[0] / h, size[1] / w)
    resized = (max(size[0], round(h * scale)), max(size[1], round(w * scale)))
    images = F.interpolate(images, size=resized, mode=mode, antialias=True, align_corners=False)
    top, left = (resized[0] - size[0]) // 2, (resized[1] - size[1]) // 2
    return images[..., top:top + size[0], left:left + size[1]].clamp(0.0, 1.0)  # bicubic overshoots [0, 1]


def _normalise(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


class ToyFeatures(FeatureNetwork):
    """A fixed 3-layer random conv net (stride-2 3x3 convs, ReLU, global average pooling).

    Random convolutional features are a known reasonable stand-in for Inception features on small images:
    FID on them still ranks distribution shifts sensibly, at no download. The He-scaled weights are drawn
    from ``torch.Generator().manual_seed(seed)``, never the global RNG, so every machine builds the same
    network (outputs then agree up to the floating-point rounding of its conv kernels).

    ``pool="mean"`` (the default): the last layer's channel means, ``num_features`` of them. ``pool="stats"``:
    every layer's channel mean and standard deviation over the image, ``2 * (width // 2 + width +
    num_features)`` features. Means mostly carry colour and layout; the spatial spread of the responses is
    texture (the statistics random-weight texture models use), which is where noise and blur show: the fitted
    artifact reward separates clean toy renders from corrupted ones far better on them."""

    def __init__(self, num_features: int = 64, seed: int = 0, width: int = 32, pool: str = "mean"):
        super().__init__()
        if pool not in ("mean", "stats"):
            raise ValueError(f"toy features: pool must be 'mean' or 'stats', got {pool!r}")
        generator = torch.Generator().manual_seed(seed)
        channels = (3, width // 2, width, num_features)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(c_out, c_in, 3, 3, generator=generator) * (2.0 / (9 * c_in)) ** 0.5)
            for c_in, c_out in zip(channels[:-1], channels[1:]))
        self.pool = pool
        self.num_features = num_features if pool == "mean" else 2 * sum(channels[1:])
        self._freeze()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float() * 2.0 - 1.0  # [N, 3, H, W], centred so the first layer sees signed input
        stats = []
        for i, weight in enumerate(self.weights):
            x = F.conv2d(x, weight, stride=2, padding=1)  # [N, C_i, H / 2^(i+1), W / 2^(i+1)]
            if i < len(self.weights) - 1:
                x = F.relu(x)
            if self.pool == "stats":
                stats += [x.mean(dim=(2, 3)), x.std(dim=(2, 3), unbiased=False)]  # [N, C_i] each
        return x.mean(dim=(2, 3)) if self.pool == "mean" else torch.cat(stats, dim=1)  # [N, num_features]


class PixelFeatures(FeatureNetwork):
    """Images resized (antialiased bilinear) to ``size x size`` and flattened: ``num_features = 3 * size²``.
    Measures colour and layout only; useful as a model-free baseline and for exact tests."""

    def __init__(self, size: int = 16):
        super().__init__()
        self.size = size
        self.num_features = 3 * size * size
        self._freeze()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        if x.shape[-2:] != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return x.flatten(1)  # [N, 3 * size * size]


def _load_open_clip(arch: str, pretrained: str | None, quick_gelu: bool | None) -> nn.Module:
    """open_clip ``arch`` from a local checkpoint file or a tag; ``pretrained=None`` leaves it random."""
    import open_clip

    weights = None
    if pretrained is not None:
        path = os.path.expanduser(pretrained)
        tag = open_clip.get_pretrained_cfg(arch, pretrained)
        if os.path.isfile(path):
            weights = path
        elif tag:
            weights = pretrained
            quick_gelu = bool(tag.get("quick_gelu", False)) if quick_gelu is None else quick_gelu
        else:
            raise FileNotFoundError(f"clip: pretrained={pretrained!r} is neither a local checkpoint file nor an "
                                    f"open_clip tag of {arch!r}")
    try:
        return open_clip.create_model(arch, pretrained=weights, force_quick_gelu=bool(quick_gelu), weights_only=True)
    except Exception as err:
        message = " ".join(str(err).split())[:200]
        raise RuntimeError(f"clip: open_clip could not build {arch!r} with pretrained={pretrained!r} "
                           f"({type(err).__name__}: {message}); tags download from the hub, so offline pass a "
                           "local checkpoint file") from None


class ClipFeatures(FeatureNetwork):
    """An open_clip model's image embeddings, L2-normalised: ``num_features`` is the model's embed_dim.

    ``pretrained``: a local checkpoint file or an open_clip tag (tags download, which fails offline);
    ``None`` gives random weights, only for tests. ``quick_gelu=None`` takes the tag's setting (OpenAI
    weights need QuickGELU) and means False for a file. Images are resized (shorter side, bicubic) and
    centre-cropped to the model's image size and normalised with its mean/std, in torch. The whole CLIP
    model is kept as ``.model``, so its text tower serves zero-shot probes."""

    def __init__(self, model: str = "ViT-B-32", pretrained: str | None = None, device: str | torch.device = "cpu",
                 quick_gelu: bool | None = None):
        super().__init__()
        import open_clip

        self.model = _load_open_clip(model, pretrained, quick_gelu).to(device)
        cfg = open_clip.get_model_preprocess_cfg(self.model)
        size = cfg.get("size", self.model.visual.image_size)
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean, self.std = tuple(cfg["mean"]), tuple(cfg["std"])
        self.num_features = int(open_clip.get_model_config(model)["embed_dim"])
        self._freeze()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = _normalise(_resize(images.float(), self.image_size, "bicubic"), self.mean, self.std)
        return F.normalize(self.model.encode_image(x).float(), dim=-1)  # [N, num_features]


class DinoFeatures(FeatureNetwork):
    """The CLS token of a transformers vision model's last hidden state (DINOv2 for FD-DINOv2 and identity).

    ``path``: a local folder (or an already cached hub id) read with ``local_files_only=True`` and without
    remote code. Images are resized (shorter side, bicubic) and centre-cropped to ``size`` and
    ImageNet-normalised."""

    def __init__(self, path: str, size: int = 224, device: str | torch.device = "cpu"):
        super().__init__()
        from transformers import AutoModel

        try:
            self.model = AutoModel.from_pretrained(os.path.expanduser(path), local_files_only=True)
        except OSError as err:
            message = " ".join(str(err).split())[:200]
            raise FileNotFoundError(f"dino: cannot load path={path!r} offline ({message}); pass a local folder "
                                    "written by save_pretrained") from None
        self.model = self.model.float().to(device)
        self.size = size
        self.num_features = int(self.model.config.hidden_size)
        self._freeze()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = _normalise(_resize(images.float(), (self.size, self.size), "bicubic"), IMAGENET_MEAN, IMAGENET_STD)
        return self.model(pixel_values=x).last_hidden_state[:, 0].float()  # [N, hidden_size]


class InceptionFeatures(FeatureNetwork):
    """The standard FID InceptionV3's 2048 pool features (torchmetrics' ``NoTrainInceptionV3``).

    ``weights_path``: the local FID Inception weights (pt_inception-2015-12-05-6726825d.pth); needs the
    optional package torch-fidelity. Images are quantised to uint8 with rounding, as saving them to PNG
    would, since the network was defined on 8-bit images."""

    num_features = 2048

    def __init__(self, weights_path: str | None = None, device: str | torch.device = "cpu"):
        super().__init__()
        try:
            import torch_fidelity  # noqa: F401
        except ImportError:
            raise ImportError("the inception feature network needs torch-fidelity: pip install 'flowrl[fid]'") from None
        if weights_path is None or not os.path.isfile(os.path.expanduser(weights_path)):
            raise FileNotFoundError(f"inception: weights_path={weights_path!r} is not a file; pass the local FID "
                                    "Inception weights (pt_inception-2015-12-05-6726825d.pth)")
        from torchmetrics.image.fid import NoTrainInceptionV3

        self.model = NoTrainInceptionV3(name="inception-v3-compat", features_list=[str(self.num_features)],
                                        feature_extractor_weights_path=os.path.expanduser(weights_path)).to(device)
        self._freeze()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)  # [N, 3, H, W]
        return self.model(x).float()  # [N, 2048]


FEATURE_NETWORKS: dict[str, Callable[..., nn.Module]] = {
    "toy": ToyFeatures,
    "pixels": PixelFeatures,
    "clip": ClipFeatures,
    "dino": DinoFeatures,
    "inception": InceptionFeatures,
}


def build_feature_network(name: str, **kwargs) -> nn.Module:
    """The feature network registered as ``name``, built with ``kwargs`` (see each class for its own)."""
    if name not in FEATURE_NETWORKS:
        raise ValueError(f"unknown feature network {name!r}; choose one of {sorted(FEATURE_NETWORKS)}")
    return FEATURE_NETWORKS[name](**kwargs)
