"""A tiny, randomly initialised Wan2.2 I2V A14B pipeline for offline tests.

Same classes and component layout as ``Wan-AI/Wan2.2-I2V-A14B-Diffusers``: a ``WanImageToVideoPipeline`` with two
``WanTransformer3DModel`` experts of 36 input channels (``transformer`` for high noise, ``transformer_2`` for low
noise) and no image encoder (Wan2.2's experts condition on the first frame's latents alone), the Wan2.1 VAE, UMT5
text and ``boundary_ratio`` 0.9 (the released one). The networks are the tiny Wan2.1 I2V pipeline's without the
CLIP layers (:mod:`flowrl.models.tiny_wan_i2v`), each expert under its own seed; the scheduler is the flow-matching
Euler one with A14B I2V's static shift 5.0 (Wan2.2's ``sample_shift`` for i2v-A14B). At 4 steps the shift puts steps
0-1 (t = 1000, 910) on the high-noise expert and steps 2-3 (t = 717, 24) on the low-noise one; at 3 steps, step 0.
"""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

from flowrl.models.tiny import _seeded, tiny_t5_tokenizer
from flowrl.models.tiny_wan import _umt5_encoder, _wan_vae
from flowrl.models.tiny_wan_i2v import tiny_i2v_transformer

WAN22_I2V_BOUNDARY_RATIO = 0.9  # Wan2.2 I2V A14B's boundary (model_index.json's boundary_ratio)
WAN22_I2V_FLOW_SHIFT = 5.0  # Wan2.2 I2V A14B's sample_shift


def tiny_wan22_i2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """Wan2.2 I2V A14B layout with tiny random weights (call it with num_frames=5, 32x32 px)."""
    return WanImageToVideoPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=_seeded(seed, 2, _umt5_encoder), vae=_seeded(seed, 1, _wan_vae),
        transformer=_seeded(seed, 0, tiny_i2v_transformer), transformer_2=_seeded(seed, 3, tiny_i2v_transformer),
        boundary_ratio=WAN22_I2V_BOUNDARY_RATIO,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN22_I2V_FLOW_SHIFT),
    )
