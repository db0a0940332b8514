"""Tiny, randomly initialised FLUX.1 Kontext [dev] pipeline, and the example source images of editing runs.

FLUX.1 Kontext [dev] has exactly FLUX.1 [dev]'s components (CLIP-L + T5, the guidance-distilled
FluxTransformer2DModel, the 16-channel VAE, the dynamically shifted flow-matching scheduler); only the
pipeline differs: it VAE-encodes a source image and appends its tokens to the noisy ones. So the tiny
pipeline takes the tiny FLUX.1 components of :func:`flowrl.models.tiny.tiny_flux_pipeline` (weights a pure
function of ``seed``) and wraps them in a :class:`~diffusers.FluxKontextPipeline`.

The example sources are simple coloured shapes drawn with PIL, deterministic, so that tests, benchmarks
and the smoke run have source images without any download; ``scripts/make_edit_assets.py`` writes them to
``assets/edit/`` together with the smoke prompts file.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FluxKontextPipeline

from flowrl.models.tiny import TINY_FLUX_RESOLUTION, tiny_flux_pipeline

# (file stem, background, fill, shape, edit prompt) of the example sources, drawn at 64 x 64.
EXAMPLE_SOURCES = (
    ("red_circle", (255, 255, 255), (220, 30, 30), "circle", "make the red circle blue"),
    ("blue_square", (128, 128, 128), (30, 60, 220), "square", "turn the blue square into a yellow one"),
    ("green_triangle", (10, 10, 10), (40, 200, 60), "triangle", "make the background of the triangle white"),
    ("yellow_stripes", (40, 40, 120), (240, 220, 40), "stripes", "make the stripes red"),
)
EXAMPLE_SIZE = TINY_FLUX_RESOLUTION  # 64 px: the tiny pipeline's size
ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "edit"  # the committed copies (a source checkout)


def tiny_flux_kontext_pipeline(seed: int = 0) -> FluxKontextPipeline:
    """FLUX.1 Kontext [dev] layout with tiny random weights: the tiny FLUX.1 components, Kontext's pipeline.

    Always pass height/width (the pipeline's default is 1024 px) and ``_auto_resize=False`` with
    ``max_area=height * width``, else it resizes the source and the output to its preferred resolutions."""
    components = tiny_flux_pipeline(seed).components  # image_encoder / feature_extractor: None, as released
    return FluxKontextPipeline(**components)


def draw_example_source(index: int, size: int = EXAMPLE_SIZE):
    """Example source image ``index`` (cycling over :data:`EXAMPLE_SOURCES`): an RGB PIL image of one shape."""
    from PIL import Image, ImageDraw

    _, background, fill, shape, _ = EXAMPLE_SOURCES[index % len(EXAMPLE_SOURCES)]
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    lo, hi = size // 4, 3 * size // 4
    if shape == "circle":
        draw.ellipse((lo, lo, hi, hi), fill=fill)
    elif shape == "square":
        draw.rectangle((lo, lo, hi, hi), fill=fill)
    elif shape == "triangle":
        draw.polygon(((size // 2, lo), (hi, hi), (lo, hi)), fill=fill)
    else:  # horizontal stripes, one band in four
        for top in range(0, size, size // 4):
            draw.rectangle((0, top, size - 1, top + size // 8 - 1), fill=fill)
    return image


def example_source_paths(num: int, directory: str | Path | None = None) -> list[str]:
    """Paths of ``num`` example sources (cycling): the committed ``assets/edit`` files where they exist, else
    copies drawn once into ``directory`` (default: a folder in the system's temporary directory)."""
    import os
    import tempfile

    stems = [EXAMPLE_SOURCES[i % len(EXAMPLE_SOURCES)][0] for i in range(num)]
    if directory is None and all((ASSET_DIR / f"{s}.png").is_file() for s in stems):
        return [str(ASSET_DIR / f"{s}.png") for s in stems]
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir()) / "flowrl_edit_examples"
    folder.mkdir(parents=True, exist_ok=True)
    for i, stem in enumerate(stems[:len(EXAMPLE_SOURCES)]):
        if not (folder / f"{stem}.png").is_file():  # written aside then renamed: parallel test runs never see half
            partial = folder / f"{stem}.{os.getpid()}.partial.png"
            draw_example_source(i).save(partial)
            os.replace(partial, folder / f"{stem}.png")
    return [str(folder / f"{s}.png") for s in stems]

