"""Wan text-to-video policy adapter (``WanPipeline``: ``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5).

One adapter serves Wan2.1 T2V (family ``wan``) and Wan2.2 TI2V-5B (family ``wan22_ti2v``,
:mod:`flowrl.models.wan22_ti2v`): the flow, the CFG and the text are the same. Their differences are read from the
loaded pipeline, not assumed: the latent channels (16 or 48) from the transformer, the compression (x8 or x16
spatial) from the VAE, the latent statistics from the VAE config, and the timestep layout from the pipeline's
``expand_timesteps`` flag (:meth:`WanPolicy.timesteps`, the one place it is handled). Wan2.2 A14B's two experts
(``boundary_ratio``, ``transformer_2``) are their own family, ``wan22_t2v`` (:mod:`flowrl.models.wan22_t2v`), which
picks the expert of each step and runs it through :meth:`WanPolicy.guided_velocity`; a two-expert folder is refused
here in one line.

What differs from the image families, all hidden here:

- Latents are video, ``[N, C, F, h, w]`` in the Wan VAE's layout (F = (frames - 1) / 4 + 1 latent frames, the
  causal VAE keeps the first frame on its own); the transformer patchifies them itself, so nothing is packed.
  :meth:`decode` returns frames ``[N, T, 3, H, W]`` in [0, 1], the layout rewards receive.
- The schedule is a static shift (Wan2.1 T2V: 3.0 at 480p, 5.0 at 720p). The released pipeline samples with
  UniPC, a multistep solver; flowrl's loop is Euler, and GRPO's SDE step (its mean and its log-density) is
  defined as a perturbation of the Euler step of the flow ODE, so :meth:`__init__` swaps a non-Euler scheduler
  for ``FlowMatchEulerDiscreteScheduler`` with the scheduler's ``flow_shift``. The pipeline then samples the
  same ODE as the rollout, which is what the parity test checks (the tiny pipeline is built with it).
- Classifier-free guidance is two transformer passes, conditional then unconditional (the empty negative
  prompt, WanPipeline's default), mixed ``v_u + w (v_c - v_u)``; no pooled text vector (``[B, 0]``).
- Text: UMT5 hidden states trimmed to each prompt's length and zero-padded to ``max_sequence_length`` by the
  pipeline's own ``encode_prompt``: a fixed length, and the transformer takes no mask.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flowrl.models.base import PolicyBase, TextCond, unnormalise_latents
from flowrl.models.sd3 import _quiet

# Attention projections of both attention layers (attn1 self, attn2 cross) of every block. diffusers ships no
# DreamBooth-LoRA script for Wan; this is Flow-Factory's default Wan target list (its Wan2.1 GRPO LoRA example,
# examples/grpo/lora/wan21/t2v.yaml: ["to_k", "to_q", "to_v", "to_out.0"]), which WanLoraLoaderMixin loads.
WAN_LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
WAN_DEFAULT_SHIFT = 3.0  # Wan2.1 T2V 480p (the released UniPC config's flow_shift)
TWO_EXPERTS = ("a two-expert Wan2.2 A14B pipeline (boundary_ratio set, transformer_2): set model.family=wan22_t2v")
ONE_EXPERT = ("a one-transformer WanPipeline (no boundary_ratio): set model.family=wan (Wan2.1 T2V) or "
              "model.family=wan22_ti2v (Wan2.2 TI2V-5B)")


def euler_scheduler_for(scheduler):
    """``scheduler`` itself if it is already the flow-matching Euler one, else an Euler scheduler with its
    static shift (``flow_shift`` of Wan's UniPC config) and training timesteps."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config = scheduler.config
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                           shift=float(config.get("flow_shift") or WAN_DEFAULT_SHIFT))


def has_two_experts(pipeline) -> bool:
    """Whether a ``WanPipeline`` is Wan2.2 A14B's layout: ``boundary_ratio`` set or a ``transformer_2``."""
    return pipeline.config.get("boundary_ratio") is not None or getattr(pipeline, "transformer_2", None) is not None


