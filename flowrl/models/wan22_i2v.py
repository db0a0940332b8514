"""Wan2.2 I2V A14B policy adapter: a ``WanImageToVideoPipeline`` of two experts switched at ``boundary_ratio``.

Two existing halves, joined: the first frame is image-to-video's (:class:`~flowrl.models.wan_i2v.ImageToVideo`: the
condition from each prompt's ``metadata["source_image"]``, concatenated to the noisy latents on the channel axis),
and the experts are Wan2.2 T2V A14B's (:class:`~flowrl.models.wan22_t2v.Wan22T2VPolicy`: ``transformer`` at
``t >= boundary_ratio * 1000``, ``transformer_2`` below, guided at ``model.guidance_scale_2``, both in one
``WanExperts`` module, the LoRA on the experts ``lora.experts`` names, a LoRA file per expert on export). The expert
velocity of T2V calls :meth:`ImageToVideo.guided_velocity`, so each expert sees the 36-channel input, as in
``pipeline_wan_i2v.py``. Wan2.2's experts have no CLIP image layers (``image_dim`` unset, no ``image_encoder``): the
first frame enters through its latents alone.
"""

from __future__ import annotations

from flowrl.models.wan22_t2v import Wan22T2VPolicy
from flowrl.models.wan_i2v import ImageToVideo


class Wan22I2VPolicy(ImageToVideo, Wan22T2VPolicy):
    family = "wan22_i2v"
    default_guidance = 3.5  # Wan2.2 I2V A14B's sample_guide_scale, the same for both experts
    default_height, default_width = 480, 832  # WanImageToVideoPipeline's defaults (A14B renders 480P and 720P)
    checkpoint_name = "Wan2.2 I2V A14B"

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_wan22_i2v import tiny_wan22_i2v_pipeline

        return tiny_wan22_i2v_pipeline(seed)
