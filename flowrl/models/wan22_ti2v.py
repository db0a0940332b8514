"""Wan2.2 TI2V-5B text-to-video policy adapter (``WanPipeline`` with ``expand_timesteps``, the Wan2.2 VAE).

The math is Wan2.1's (:class:`~flowrl.models.wan.WanPolicy`: Euler flow ODE with a static shift, two-pass CFG with
the empty negative, UMT5 text, per-channel latent statistics); what the released checkpoint changes is read from
the pipeline by that adapter: 48 latent channels, the Wan2.2 VAE's x16 spatial compression (x8 convolutions
after a 2x2 pixel patchify), and per-token timesteps (``expand_timesteps``). This class only names the family
and its defaults, so that a Wan2.1 folder and a TI2V folder (both ``WanPipeline``) are told apart in one line.
Text-to-video only: TI2V's image conditioning (a clean first latent frame with its tokens at timestep 0) is not
part of this adapter.
"""

from __future__ import annotations

from flowrl.models.wan import WanPolicy


class Wan22TI2VPolicy(WanPolicy):
    family = "wan22_ti2v"
    default_guidance = 5.0  # Wan2.2 TI2V-5B's sample_guide_scale and WanPipeline's default
    default_height, default_width = 704, 1280  # TI2V-5B's 720p size (its x32 multiple)
    expand_timesteps = True  # the released model_index.json's
    checkpoint_name = "Wan2.2 TI2V-5B"
    tiny_size = (64, 64)  # 4x4 latents (x16) -> 2x2 patches per latent frame

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_wan22_ti2v import tiny_wan22_ti2v_pipeline

        return tiny_wan22_ti2v_pipeline(seed)
