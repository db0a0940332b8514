"""The model families by name: config name -> adapter class, and diffusers pipeline class -> config name.

A module of its own, not the package ``__init__``, because modules inside ``flowrl.models`` need these tables
(the LoRA writer names an export's family, the preference embedding finds a family's sites): taking them from the
package ``__init__`` would make an import cycle through it. It imports nothing of flowrl at load time, so any module
of the package can use it; ``flowrl.models`` re-exports every name.
"""

from __future__ import annotations

import importlib

FAMILY_CLASSES = {
    "sd3": "flowrl.models.sd3:SD3Policy",  # SD3 / SD3.5
    "flux": "flowrl.models.flux:FluxPolicy",  # FLUX.1 [dev] / [schnell]
    "flux_kontext": "flowrl.models.flux_kontext:FluxKontextPolicy",  # FLUX.1 Kontext [dev] (editing)
    "flux2_klein": "flowrl.models.flux2:Flux2KleinPolicy",  # FLUX.2 [klein]
    "flux2_dev": "flowrl.models.flux2_dev:Flux2DevPolicy",  # FLUX.2 [dev]
    "qwen_image": "flowrl.models.qwen_image:QwenImagePolicy",  # Qwen-Image
    "qwen_image_edit": "flowrl.models.qwen_image_edit:QwenImageEditPolicy",  # Qwen-Image-Edit (editing)
    "qwen_image_edit_plus": "flowrl.models.qwen_image_edit_plus:QwenImageEditPlusPolicy",  # Qwen-Image-Edit-2509
    "z_image": "flowrl.models.z_image:ZImagePolicy",  # Z-Image (Turbo)
    "wan": "flowrl.models.wan:WanPolicy",  # Wan2.1 text-to-video
    "wan22_ti2v": "flowrl.models.wan22_ti2v:Wan22TI2VPolicy",  # Wan2.2 TI2V-5B, text-to-video
    "wan22_t2v": "flowrl.models.wan22_t2v:Wan22T2VPolicy",  # Wan2.2 T2V A14B, two experts
    "wan_i2v": "flowrl.models.wan_i2v:WanI2VPolicy",  # Wan2.1 I2V-14B, image-to-video
    "wan22_i2v": "flowrl.models.wan22_i2v:Wan22I2VPolicy",  # Wan2.2 I2V A14B, image-to-video, two experts
    "ltx2": "flowrl.models.ltx2:LTX2Policy",  # LTX-2 text-to-video (audio denoised alongside, untrained)
    "hunyuan_video15": "flowrl.models.hunyuan_video15:HunyuanVideo15Policy",  # HunyuanVideo-1.5 text-to-video
    "hunyuan_video15_i2v": "flowrl.models.hunyuan_video15_i2v:HunyuanVideo15I2VPolicy",  # HunyuanVideo-1.5 I2V
}
FAMILIES = tuple(FAMILY_CLASSES)


def policy_class(family: str) -> type:
    """The adapter class of ``family``, a :class:`~flowrl.models.base.PolicyBase` subclass (one-line error for an
    unknown name). Imported on use, so a family's diffusers classes load only when it is picked."""
    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    module, name = FAMILY_CLASSES[family].split(":")
    return getattr(importlib.import_module(module), name)


PIPELINE_FAMILIES = {
    "StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "FluxKontextPipeline": "flux_kontext",
    "Flux2KleinPipeline": "flux2_klein", "Flux2Pipeline": "flux2_dev", "QwenImagePipeline": "qwen_image",
    "QwenImageEditPipeline": "qwen_image_edit", "QwenImageEditPlusPipeline": "qwen_image_edit_plus",
    "ZImagePipeline": "z_image", "WanPipeline": "wan",  # Wan2.2 too: wan22_ti2v by expand_timesteps, wan22_t2v by boundary_ratio
    "WanImageToVideoPipeline": "wan_i2v",  # Wan2.2 I2V A14B too: wan22_i2v by boundary_ratio
    "LTX2Pipeline": "ltx2",
    "HunyuanVideo15Pipeline": "hunyuan_video15", "HunyuanVideo15ImageToVideoPipeline": "hunyuan_video15_i2v",
}
