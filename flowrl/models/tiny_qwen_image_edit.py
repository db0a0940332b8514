"""Tiny, randomly initialised Qwen-Image-Edit and Qwen-Image-Edit-Plus pipelines for offline tests.

Both editing pipelines run Qwen-Image's components (the MMDiT, the 3-D causal VAE, the Qwen2.5-VL text encoder
and its tokenizer, the dynamically shifted scheduler) plus a ``Qwen2VLProcessor``: the text encoder sees the
source image through the processor's vision patches. So the tiny pipelines take the components of
:func:`flowrl.models.tiny_qwen_image.tiny_qwen_image_pipeline` (weights a pure function of ``seed``; the text
encoder already has a one-block vision tower) and add a processor built offline around the tiny Qwen
tokenizer. Its image processor keeps every source at 2x2 merged patches (4 vision tokens): the pipelines
resize sources to about 1024 x 1024 px for the VAE, and the tiny vision tower needs no more than a few tokens.
The VAE downsamples five times (x32, not the released x8), so a 1024 px source is 16 x 16 packed tokens, not
64 x 64: the tests' attention over source tokens stays small (sizes are then multiples of 64; the tiny default
is 64 px).
"""

from __future__ import annotations

from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageEditPlusPipeline
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from flowrl.models.tiny_qwen import tiny_qwen_tokenizer
from flowrl.models.tiny import _seeded
from flowrl.models.tiny_qwen_image import LATENT_CHANNELS, tiny_qwen_image_pipeline

VISION_PATCH = 14  # the tiny vision tower's patch_size (Qwen2.5-VL's)
VISION_MERGE = 2  # 2x2 patches merged into one text-side token, as released
TINY_VISION_PIXELS = (VISION_PATCH * VISION_MERGE) ** 2 * 4  # every source -> 4x4 patches -> 4 vision tokens


def tiny_qwen2_vl_processor() -> Qwen2VLProcessor:
    """A Qwen2-VL processor (image and video processors at Qwen2.5-VL's patching, the tiny Qwen tokenizer)."""
    patching = dict(patch_size=VISION_PATCH, merge_size=VISION_MERGE, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(min_pixels=TINY_VISION_PIXELS, max_pixels=TINY_VISION_PIXELS, **patching)
    video_processor = Qwen2VLVideoProcessor(**patching)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tiny_qwen_tokenizer(),
                            video_processor=video_processor)


def _edit_components(seed: int) -> dict:
    vae = _seeded(seed, 3, lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, False, False],  # vae_scale_factor 2 ** 5 = 32
    ))
    return {**tiny_qwen_image_pipeline(seed).components, "vae": vae, "processor": tiny_qwen2_vl_processor()}


def tiny_qwen_image_edit_pipeline(seed: int = 0) -> QwenImageEditPipeline:
    """Qwen-Image-Edit layout with tiny random weights: the tiny Qwen-Image components and a processor."""
    pipeline = QwenImageEditPipeline(**_edit_components(seed))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def tiny_qwen_image_edit_plus_pipeline(seed: int = 0) -> QwenImageEditPlusPipeline:
    """Qwen-Image-Edit-Plus (2509) layout with tiny random weights: the same components, the Plus pipeline."""
    pipeline = QwenImageEditPlusPipeline(**_edit_components(seed))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
