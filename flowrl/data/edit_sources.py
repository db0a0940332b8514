"""Source images of editing prompts: where they come from, how they are resized, what edit rewards see.

An editing prompt names its source in ``metadata["source_image"]`` (a path; ``flowrl.data.load_prompts``
makes a relative one relative to the prompt file). The editing policy (``flowrl.models.flux_kontext``) encodes
it, and an image-to-video policy (``flowrl.models.wan_i2v``) starts its clip from it; the scorer
(``flowrl.rewards_api``) hands edit rewards its pixels, ``metadata["source_pixels"]``, at the output size. Both
resize it the same way, here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import torch

SOURCE_KEY = "source_image"  # metadata key of a prompt's source image path
PIXELS_KEY = "source_pixels"  # metadata key the scorer adds for rewards: [3, H, W] float in [0, 1]


def load_source_image(path: str | Path):
    """The RGB PIL image at ``path``; a missing or unreadable file is a one-line error naming it."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"source image not found: {path} (metadata '{SOURCE_KEY}'; a relative path is "
                                "relative to the prompt file)")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"source image {path} cannot be read as an image: {error}") from None


def resize_source(image, height: int, width: int, image_processor=None):
    """``image`` at ``height`` x ``width`` as FluxKontextPipeline resizes it (its VaeImageProcessor: Lanczos)."""
    if image_processor is None:
        from diffusers.image_processor import VaeImageProcessor

        image_processor = VaeImageProcessor(vae_scale_factor=16)
    return image_processor.resize(image, height, width)


@functools.lru_cache(maxsize=256)
def source_pixels(path: str, height: int, width: int) -> torch.Tensor:
    """The source at ``path`` as an edit reward sees it: ``[3, H, W]`` float32 in [0, 1] on the CPU, resized
    as the policy resizes it. Cached per (path, size): callers must not modify the tensor in place."""
    import numpy as np

    image = resize_source(load_source_image(path), height, width)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def source_paths(metadata: Sequence[dict] | None, num_prompts: int) -> list[str] | None:
    """The source image path of every prompt, or None when no prompt has one (plain text-to-image, as the
    pipeline without ``image``). A batch mixing both cannot be one sequence length: a one-line error."""
    if metadata is None or len(metadata) == 0:
        return None
    if len(metadata) != num_prompts:
        raise ValueError(f"got {len(metadata)} metadata for {num_prompts} prompts")
    paths = [(m or {}).get(SOURCE_KEY) for m in metadata]
    if all(p is None for p in paths):
        return None
    missing = [i for i, p in enumerate(paths) if not isinstance(p, (str, Path))]
    if missing:
        raise ValueError(f"flux_kontext: prompt {missing[0]} of the batch has no metadata '{SOURCE_KEY}' (a path) "
                         "while others do; give every prompt of the file a source image")
    return [str(p) for p in paths]


def first_source(source: str | Path | Sequence[str | Path]) -> str:
    """The source a reward compares the output with: the path itself, or the first of several (Picture 1 of a
    multi-image edit, the image the instruction edits)."""
    return str(source if isinstance(source, (str, Path)) else source[0])


def source_path_lists(metadata: Sequence[dict] | None, num_prompts: int, family: str, *, several: bool,
                      needs: str = "an editing family needs the source image of every prompt"
                      ) -> list[tuple[str, ...]]:
    """Every prompt's source paths, for a family that cannot run without one: ``metadata["source_image"]`` as one
    path, or (``several``) a list of paths. A prompt without one is a one-line error naming it, ending with
    ``needs`` (why the family needs it)."""
    if metadata is not None and len(metadata) != num_prompts:
        raise ValueError(f"got {len(metadata)} metadata for {num_prompts} prompts")
    rows = list(metadata) if metadata is not None else [None] * num_prompts
    paths = []
    for i, meta in enumerate(rows):
        source = (meta or {}).get(SOURCE_KEY)
        if isinstance(source, (str, Path)) and str(source):
            paths.append((str(source),))
        elif several and isinstance(source, (list, tuple)) and source and all(
                isinstance(s, (str, Path)) and str(s) for s in source):
            paths.append(tuple(str(s) for s in source))
        else:
            form = "a path or a list of paths" if several else "a path"
            raise ValueError(f"{family}: prompt {i} of the batch has no metadata '{SOURCE_KEY}' ({form}); {needs}")
    return paths
