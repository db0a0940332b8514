"""Images and videos as pictures: a video becomes a film strip wherever a grid, a report or a PNG file
shows it, and a film strip read back from disk becomes a video again.

Why a module of its own, at the bottom: the sample command, the eval command, the end-of-run report and
the HTML pages all draw rendered batches, and none of them should import another to do so.
"""

from __future__ import annotations

import torch


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
