"""LTX-2 text-to-video policy adapter (``LTX2Pipeline``: one ``LTX2VideoTransformer3DModel`` that denoises a video
stream and an audio stream jointly, ``AutoencoderKLLTX2Video``, Gemma-3 text through ``LTX2TextConnectors``).

What is trained is the video: the trajectory, the log-probabilities and the SDE exploration are over the video
latents ``[N, C, F, h, w]``; rewards receive the video frames as for every video family. The audio stream rides
along exactly as the pipeline runs it, so an ODE rollout gives ``LTX2Pipeline``'s video (the parity check):

- **Noise.** Each row's generator draws the video noise, then the audio noise, as ``prepare_latents`` and
  ``prepare_audio_latents`` draw them from a list of per-row generators (:meth:`LTX2Policy.init_noise`).
- **Audio is state, not action.** Every transformer pass takes both streams; the audio latents then take the
  pipeline's deterministic Euler step, ``a' = a + (sigma' - sigma) v_a``, whatever kind of step the video takes.
  The audio of a video state is kept in :class:`AudioTrack`, keyed by the exact bits of the video state, so the
  loss, which recomputes the velocity at a stored video state, runs the transformer on the audio the rollout had
  there. The audio is never decoded for training (no reward scores it; the vocoder stays idle), and an audio
  reward would need the track's last state decoded through ``audio_vae`` and ``vocoder``, which flowrl does not do.
- **What the log-probability is.** The joint state at step k is ``(x_k, a_k)``; with ``a_k`` fixed, the video step
  is Gaussian and its recorded log-density, ``log p_theta(x_{k+1} | x_k, a_k)``, is the exact conditional one, and
  so is the recomputed one (same ``a_k``, from the track). Since ``a_{k+1}`` is a deterministic function of
  ``(x_k, a_k)``, the path density of the video is the product of these conditionals. GRPO's ratio treats the
  recorded audio as part of the environment's state: it drops the dependence of ``a_k`` on theta, which exists
  because the audio queries the video through the video-to-audio cross-attention, whose video keys the LoRA
  changes. With the default LoRA (video self-attention, video text cross-attention, video FFN; no audio module
  and no audio-video cross-attention, :data:`LTX2_VIDEO_LORA_TARGETS`) every audio weight stays as released, so
  this is the only way the policy moves the audio, and the ratio is that of the per-step conditional densities.
- **Recipes.** Every recipe that samples with flowrl's rollout and recomputes stored steps works (GRPO and its
  windows, trees, GRPO-Guard, TMPO, dense credit, whose look-ahead continues the audio chain). A velocity at a
  video state no rollout reached (the forward-process recipes' freshly noised clean video: NFT, AWM, online DPO)
  has no audio state, and is refused in one line.

Guidance is the pipeline's, in x0 space: one batched ``[uncond, cond]`` pass when either stream's scale is above
1, ``x0 = x - sigma v`` per stream, ``x0_c + (w - 1) (x0_c - x0_u)``, the optional guidance rescale, then back to
``v = (x - x0) / sigma``; the audio's scale is ``audio_guidance_scale`` (None: the video's, as the pipeline).
Spatio-temporal guidance and modality-isolation guidance (extra passes) are left off, as Flow-Factory trains
(``stg_scale: 0``, ``modality_scale: 1``). The schedule is ``calculate_shift`` of the video token count
(dynamic, exponential time shift, stretched to ``shift_terminal``), from the scheduler itself.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from flowrl.models.base import PolicyBase, TextCond
from flowrl.models.sd3 import _quiet

# The video stream's attention and feed-forward of every joint block. peft matches a target as a suffix after a
# dot, so "attn1.to_q" takes ``transformer_blocks.i.attn1.to_q`` and not ``audio_attn1.to_q``; the audio stream
# (audio_attn1/2, audio_ff) and the audio-video cross-attention (audio_to_video_attn, video_to_audio_attn) keep
# their released weights. Flow-Factory's default (models/ltx2/ltx2_t2av.py) adds those 20 modules per block.
LTX2_VIDEO_LORA_TARGETS: tuple[str, ...] = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2",
)
NO_AUDIO_STATE = ("ltx2: no audio state for these video latents (LTX-2 denoises audio jointly with the video, and "
                  "flowrl keeps the audio of the states its rollouts reach): the forward-process recipes (nft, awm, "
                  "online dpo) noise clean video afresh and cannot run on ltx2; use a rollout recipe (grpo)")


def state_keys(x: torch.Tensor) -> list[bytes]:
    """One exact key per row of ``x`` ``[B, ...]``: a digest of its bits (equal rows, equal keys)."""
    rows = x.detach().contiguous().view(x.shape[0], -1).cpu().view(torch.uint8)  # [B, bytes]
    return [hashlib.blake2b(row.numpy().tobytes(), digest_size=16).digest() for row in rows]


@dataclass
class _Pending:
    """The audio step the last velocity call started: its rows' audio, their audio velocity and its sigma; the
    next call, at a lower sigma, on video states the track does not know, finishes it (``a + (sigma' - sigma) v``)."""

    audio: torch.Tensor  # [R, L, Ca*M] float32 packed audio latents
    velocity: torch.Tensor  # [R, L, Ca*M] float32 guided audio velocity
    sigma: torch.Tensor  # [] float32


class AudioTrack:
    """The audio latents of every video state the rollouts reached since the last update, keyed by the video
    state's bits (:func:`state_keys`), and the audio step in flight (:class:`_Pending`).

    A rollout calls the velocity once per step on the rows' current states, in row order (a tree branch repeats
    each row ``k`` times): a state the track does not know is the successor of the previous call's rows, whose
    audio the pending step gives. The loss calls it on stored states, which the track knows. The track is
    emptied when a new rollout starts after a training step (the old states are then off-policy history)."""

    def __init__(self):
        self.audio: dict[bytes, torch.Tensor] = {}
        self.pending: _Pending | None = None
        self.trained_since_rollout = False

    def start(self, keys: list[bytes], audio: torch.Tensor) -> None:
        """A rollout's initial states and their audio noise ``[N, L, Ca*M]``."""
        if self.trained_since_rollout:
            self.audio.clear()
            self.trained_since_rollout = False
        self.pending = None
        self.remember(keys, audio)

    def remember(self, keys: list[bytes], audio: torch.Tensor) -> None:
        for key, row in zip(keys, audio):
            self.audio[key] = row

    def lookup(self, keys: list[bytes], sigma: torch.Tensor) -> torch.Tensor:
        """The audio ``[B, L, Ca*M]`` of the states ``keys`` at ``sigma``: remembered, or the pending step's result."""
        known = [self.audio.get(key) for key in keys]
        if all(row is not None for row in known):
            return torch.stack(known)
        pending = self.pending
        if pending is None or len(keys) % len(pending.audio) or not bool(sigma < pending.sigma):
            raise ValueError(NO_AUDIO_STATE)
        # LTX2Pipeline's audio_scheduler.step: prev = sample + (sigma_next - sigma) * model_output, in float32
        stepped = pending.audio + (sigma - pending.sigma) * pending.velocity  # [R, L, Ca*M]
        stepped = stepped.repeat_interleave(len(keys) // len(pending.audio), dim=0)  # a tree branch repeats rows
        audio = torch.stack([row if row is not None else stepped[i] for i, row in enumerate(known)])
        self.remember(keys, audio)
        return audio


class LTX2Policy(PolicyBase):
    """LTX-2 text-to-video (see the module docstring): video trained, audio denoised alongside."""

    family = "ltx2"
    pipeline_class_name = "LTX2Pipeline"
    default_guidance = 4.0  # the guidance LTX-2's model card and Flow-Factory's evaluation sample with
    video = True
    tiny_size = (32, 32)
    tiny_max_sequence_length = 16  # a multiple of the tiny connectors' 4 registers (the released: 1024 of 128)
    default_num_frames: int | None = None
    """Frames per clip when none is given: three latent frames, ``2 t + 1`` for the VAE's temporal factor t (17 for
    the released x8 VAE, 5 for the tiny x2 one). ``model.num_frames`` sets it (``LTX2Pipeline``'s default is 121;
    Flow-Factory's recipe trains on 121)."""
    default_height, default_width = 512, 768  # LTX2Pipeline's defaults
    frame_rate = 24.0  # LTX2Pipeline's default: the RoPE's fps and the audio length (seconds = frames / rate)
    audio_guidance_scale: float | None = None  # None: the video's guidance, as LTX2Pipeline's `or guidance_scale`
    guidance_rescale = 0.0  # Flow-Factory's; LTX2Pipeline's call defaults to 0.7
    use_cross_timestep = True  # LTX2Pipeline's default (the LTX-2.3 behaviour; False is LTX-2.0's legacy one)

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_ltx2 import tiny_ltx2_pipeline

        return tiny_ltx2_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 1024, num_frames: int | None = None):
        super().__init__(pipeline, height=height or self.default_height, width=width or self.default_width)
        registers = {pipeline.connectors.config.get(f"{stream}_connector_num_learnable_registers")
                     for stream in ("video", "audio")} - {None}
        if any(max_sequence_length % n for n in registers):
            raise ValueError(f"LTX-2's text connectors replace padding with {max(registers)} learnable registers: "
                             f"model.max_sequence_length must be a multiple of {max(registers)} (the released "
                             f"1024), got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        self.num_frames = num_frames or self.default_num_frames or 2 * pipeline.vae_temporal_compression_ratio + 1
        self.check_size(self.height, self.width, self.num_frames)
        self.audio_track = AudioTrack()
        self._schedule: torch.Tensor | None = None  # the last sigmas(): where a rollout's steps end

    # --- size ------------------------------------------------------------------------------------
    @property
    def size_multiple(self) -> int:
        return max(32, self.pipeline.vae_spatial_compression_ratio * self.pipeline.transformer_spatial_patch_size)

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        temporal = self.pipeline.vae_temporal_compression_ratio
        if num_frames is not None and ((num_frames - 1) % temporal or num_frames < 1):
            raise ValueError(f"LTX-2 needs num_frames = {temporal} k + 1 (1, {temporal + 1}, {2 * temporal + 1}, "
                             f"... 121), got {num_frames}")
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"LTX-2 needs height and width divisible by {multiple}, got {height}x{width}")

    def default_lora_targets(self) -> tuple[str, ...]:
        return LTX2_VIDEO_LORA_TARGETS

    # --- layout ------------------------------------------------------------------------------------
    def latent_grid(self) -> tuple[int, int, int]:
        """Latent frames, height and width: ``(frames - 1) / temporal + 1`` and pixels / spatial, as the pipeline."""
        spatial, temporal = self.pipeline.vae_spatial_compression_ratio, self.pipeline.vae_temporal_compression_ratio
        return (self.num_frames - 1) // temporal + 1, self.height // spatial, self.width // spatial

    def latent_shape(self, n: int) -> tuple[int, int, int, int, int]:
        return (n, self.transformer.config.in_channels, *self.latent_grid())

    def audio_shape(self, n: int) -> tuple[int, int, int, int]:
        """``prepare_audio_latents``' ``[n, Ca, L, M]``: L latent audio frames for the clip's seconds, M mel bins / 4."""
        pipe = self.pipeline
        seconds = self.num_frames / self.frame_rate
        length = round(seconds * pipe.audio_sampling_rate / pipe.audio_hop_length
                       / float(pipe.audio_vae_temporal_compression_ratio))
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return (n, pipe.audio_vae.config.latent_channels, length, mel_bins)

    def init_noise(self, n: int, generator=None) -> torch.Tensor:
        """Video noise ``[n, C, F, h, w]``, then audio noise from the same generators (float32, as the pipeline
        draws both); the audio starts the :class:`AudioTrack` of the rollout, the video is returned."""
        from diffusers.utils.torch_utils import randn_tensor

        video = randn_tensor(self.latent_shape(n), generator=generator, device=self.device, dtype=torch.float32)
        audio = randn_tensor(self.audio_shape(n), generator=generator, device=self.device, dtype=torch.float32)
        video = video.to(self.dtype)
        self.audio_track.start(state_keys(video), self.pipeline._pack_audio_latents(audio))  # [n, L, Ca*M]
        return video

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``linspace(1, 1/n)`` through the scheduler with ``mu = calculate_shift(video tokens)``; ``[n + 1]``."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        frames, height, width = self.latent_grid()
        config = scheduler.config
        mu = calculate_shift(frames * height * width, config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        self._schedule = scheduler.sigmas.float()
        return self._schedule

    # --- text ----------------------------------------------------------------------------------------
    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's every hidden state through the connectors: ``[B, L, Dv + Da]`` (the video stream's text, then
        the audio stream's), pooled ``[B, 0]``. Padding rows come out zero in the video half (the connectors'
        mask), which :meth:`finish_cond` reads back."""
        pipe = self.pipeline
        with _quiet(type(pipe).__module__):
            embeds, mask, _, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                    max_sequence_length=self.max_sequence_length, device=device)
            padding_side = getattr(pipe.tokenizer, "padding_side", "left") if pipe.tokenizer is not None else "left"
            video_text, audio_text, _ = pipe.connectors(embeds, mask, padding_side=padding_side)
        joined = torch.cat([video_text, audio_text], dim=-1)
        return joined, joined.new_zeros(joined.shape[0], 0)

    def finish_cond(self, cond: TextCond) -> TextCond:
        """The connectors' mask (True on kept text tokens; all True with learnable registers) from the video half."""
        video_dim = self.transformer.config.caption_channels
        cond.prompt_mask = cond.prompt_embeds[..., :video_dim].ne(0).any(-1)  # [B, L]
        if cond.negative_prompt_embeds is not None:
            cond.negative_prompt_mask = cond.negative_prompt_embeds[..., :video_dim].ne(0).any(-1)
        return cond

    # --- velocity ------------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """The guided video velocity ``[B, C, F, h, w]`` at ``sigma`` (the joint pass, audio from the track)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        if sigma.ndim and not bool((sigma == sigma.reshape(-1)[0]).all()):
            raise ValueError(NO_AUDIO_STATE)  # per-row noise levels: a forward-process recipe's fresh states
        sigma = sigma.reshape(-1)[0]
        keys = state_keys(x)
        audio = self.audio_track.lookup(keys, sigma).to(x.device)  # [B, L, Ca*M] float32
        audio_scale = self.audio_guidance_scale or guidance_scale
        cfg = guidance_scale > 1 or audio_scale > 1
        if cfg and not cond.has_negative:
            raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
        video_velocity, audio_velocity = self.joint_velocity(x, audio, sigma, cond, guidance_scale, audio_scale, cfg)
        if torch.is_grad_enabled():
            self.audio_track.trained_since_rollout = True
        schedule = self._schedule
        last = schedule is not None and bool(sigma == schedule[schedule > 0][-1])  # no step follows the last one
        self.audio_track.pending = None if last else _Pending(audio, audio_velocity.detach(), sigma)
        return video_velocity

    def joint_velocity(self, x: torch.Tensor, audio: torch.Tensor, sigma: torch.Tensor, cond: TextCond,
                       guidance_scale: float, audio_scale: float, cfg: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer pass on both streams (``[uncond, cond]`` batched under CFG) and LTX2Pipeline's x0-space
        guidance: (video velocity ``[B, C, F, h, w]``, audio velocity ``[B, L, Ca*M]``), float32."""
        pipe, config = self.pipeline, self.transformer.config
        batch, _, frames, height, width = x.shape
        latents = pipe._pack_latents(x.float(), pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size)  # [B, S, C] float32, as the pipeline's
        video_dim = config.caption_channels
        embeds, mask = cond.prompt_embeds, cond.prompt_mask
        if cfg:
            embeds = torch.cat([cond.negative_prompt_embeds, embeds])
            mask = torch.cat([cond.negative_prompt_mask, mask])
        repeat = 2 if cfg else 1
        dtype = embeds.dtype
        timestep = (sigma * 1000).expand(batch * repeat)  # the scheduler's timesteps: sigmas * 1000, float32
        fps = float(self.frame_rate)
        video_coords = self.transformer.rope.prepare_video_coords(batch * repeat, frames, height, width, x.device,
                                                                  fps=fps)
        audio_coords = self.transformer.audio_rope.prepare_audio_coords(batch * repeat, audio.shape[1], x.device)
        mask = mask.to(torch.int64)
        video_out, audio_out = self.run_transformer(
            hidden_states=torch.cat([latents] * repeat).to(dtype), audio_hidden_states=torch.cat([audio] * repeat).to(dtype),
            encoder_hidden_states=embeds[..., :video_dim], audio_encoder_hidden_states=embeds[..., video_dim:],
            timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=frames, height=height, width=width, fps=fps, audio_num_frames=audio.shape[1],
            video_coords=video_coords, audio_coords=audio_coords, isolate_modalities=False,
            spatio_temporal_guidance_blocks=None, perturbation_mask=None,
            use_cross_timestep=self.use_cross_timestep, attention_kwargs=None,
        )  # every argument as LTX2Pipeline's denoising loop passes it
        video = self._guide(latents, video_out.float(), sigma, guidance_scale, self.guidance_rescale, cfg)
        audio_velocity = self._guide(audio, audio_out.float(), sigma, audio_scale, self.guidance_rescale, cfg)
        video = pipe._unpack_latents(video, frames, height, width, pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size)  # [B, C, F, h, w]
        return video, audio_velocity

    def run_transformer(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One joint forward through the (possibly distributed) wrapper: the (video, audio) outputs."""
        module = self.forward_module if self.forward_module is not None else self.transformer
        video, audio = module(return_dict=False, **kwargs)[:2]
        return video, audio

    @staticmethod
    def _guide(sample: torch.Tensor, out: torch.Tensor, sigma: torch.Tensor, scale: float, rescale: float,
               cfg: bool) -> torch.Tensor:
        """LTX2Pipeline's guidance of one stream, float32: x0 = sample - v sigma; under CFG the delta
        ``(w - 1)(x0_c - x0_u)``, the rescale where asked; back to ``v = (sample - x0) / sigma``."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        if cfg:
            uncond, text = out.chunk(2)
            x0 = sample - text * sigma
            guided = x0 + (scale - 1) * (x0 - (sample - uncond * sigma))
        else:
            x0 = guided = sample - out * sigma
        if rescale > 0:
            guided = rescale_noise_cfg(guided, x0, guidance_rescale=rescale)
        return (sample - guided) / sigma

    # --- decode ------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[N, C, F, h, w]`` -> frames ``[N, T, 3, H, W]`` in [0, 1] (float32), as the pipeline at
        its default ``decode_timestep=0``: a VAE with timestep conditioning gets timestep 0 and no decode noise
        (its noise enters with weight 0). The audio is not decoded (see the module docstring)."""
        pipe, vae = self.pipeline, self.vae
        latents = latents.to(self.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]  # [N, 3, T, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """LTX2Pipeline's frames ``[N, T, 3, H, W]`` for the same seeds, with the guidance flowrl runs: CFG (and its
        audio scale and rescale) on, spatio-temporal and modality-isolation guidance off.

        Each prompt is passed once per row with ``num_videos_per_prompt=1``: with more videos per prompt, diffusers
        0.42's ``_get_gemma_prompt_embeds`` repeats the embeddings row by row (p0 p0 p1 p1) but tiles the attention
        mask (p0 p1 p0 p1), so prompts of different token counts get each other's masks; one video per prompt is
        the pipeline's own path without that mix-up."""
        from flowrl.core.seeding import generators

        rows = [prompt for prompt in prompts for _ in range(group_size)]
        return self.pipeline(
            prompt=rows, negative_prompt=self.negative_prompts(len(rows)),
            num_videos_per_prompt=1, num_inference_steps=num_steps, guidance_scale=guidance_scale,
            audio_guidance_scale=self.audio_guidance_scale, guidance_rescale=self.guidance_rescale,
            audio_guidance_rescale=self.guidance_rescale, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
            audio_modality_scale=1.0, height=self.height, width=self.width, num_frames=self.num_frames,
            frame_rate=self.frame_rate, use_cross_timestep=self.use_cross_timestep,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length,
        ).frames.float()