class WanPolicy(PolicyBase):
    """Wan2.1 T2V; the base of :class:`~flowrl.models.wan22_ti2v.Wan22TI2VPolicy` (see the module docstring)."""

    family = "wan"
    pipeline_class_name = "WanPipeline"
    default_guidance = 5.0  # WanPipeline's default and the Wan2.1 model card's
    preference_sites = {"timestep": "condition_embedder.time_embedder"}  # temb, before time_proj
    video = True
    tiny_size = (32, 32)
    tiny_max_sequence_length = 16
    default_num_frames = 5
    """Frames per video when none is given: Flow-Factory's Wan2.1 GRPO recipe trains on 5-frame clips (2 latent
    frames), and the tiny pipeline uses the same. ``model.num_frames`` sets it (WanPipeline's own default is 81)."""
    default_height, default_width = 480, 832  # WanPipeline's defaults (Wan2.1 480p)
    expand_timesteps = False
    """The family's ``expand_timesteps`` in its model_index.json: a folder with the other value is another Wan
    family (:meth:`index_mismatch`)."""
    checkpoint_name = "Wan2.1 T2V"
    two_experts = False
    """True for Wan2.2 A14B (``boundary_ratio`` and ``transformer_2``): a folder with the other layout is refused."""

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_wan import tiny_wan_pipeline

        return tiny_wan_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512, num_frames: int | None = None):
        if has_two_experts(pipeline) != self.two_experts:
            raise ValueError(f"model.path holds {self.layout(has_two_experts(pipeline))}")
        super().__init__(pipeline, height=height or self.default_height, width=width or self.default_width)
        pipeline.scheduler = euler_scheduler_for(pipeline.scheduler)  # see the module docstring
        self.max_sequence_length = max_sequence_length
        self.num_frames = num_frames or self.default_num_frames
        self.check_size(self.height, self.width, self.num_frames)

    @classmethod
    def layout(cls, two_experts: bool) -> str:
        """The layout of a pipeline of this class with (or without) two experts, and the family that takes it: the
        refusal of a folder of the other layout (image-to-video names its own families)."""
        return TWO_EXPERTS if two_experts else ONE_EXPERT

    @classmethod
    def index_mismatch(cls, index: dict) -> str | None:
        """Why a ``WanPipeline`` model_index.json is not this family's (A14B's two experts, or the other
        ``expand_timesteps``), with the family that takes it; None when it is."""
        two_experts = index.get("boundary_ratio") is not None or (index.get("transformer_2") or [None])[0] is not None
        if two_experts != cls.two_experts:
            return f"it holds {cls.layout(two_experts)}"
        if bool(index.get("expand_timesteps", False)) != cls.expand_timesteps:
            other = "wan22_ti2v" if index.get("expand_timesteps") else "wan"
            return (f"its expand_timesteps={bool(index.get('expand_timesteps', False))} is not {cls.checkpoint_name}'s "
                    f"(model.family={cls.family}): set model.family={other}")
        return None

    @property
    def size_multiple(self) -> int:
        return self.pipeline.vae_scale_factor_spatial * self.transformer.config.patch_size[1]

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        temporal = self.pipeline.vae_scale_factor_temporal
        if num_frames is not None and (num_frames - 1) % temporal:
            raise ValueError(f"Wan needs num_frames = {temporal} k + 1 (1, 5, 9, ... 81), got {num_frames}")
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"Wan needs height and width divisible by {multiple}, got {height}x{width}")

    def default_lora_targets(self) -> tuple[str, ...]:
        return WAN_LORA_TARGETS

    def latent_shape(self, n: int) -> tuple[int, int, int, int, int]:
        """``(n, C, F, h, w)``: F = (num_frames - 1) / 4 + 1 latent frames, h, w = pixels / the VAE's spatial factor
        (8 for Wan2.1, 16 for the Wan2.2 VAE), C = the transformer's input channels (16 or 48), as WanPipeline's."""
        spatial, temporal = self.pipeline.vae_scale_factor_spatial, self.pipeline.vae_scale_factor_temporal
        frames = (self.num_frames - 1) // temporal + 1
        return (n, self.transformer.config.in_channels, frames, self.height // spatial, self.width // spatial)

    def init_noise(self, n: int, generator=None) -> torch.Tensor:
        """``[n, C, F, h, w]`` drawn in float32 as ``WanPipeline.prepare_latents`` draws it, then in the policy's
        dtype like every family's latents (identical bits in float32)."""
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(self.latent_shape(n), generator=generator, device=self.device, dtype=torch.float32)
        return noise.to(self.dtype)

    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """UMT5 states ``[B, L, D]`` (zero past each prompt's tokens, L = max_sequence_length), pooled ``[B, 0]``."""
        with _quiet(type(self.pipeline).__module__):
            embeds, _ = self.pipeline.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
                device=device,
            )
        return embeds, embeds.new_zeros(embeds.shape[0], 0)

    def timesteps(self, sigma, x: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep input for latents ``x`` ``[B, C, F, h, w]`` at ``sigma``, in float32 as
        WanPipeline builds it: ``[B]`` (Wan2.1), or with the pipeline's ``expand_timesteps`` (Wan2.2 TI2V) one per
        patch token, ``[B, F * h/p * w/p]``, all equal for text-to-video (the pipeline's mask of ones times t)."""
        batch, _, frames, height, width = x.shape
        timestep = torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000  # []
        if not self.pipeline.config.get("expand_timesteps", False):
            return timestep.expand(batch)  # [B]
        _, patch_h, patch_w = self.transformer.config.patch_size
        tokens = frames * -(-height // patch_h) * -(-width // patch_w)  # WanPipeline's mask[:, ::2, ::2].flatten()
        return timestep.expand(batch, tokens)  # [B, F * h/p * w/p]

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, F, h, w]``; with ``guidance_scale > 1`` WanPipeline's two-pass CFG mix."""
        return self.guided_velocity(x, self.timesteps(sigma, x), cond, guidance_scale, cfg=guidance_scale > 1)

    def guided_velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: TextCond, guidance_scale: float, *,
                        cfg: bool, **expert) -> torch.Tensor:
        """One transformer's v ``[B, C, F, h, w]`` at ``timestep`` (:meth:`timesteps`): the conditional pass, and with
        ``cfg`` WanPipeline's mix ``v_u + w (v_c - v_u)`` at ``guidance_scale``. ``expert`` (a two-expert family's
        ``expert="transformer_2"``) goes to the forward as it is."""
        x = x.to(self.dtype)
        text = self.run_transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond.prompt_embeds,
                                    **expert)
        if not cfg:
            return text
        if not cond.has_negative:
            raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
        uncond = self.run_transformer(hidden_states=x, timestep=timestep,
                                      encoder_hidden_states=cond.negative_prompt_embeds, **expert)
        return uncond + guidance_scale * (text - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[N, C, F, h, w]`` -> frames ``[N, T, 3, H, W]`` in [0, 1] (float32).

        Un-normalised with the VAE's per-channel ``latents_mean`` / ``latents_std`` in WanPipeline's exact
        arithmetic; the VAE decodes ``[N, 3, T, H, W]``, permuted to frames-first."""
        video = self.vae.decode(unnormalise_latents(latents, self.vae), return_dict=False)[0]  # [N, 3, T, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """WanPipeline's frames for the same seeds: ``output_type="pt"`` already gives ``[N, T, 3, H, W]`` in [0, 1]
        (its video processor permutes each ``[3, T, H, W]`` video to frames-first)."""
        from flowrl.core.seeding import generators

        return self.pipeline(
            prompt=list(prompts), negative_prompt=self.negative_prompts(len(prompts)), num_videos_per_prompt=group_size, num_inference_steps=num_steps,
            guidance_scale=guidance_scale, height=self.height, width=self.width, num_frames=self.num_frames,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length, **self.pipeline_guidance(),
        ).frames.float()

    def pipeline_guidance(self) -> dict:
        """Extra guidance arguments of the pipeline call (a two-expert family's ``guidance_scale_2``)."""
        return {}
