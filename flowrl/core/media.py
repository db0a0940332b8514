"""Images and videos as pictures: a video becomes a film strip wherever a grid, a report or a PNG file
shows it, a film strip read back from disk becomes a video again, and a folder of image files becomes tensors.

Why a module of its own, at the bottom: the sample command, the eval command, the end-of-run report, the
HTML pages and the fitted reward all draw or read images, and none of them should import another to do so.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
"""The image files flowrl writes and reads (compared lower-case)."""


def stills(images: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` as they are; videos ``[N, T, 3, H, W]`` as film strips ``[N, 3, H, T * W]`` (the
    frames side by side), so that grids, reports and PNG files show every frame of a video."""
    if images.ndim == 5:
        n, t, c, h, w = images.shape
        return images.permute(0, 2, 3, 1, 4).reshape(n, c, h, t * w)
    return images


def clips(strips: torch.Tensor, frames: int) -> torch.Tensor:
    """Inverse of :func:`stills` for videos: film strips ``[N, 3, H, T * W]`` -> clips ``[N, T, 3, H, W]``."""
    n, c, h, width = strips.shape
    return strips.reshape(n, c, h, frames, width // frames).permute(0, 3, 1, 2, 4)


def image_files(folder: str | Path) -> list[Path]:
    """The image files under ``folder`` (its subfolders included), sorted, so a folder always reads in one order."""
    return sorted(f for f in Path(folder).rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)


def read_rgb(path: str | Path) -> torch.Tensor:
    """An image file as ``[3, H, W]`` float32 in [0, 1] (PIL: torchvision's decoders are deprecated); a file
    PIL cannot decode is a one-line ValueError naming it."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB"))  # [H, W, 3] uint8
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{path} cannot be read as an image ({type(error).__name__}); remove or replace it") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255
