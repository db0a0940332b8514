"""What every model family provides to the sampler and the losses: the Policy adapter.

A policy wraps the components of a diffusers pipeline (transformer, VAE, text encoders, scheduler
sigmas) and exposes exactly what flowrl's hand-written denoising loop needs. The loop itself lives
in :mod:`flowrl.sampling`, never inside a pipeline ``__call__``.

Latents are always handled in the VAE's layout, ``[N, C, h, w]`` for images and ``[N, C, F, h, w]``
for video (Wan); model-specific packing (FLUX's 2x2 patch sequence) happens inside
:meth:`Policy.velocity`, so trajectories, losses and rewards never see it.

Adding a family is one subclass of :class:`PolicyBase` (a module in ``flowrl.models``) and one line of
``FAMILY_CLASSES`` (:mod:`flowrl.models.families`): the class says how to encode text (``encode_batch``), which
sigmas to use, how to run the transformer (``velocity``), how to build its tiny offline pipeline
(``tiny_pipeline``) and how its diffusers pipeline is called for the same images (``pipeline_images``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch

# Target modules follow the diffusers DreamBooth-LoRA training scripts for each family.
SD3_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)
FLUX_LORA_TARGETS: tuple[str, ...] = SD3_LORA_TARGETS + (
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    "proj_mlp", "proj_out",
)

TEXT_CHUNK = 8
"""Prompts per text-encoder call. Every encoding, live or into the text cache, runs in calls of exactly this
many prompts (the last one padded with ""): a GEMM's rounding depends on its batch size (the CLIP pooled
projection differs by ~5e-7 between batches of 3 and 42), so this makes a prompt's embedding the same bits
whatever batch it arrives in, and the cache bit-identical to the live encoders."""


TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # every family's, by pipeline name


@dataclass
class TextCond:
    """The conditioning of a batch of prompts, computed once and indexed per trajectory row.

    Families without a pooled text vector (Qwen-Image, FLUX.2, Z-Image, Wan) store a zero-width
    ``pooled_prompt_embeds`` ``[B, 0]``, so the text cache and row indexing stay one code path."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    pooled_prompt_embeds: torch.Tensor  # [B, P] (P = 0 for families without a pooled vector)
    negative_prompt_embeds: torch.Tensor | None = None  # [B, L, D], for classifier-free guidance
    negative_pooled_prompt_embeds: torch.Tensor | None = None  # [B, P]
    text_ids: torch.Tensor | None = None  # [L, 3] FLUX text position ids (shared by the batch)
    prompt_mask: torch.Tensor | None = None  # [B, L] bool, True on real tokens (families whose transformer masks)
    negative_prompt_mask: torch.Tensor | None = None  # [B, L] bool
    image_latents: torch.Tensor | None = None  # [B, ...] latents of a conditioning image (editing: Kontext)
    image_embeds: torch.Tensor | None = None  # [B, T, D] image-encoder states of it (Wan2.1 I2V: CLIP's penultimate)
    preference: torch.Tensor | None = None  # [B, K] ParetoSlider's reward weights per row (flowrl.models.preference)

    SHARED = ("text_ids",)  # one value for the whole batch: neither indexed nor concatenated

    def select(self, index: torch.Tensor | Sequence[int]) -> "TextCond":
        """Rows ``index`` of every batched field; the shared fields are kept as they are."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.prompt_embeds.device)
        batched = {
            f.name: getattr(self, f.name)[index.to(getattr(self, f.name).device)]
            for f in fields(self)
            if f.name not in self.SHARED and getattr(self, f.name) is not None
        }
        return replace(self, **batched)

    @staticmethod
    def cat(conds: Sequence["TextCond"]) -> "TextCond":
        """Concatenate the batches of several conditionings (shared fields taken from the first)."""
        first = conds[0]
        joined = {
            f.name: torch.cat([getattr(c, f.name) for c in conds])
            for f in fields(first)
            if f.name not in first.SHARED and getattr(first, f.name) is not None
        }
        return replace(first, **joined)

    @property
    def has_negative(self) -> bool:
        return self.negative_prompt_embeds is not None


@runtime_checkable
class Policy(Protocol):
    """The adapter the sampler and losses talk to (one implementation per model family)."""

    transformer: torch.nn.Module
    height: int
    width: int

    def encode(self, prompts: list[str], *, negative: bool = True, metadata: Sequence[dict] | None = None
               ) -> TextCond: ...  # metadata: per prompt (an editing family reads its source image there)

    def init_noise(self, n: int, generator=None) -> torch.Tensor: ...  # [n, C, h, w]

    def sigmas(self, num_steps: int) -> torch.Tensor: ...  # [num_steps + 1], ends at 0

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...  # [N, 3, H, W] (video: [N, T, 3, H, W]) in [0, 1]

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def reference(self) -> contextlib.AbstractContextManager: ...


class PolicyBase:
    """Behaviour shared by every family's adapter: LoRA, reference switch, text cache, VAE decoding.

    Class attributes a family sets: ``family`` (its config name), ``pipeline_class_name`` (the diffusers
    pipeline it wraps), ``default_guidance`` (the guidance its model card samples with), ``guidance_in_model``
    (True where guidance is an input of one transformer pass, as FLUX.1-dev's embedding: it applies even
    without ``train.cfg``), ``tiny_size`` (height, width of its tiny pipeline) and ``tiny_max_sequence_length``."""

    family = ""
    pipeline_class_name = ""
    default_guidance = 1.0
    guidance_in_model = False
    video = False  # True: latents [N, C, F, h, w], decode gives frames [N, T, 3, H, W], takes num_frames
    tiny_size = (64, 64)
    tiny_max_sequence_length = 32
    preference_sites: dict[str, str] = {}  # where -> the transformer submodule a preference embedding is added to

    def __init__(self, pipeline, *, height: int, width: int):
        self.pipeline = pipeline
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        self.height, self.width = height, width
        self.has_lora = False
        self.full_weights = None  # model.trainable=full: a flowrl.models.full_weights.FullWeights (trained + base)
        self.forward_module = None  # e.g. the DDP-wrapped transformer; None calls the transformer itself
        self.text_cache = None  # a flowrl.models.text_cache.TextCache: prompts looked up before encoding
        self.text_encoders_on_cpu = False  # model.text_encoder_device=cpu: encode there, move the rows over
        self.negative_prompt = ""  # model.negative_prompt: the CFG negative of every prompt (families with CFG)
        self.preference = None  # ParetoSlider's PreferenceEmbedding (flowrl.models.preference), when attached
        # model.text_encoder_dtype other than the transformer's: the embeddings (live or cached) are cast to this, the
        # transformer's dtype, so they enter it as its own inputs do (exact from float16 or bfloat16 to float32).
        self.cond_dtype: torch.dtype | None = None

    def run_transformer(self, **kwargs):
        """One transformer forward through the (possibly distributed) wrapper; returns the sample."""
        module = self.forward_module if self.forward_module is not None else self.transformer
        return module(return_dict=False, **kwargs)[0]

    # --- size ----------------------------------------------------------------------------
    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: the VAE's factor times the transformer's 2x2 patches."""
        return self.pipeline.vae_scale_factor * 2

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        """Raise a one-line ValueError where this model cannot sample ``height`` x ``width`` (x ``num_frames``)."""
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"{self.family}: height and width must be multiples of {multiple}, got {height}x{width}")
        if num_frames is not None and not self.video:
            raise ValueError(f"num_frames is for video families; {self.family} makes images")

    @contextlib.contextmanager
    def sized(self, height: int | None = None, width: int | None = None,
              num_frames: int | None = None) -> Iterator[None]:
        """Sample at another size inside the block (``eval.height``/``width``/``num_frames``: train small, evaluate
        large); None keeps the training size. The LoRA is resolution-free; positions are computed per call."""
        old = (self.height, self.width, getattr(self, "num_frames", None))
        new = (height or self.height, width or self.width, num_frames or old[2])
        self.check_size(*new[:2], num_frames)
        self.height, self.width = new[:2]
        if self.video:
            self.num_frames = new[2]
        try:
            yield
        finally:
            self.height, self.width = old[:2]
            if self.video:
                self.num_frames = old[2]

    # --- placement -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def to(self, device) -> "PolicyBase":
        if not self.text_encoders_on_cpu:
            self.pipeline.to(device)
            return self
        encoders = {id(m) for m in self.text_encoders()}  # stay on the CPU, never passing through ``device``
        for module in self.pipeline.components.values():
            if isinstance(module, torch.nn.Module):
                module.to("cpu" if id(module) in encoders else device)
        return self

    # --- text conditioning -----------------------------------------------------------------
    def encode(self, prompts: list[str], *, negative: bool = True, metadata: Sequence[dict] | None = None
               ) -> TextCond:
        """Conditioning of ``prompts`` with ``negative_prompt`` as the CFG negative (cached or live, same bits).
        Families without CFG (FLUX's guidance embedding) or with a conditioning image override it."""
        return self.encode_text(prompts, negative=negative)

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str], *, negative: bool) -> TextCond:
        """Conditioning of ``prompts`` (``negative_prompt``, by default the empty one, as the negative): each
        distinct prompt is looked up in the text cache, else encoded in chunks of ``TEXT_CHUNK``
        (:meth:`encode_chunks`); rows index into it."""
        unique = list(dict.fromkeys(list(prompts) + ([self.negative_prompt] if negative else [])))
        if self.text_cache is not None:
            encode = self.encode_chunks if self.text_encoders() else None
            embeds, pooled = self.text_cache.lookup(unique, encode=encode, device=self.device)
        else:
            embeds, pooled = self.encode_chunks(unique)
        if self.cond_dtype is not None:
            embeds, pooled = embeds.to(self.cond_dtype), pooled.to(self.cond_dtype)
        position = {p: i for i, p in enumerate(unique)}
        rows = torch.tensor([position[p] for p in prompts], dtype=torch.long, device=embeds.device)
        cond = TextCond(embeds[rows], pooled[rows])
        if negative:
            negatives = torch.full_like(rows, position[self.negative_prompt])
            cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds = embeds[negatives], pooled[negatives]
        return self.finish_cond(cond)

    @torch.no_grad()
    def encode_chunks(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The live text encoders: (embeds ``[B, L, D]``, pooled ``[B, P]``) on the policy's device, computed in
        calls of exactly ``TEXT_CHUNK`` prompts, wherever the encoders are (GPU, or CPU with
        ``model.text_encoder_device=cpu``). Always without autograd: grad mode can pick other kernels."""
        if not self.text_encoders():
            raise RuntimeError("the text encoders were freed (model.free_text_encoders); only cached prompts can be "
                               "encoded: set model.text_cache=disk or model.free_text_encoders=false")
        prompts = list(prompts)
        padded = prompts + [""] * (-len(prompts) % TEXT_CHUNK)
        device = next(self.text_encoders()[0].parameters()).device
        parts = [self.encode_batch(padded[i:i + TEXT_CHUNK], device) for i in range(0, len(padded), TEXT_CHUNK)]
        embeds = torch.cat([e for e, _ in parts])[:len(prompts)]
        pooled = torch.cat([p for _, p in parts])[:len(prompts)]
        return embeds.to(self.device), pooled.to(self.device)

    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of the family's text encoders on ``device`` -> (embeds ``[B, L, D]``, pooled ``[B, P]``)."""
        raise NotImplementedError

    @classmethod
    def index_mismatch(cls, index: dict) -> str | None:
        """Why a model_index.json of this family's pipeline class still is not this family's model (None: it is).
        Families that share a pipeline class (Wan2.1 and Wan2.2 TI2V) tell their folders apart here."""
        return None

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        """The family's tiny random-weight diffusers pipeline (``model.path=tiny``), built offline."""
        raise NotImplementedError

    @classmethod
    def load_exported_lora(cls, pipeline, directory) -> None:
        """Load a flowrl LoRA export (``directory``) into a plain diffusers ``pipeline`` of the family, as its users
        do: ``load_lora_weights(directory)``. Two-expert families load a file per expert."""
        pipeline.load_lora_weights(directory)

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """The family's own diffusers pipeline, called for the images an ODE :func:`flowrl.sampling.rollout` of
        the same seeds makes (``noise_level=0``): ``[N, 3, H, W]`` in [0, 1] (video ``[N, T, 3, H, W]``).
        The reference of the parity tests and of ``scripts/bench/rollout.py``."""
        from flowrl.core.seeding import generators

        return self.pipeline(
            prompt=list(prompts), negative_prompt=self.negative_prompts(len(prompts)),
            num_images_per_prompt=group_size, num_inference_steps=num_steps,
            guidance_scale=guidance_scale, height=self.height, width=self.width,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length,
        ).images

    def negative_prompts(self, num_prompts: int) -> list[str]:
        """``negative_prompt`` once per prompt, as a pipeline's ``negative_prompt`` argument takes it."""
        return [self.negative_prompt] * num_prompts

    def example_metadata(self, num_prompts: int) -> list[dict] | None:
        """Per-prompt metadata a benchmark or smoke run of this family needs (an editing family's source
        images); None where prompts alone suffice."""
        return None

    def finish_cond(self, cond: TextCond) -> TextCond:
        """Family-specific fields derived from the embeddings (FLUX's text position ids)."""
        return cond

    def free_text_encoders(self) -> None:
        """Delete the text encoders (every prompt the run uses must be in ``text_cache``) and release their memory."""
        import gc

        for name in TEXT_ENCODER_COMPONENTS:
            if getattr(self.pipeline, name, None) is not None:
                setattr(self.pipeline, name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- LoRA ----------------------------------------------------------------------------
    def add_lora(self, *, rank: int = 32, alpha: float = 64.0, target_modules: Sequence[str] | None = None,
                 dropout: float = 0.0, init_seed: int | None = None, experts: Sequence[str] | None = None) -> None:
        """Freeze the base transformer and attach a trainable peft LoRA (kept in float32); ``experts``
        (``lora.experts``) picks which experts of a two-expert family carry it."""
        from peft import LoraConfig

        self.transformer.requires_grad_(False)
        self.vae.requires_grad_(False)
        for encoder in self.text_encoders():
            encoder.requires_grad_(False)
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            init_lora_weights="gaussian",
            target_modules=list(target_modules or self.default_lora_targets()),
        )
        fork = torch.random.fork_rng(devices=[]) if init_seed is not None else contextlib.nullcontext()
        with fork:
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.attach_adapter(config, experts)
        for param in self.trainable_parameters():
            param.data = param.data.float()
        self.has_lora = True

    def attach_adapter(self, config, experts: Sequence[str] | None) -> None:
        """Attach the peft LoRA ``config`` to the transformer. One transformer here: ``experts`` is refused."""
        if experts is not None:
            raise ValueError(f"lora.experts: {self.family} has one transformer; the key is for two-expert families "
                             "(wan22_t2v, wan22_i2v): remove it")
        self.transformer.add_adapter(config)

    def default_lora_targets(self) -> tuple[str, ...]:
        raise NotImplementedError

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]

    # --- what is trained: a LoRA or the transformer's own weights ------------------------------------
    def train_full(self, patterns: Sequence[str] = ()) -> None:
        """Full fine-tuning: the transformer's weights (those of the modules ``patterns`` match, all without) become
        trainable float32 master weights, the rest frozen (:mod:`flowrl.models.full_weights`)."""
        from flowrl.models.full_weights import make_full_trainable

        make_full_trainable(self, patterns)

    def trained_state(self, *, keep: bool = True) -> dict[str, torch.Tensor]:
        """Whole CPU float32 copies of what is trained: the LoRA (``lora_state_dict`` keys, a preference embedding
        included) or the full weights (parameter names). Collective under FSDP2: every process calls it; with
        ``keep=False`` (a process that writes nothing) it returns ``{}``."""
        if self.full_weights is not None:
            from flowrl.models.full_weights import trained_state

            return trained_state(self, keep=keep)
        from flowrl.models.lora_io import lora_state_dict

        return lora_state_dict(self.transformer, keep=keep)

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put a :meth:`trained_state` back into the live weights."""
        if self.full_weights is not None:
            from flowrl.models.full_weights import load_trained_state

            load_trained_state(self, state)
            return
        from flowrl.models.lora_io import load_adapter_state

        load_adapter_state(self.transformer, state)

    def trained_config(self) -> dict:
        """JSON-safe description of what is trained: the peft LoRA config, or the full-training one."""
        if self.full_weights is not None:
            return self.full_weights.config()
        from flowrl.models.lora_io import lora_config_dict

        return lora_config_dict(self.transformer)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base model: the LoRA adapter (and a preference embedding) switched off for the block; with
        full training, the base weights swapped in (:meth:`FullWeights.base_swapped`)."""
        with self.preference_off():
            if self.full_weights is not None:
                with self.local_forward(), self.full_weights.base_swapped():
                    yield
                return
            if not self.has_lora:
                yield
                return
            with self.local_forward():
                self.transformer.disable_adapters()
                try:
                    yield
                finally:
                    self.transformer.enable_adapters()

    @contextlib.contextmanager
    def preference_off(self) -> Iterator[None]:
        """The preference embedding adds nothing for the duration of the block (none attached: nothing to do)."""
        if self.preference is None:
            yield
            return
        enabled, self.preference.enabled = self.preference.enabled, False
        try:
            yield
        finally:
            self.preference.enabled = enabled

    @contextlib.contextmanager
    def local_forward(self) -> Iterator[None]:
        """Bypass the distributed wrapper: gradient-free passes (rollouts, reference) need no syncing."""
        wrapper, self.forward_module = self.forward_module, None
        try:
            yield
        finally:
            self.forward_module = wrapper

    def text_encoders(self) -> list[torch.nn.Module]:
        return [m for m in (getattr(self.pipeline, n, None) for n in TEXT_ENCODER_COMPONENTS) if m is not None]

    # --- latents <-> images ---------------------------------------------------------------
    def init_noise(self, n: int, generator=None) -> torch.Tensor:
        """Initial noise ``[n, C, h, w]`` drawn exactly as the diffusers pipeline draws it."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(self.latent_shape(n), generator=generator, device=self.device, dtype=self.dtype)

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's own shifted sigmas, ``[num_steps + 1]`` ending at 0: a static shift (SD3, Wan) lives in
        the scheduler config. Families with a dynamic shift override this."""
        import copy

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[N, C, h, w]`` -> images ``[N, 3, H, W]`` in [0, 1] (float32)."""
        config = self.vae.config
        scaled = latents.to(self.vae.dtype) / config.scaling_factor + (config.shift_factor or 0.0)
        images = self.vae.decode(scaled, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def real_token_mask(embeds: torch.Tensor) -> torch.Tensor:
    """``[B, L, D]`` -> ``[B, L]`` bool, True on the rows that are not all zeros.

    Families whose transformer masks text padding (Qwen-Image, Z-Image) pad with rows of exact zeros, while a
    real token's embedding (an LLM's hidden state) is never all-zero: the mask is rebuilt from the embeddings
    alone, so the text cache stores nothing else."""
    return embeds.ne(0).any(dim=-1)


def with_padding_masks(cond: TextCond) -> TextCond:
    """``cond`` with ``prompt_mask`` (and ``negative_prompt_mask``) rebuilt from the zero padding."""
    cond.prompt_mask = real_token_mask(cond.prompt_embeds)
    if cond.has_negative:
        cond.negative_prompt_mask = real_token_mask(cond.negative_prompt_embeds)
    return cond


def unnormalise_latents(latents: torch.Tensor, vae) -> torch.Tensor:
    """``[N, C, F, h, w]`` latents in the VAE's dtype, its per-channel ``latents_mean`` / ``latents_std`` undone in
    the Wan-family pipelines' own arithmetic (``x / (1 / std) + mean``: Wan and Qwen-Image share the VAE)."""
    config = vae.config
    latents = latents.to(vae.dtype)
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
    return latents / inv_std + mean


