"""A tiny, randomly initialised Wan2.2 T2V A14B pipeline for offline tests.

Same classes and component layout as ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``: a ``WanPipeline`` with two
``WanTransformer3DModel`` experts (``transformer`` for high noise, ``transformer_2`` for low noise), the Wan2.1 VAE
(16 latent channels, x8 spatial), UMT5 text and ``boundary_ratio`` 0.875 (the released one). The networks are the
tiny Wan2.1 pipeline's (:mod:`flowrl.models.tiny_wan`), with a second transformer of its own seed so the two experts
differ; the scheduler is the flow-matching Euler one with A14B's static shift 12.0 (its sample_shift at 720p; the
adapter swaps the released UniPC the same way), so that the pipeline's own loop is flowrl's Euler ODE. At 4 steps
the shift puts steps 0-1 on the high-noise expert and steps 2-3 on the low-noise one.
"""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from flowrl.models.tiny import _seeded
from flowrl.models.tiny_wan import tiny_wan_pipeline

WAN22_BOUNDARY_RATIO = 0.875  # Wan2.2 T2V A14B's model_index.json
WAN22_T2V_FLOW_SHIFT = 12.0  # A14B's sample_shift


def tiny_wan22_t2v_pipeline(seed: int = 0) -> WanPipeline:
    """Wan2.2 T2V A14B layout with tiny random weights (call it with num_frames=5, 32x32 px)."""
    base = tiny_wan_pipeline(seed)
    transformer_2 = _seeded(seed, 3, lambda: type(base.transformer).from_config(base.transformer.config))
    return WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, transformer=base.transformer,
        transformer_2=transformer_2, boundary_ratio=WAN22_BOUNDARY_RATIO,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN22_T2V_FLOW_SHIFT),
    )