def load_pipeline(pipeline_class, model: str, *, dtype: torch.dtype | dict[str, torch.dtype], device="cpu",
                  **kwargs):
    """Load a diffusers pipeline by hub id or local directory, with a one-line error when missing; ``dtype`` one for
    every component or ``{component: dtype, "default": dtype}`` (:func:`component_dtypes`)."""
    try:
        pipeline = pipeline_class.from_pretrained(model, dtype=dtype, **kwargs)  # torch_dtype is deprecated
    except (OSError, ValueError) as error:  # diffusers raises OSError for missing repos/files
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(
            f"could not load {pipeline_class.__name__} from {model!r}: {first_line} "
            "(pass a local path or a hub id you can reach; set HF_HUB_OFFLINE=0 to download)"
        ) from error
    pipeline.set_progress_bar_config(disable=True)
    return pipeline.to(device)


def component_dtypes(dtype: str | torch.dtype, *, text_encoder_dtype: str | torch.dtype | None = None,
                     vae_dtype: str | torch.dtype | None = None) -> dict[str, torch.dtype]:
    """``{pipeline component: dtype}`` in diffusers' per-component form (``from_pretrained(dtype=...)``):
    ``"default"`` for every component not named, the transformer among them; the text encoders and the VAE
    take ``text_encoder_dtype`` / ``vae_dtype`` where given (``model.text_encoder_dtype``, ``model.vae_dtype``).
    Flow-GRPO's placement is ``component_dtypes("float32", text_encoder_dtype="float16")``: a float32
    transformer (and LoRA) and VAE, the text encoders in the autocast dtype."""
    dtypes = {"default": resolve_dtype(dtype)}
    if text_encoder_dtype is not None:
        dtypes.update(dict.fromkeys(TEXT_ENCODER_COMPONENTS, resolve_dtype(text_encoder_dtype)))
    if vae_dtype is not None:
        dtypes["vae"] = resolve_dtype(vae_dtype)
    return dtypes


def cast_components(pipeline, dtypes: dict[str, torch.dtype]) -> None:
    """Cast each module of a built pipeline to its dtype in ``dtypes`` (:func:`component_dtypes`), the rule
    diffusers' ``from_pretrained`` applies to a loaded one; a module already in its dtype is left alone."""
    for name, module in pipeline.components.items():
        dtype = dtypes.get(name, dtypes["default"])
        if isinstance(module, torch.nn.Module) and any(p.dtype != dtype for p in module.parameters()):
            module.to(dtype=dtype)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'fp32' | 'bfloat16' | 'bf16' | 'float16' | 'fp16' -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype
