"""Full-size SD3.5-Medium and FLUX.1-dev on one NVIDIA GPU: flowrl's rollout and train step against the bare
transformer, peak memory per stage, SDPA against xformers. Random weights, no downloads, no internet.

    python scripts/bench/gpu_full_size.py --out bench_gpu.json          # both families, ~4-6 min on an H100/H200
    python scripts/bench/gpu_full_size.py --family flux --micro-batch 4
    python scripts/bench/gpu_full_size.py --quick --device cpu          # tiny configs, a smoke test in seconds

What is built. The transformers come from the published architecture configs in
``configs/models/sd35_medium_transformer.json`` and ``configs/models/flux1_dev_transformer.json`` (2.243B and
11.901B parameters), constructed directly on the GPU in bf16 (default dtype bf16 under ``torch.device``: no fp32
copy, no meta-device buffers left uninitialised) with torch's default random init. Each is put into a real
diffusers pipeline object (``StableDiffusion3Pipeline`` / ``FluxPipeline``) with the published scheduler, a
~40k-parameter VAE (it only sets ``vae_scale_factor`` = 8; nothing is decoded) and no text encoders, and that
pipeline into flowrl's own ``SD3Policy`` / ``FluxPolicy``, which adds the LoRA (``PolicyBase.add_lora``: r = 32,
alpha 64, the family's default targets, fp32 adapter weights). So every flowrl number below runs flowrl's code:
``flowrl.sampling.rollout`` (per-row generators, SDE steps, log-probs, stored latents) and
``flowrl.recipes.grpo.transition_loss`` (velocity with CFG / FLUX packing and guidance embedding, exact SDE
log-prob of the stored next state, clipped GRPO loss, statistics) under accelerate's bf16 autocast. Text
conditioning is random embeddings of the real shapes (SD3: 77 CLIP + 256 T5 tokens of width 4096, pooled 2048;
FLUX: 512 T5 tokens, pooled 768), passed to the rollout as a ``TextCond``; latents are 512 px (64x64x16;
FLUX packs them into 1024 tokens of 64).

What is measured (CUDA events around each call, ``torch.cuda.synchronize`` after; one warm-up of each
function first, then the repeats interleaved, medians reported):

- ``model load``: building the transformer + LoRA (random init, not a checkpoint read) and the memory it holds.
- ``rollout``: one group of ``--group`` (24) trajectories, ``--steps`` (10) SDE steps with log-probs, no decode:
  CFG 4.5 for SD3 (48 transformer rows per step), the guidance embedding 3.5 for FLUX (24 rows). Baseline: a bare
  loop of the same transformer calls on pre-built inputs (CFG mix and an Euler update, FLUX in packed space), the
  lower bound of any sampler; the ratio is flowrl's sampling overhead. (The warm-up runs 2 steps.)
- ``train step``: GRPO ``transition_loss(...).backward()`` on ``--micro-batch`` (8) stored transitions of that
  rollout, beta = 0, against the bare transformer forward + backward of the same rows (``out.square().mean()``,
  CFG-doubled for SD3), with gradient checkpointing off and on; then the same step with the KL reference pass
  (beta = 0.04, checkpointing on), an algorithmic cost, against the same bare step. Out-of-memory is a row.
- peak memory: ``torch.cuda.max_memory_allocated``, reset before the first timed call of each function.
- ``attention``: one no-grad forward of the rollout batch with the default attention (SDPA) and, where ``xformers``
  imports, with ``enable_xformers_memory_efficient_attention()`` (SD3: diffusers' xformers joint processor; FLUX:
  the ``xformers`` backend of diffusers' attention dispatcher).

The FLOPs of one transformer row are counted with ``torch.utils.flop_counter`` on a 1-row call, so the notes
give the bare baselines' achieved TFLOP/s (compare with the GPU's dense bf16 peak: ~990 for H100/H200 SXM).

Budget (FLOP count of the published configs at 512 px: SD3.5-M 2.44 TFLOP per row forward, FLUX.1-dev 21.5;
assumed 300 TFLOP/s achieved, i.e. ~30% of an H100's dense bf16 peak; backward ~2x forward):
- SD3.5-M: rollouts 2 x (2 + 2 x 10 steps) x 48 rows x 2.44 = 5.2 PFLOP; train steps (2 settings x 2 sides x 4
  calls + 4 KL calls) x 16 rows x 3 x 2.44 = 2.6 PFLOP; attention 8 x 48 x 2.44 = 0.9 PFLOP: ~9 PFLOP, 30 s.
- FLUX.1-dev: rollouts 2 x 22 steps x 24 rows x 21.5 = 22.7 PFLOP; train steps 20 calls x 8 rows x 3 x 21.5 =
  10.3 PFLOP; attention 8 x 24 x 21.5 = 4.1 PFLOP: ~37 PFLOP, ~125 s, plus ~20 s to build 12B random weights.
So about 3 minutes of compute, under 8 minutes even at half that rate; ``--family`` halves it.

Output: one markdown table (family, stage, flowrl, baseline, ratio, peak GiB, notes); ``--out FILE`` also writes
it as JSON with the raw seconds and bytes. Without a CUDA device the full mode prints one line and exits 1.
``--quick`` uses tiny configs of the same classes (dual attention and qk-norm included for SD3) so the whole
logic runs in seconds on a CPU (``--device cpu``; memory is then the process's RSS high-water mark).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NO_GPU = "needs an NVIDIA GPU (found none); run with --quick --device cpu for a smoke test"
FAMILIES = ("sd3", "flux")
LABELS = {"sd3": "SD3.5-Medium", "flux": "FLUX.1-dev"}
SPECS = {"sd3": ROOT / "configs/models/sd35_medium_transformer.json",
         "flux": ROOT / "configs/models/flux1_dev_transformer.json"}
GUIDANCE = {"sd3": 4.5, "flux": 3.5}  # the shipped configs' sampling.guidance_scale
NOISE_LEVEL = {"sd3": 0.7, "flux": 0.9}  # ... and sampling.noise_level
KL_BETA = 0.04
STAGES = ("model load", "rollout", "train step (checkpointing off)", "train step (checkpointing on)",
          "train step + KL reference", "attention sdpa", "attention xformers")

# --quick: the same classes shrunk (as flowrl.models.tiny), SD3 with an MMDiT-X dual-attention block and qk-norm.
QUICK_TRANSFORMERS = {
    "sd3": {"sample_size": 8, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 64,
            "caption_projection_dim": 32, "pooled_projection_dim": 48, "pos_embed_max_size": 32,
            "dual_attention_layers": [0], "qk_norm": "rms_norm"},
    "flux": {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
             "num_attention_heads": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32,
             "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]},
}
QUICK_TEXT = {"sd3": {"clip_tokens": 0, "t5_tokens": 16, "pooled_dim": 48},
              "flux": {"clip_tokens": 0, "t5_tokens": 16, "pooled_dim": 32}}


# ----------------------------------------------------------------------------------------- options

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=(*FAMILIES, "both"), default="both")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per rollout (default 10; quick 3)")
    p.add_argument("--group", type=int, default=None, help="trajectories per rollout group (default 24; quick 4)")
    p.add_argument("--resolution", type=int, default=None, help="image side in px (default 512; quick 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="transitions per train step (default 8; quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per function (default: rollouts 2, "
                                                             "train steps and forwards 3; quick 2)")
    p.add_argument("--quick", action="store_true", help="tiny configs of the same classes: seconds, logic only")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (only with --quick)")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", type=Path, default=None, help="also write the table and raw figures as JSON here")
    args = p.parse_args(argv)
    q = args.quick
    args.steps = args.steps or (3 if q else 10)
    args.group = args.group or (4 if q else 24)
    args.resolution = args.resolution or (64 if q else 512)
    args.micro_batch = min(args.micro_batch or (2 if q else 8), args.group)
    args.rollout_repeats = args.repeats or 2
    args.repeats = args.repeats or (2 if q else 3)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the train step uses a middle stored transition)")
    if args.resolution % 16:
        p.error("--resolution must be a multiple of 16 (VAE factor 8, then 2x2 patches)")
    return args


def load_spec(family: str, quick: bool) -> dict:
    """The family's transformer/scheduler/text shapes from configs/models (the transformer shrunk with --quick)."""
    spec = json.loads(SPECS[family].read_text())
    if quick:
        spec["transformer"]["config"] = copy.deepcopy(QUICK_TRANSFORMERS[family])
        spec["text"].update(QUICK_TEXT[family])
    return spec


# ------------------------------------------------------------------------------------ measurement

class Clock:
    """Seconds of one call: CUDA events on a GPU (synchronised after), perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1000


class Memory:
    """Peak memory of a stage: CUDA's max_memory_allocated (reset per stage), else the RSS high-water mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.kind = "max_memory_allocated" if self.cuda else "process RSS high-water mark (not resettable)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None


def timed(functions: dict[str, Callable[[], object]], repeats: int, clock: Clock, memory: Memory,
          warmups: dict[str, Callable[[], object]] | None = None) -> dict[str, tuple[float, int, list[float]]]:
    """{name: (median seconds, peak bytes of its first timed call, all seconds)}: one warm-up call of each
    (``warmups[name]`` if given, else the function itself), then ``repeats`` rounds interleaved."""
    for name, fn in functions.items():
        (warmups or {}).get(name, fn)()
    seconds: dict[str, list[float]] = {name: [] for name in functions}
    peaks: dict[str, int] = {}
    for round_ in range(repeats):
        for name, fn in functions.items():
            if round_ == 0:
                memory.reset()
            seconds[name].append(clock(fn))
            if round_ == 0:
                peaks[name] = memory.peak()
    return {name: (statistics.median(s), peaks[name], s) for name, s in seconds.items()}


def count_flops(fn: Callable[[], object]) -> int | None:
    """FLOPs of one call (matmuls and attention, forward and backward) by torch's flop counter; None if it fails."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            fn()
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001  (a counter gap must not stop the benchmark)
        return None


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- building

@contextlib.contextmanager
def created_in(device: torch.device, dtype: torch.dtype):
    """Modules built inside are born on ``device`` in ``dtype``: no fp32 copy of 12B weights, no cast after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers (SD3's sin-cos position table is computed in fp32) to ``dtype``, as
    ``from_pretrained(torch_dtype=...)`` loads them."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[name] = buffer.to(dtype)


def build_transformer(spec: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer of ``spec`` with torch's default random init, created on ``device`` in ``dtype``."""
    import diffusers

    model_class = getattr(diffusers, spec["transformer"]["class"])
    with created_in(device, dtype):
        model = model_class.from_config(spec["transformer"]["config"])
    cast_buffers(model, dtype)
    return model.eval()


def small_vae(device: torch.device, dtype: torch.dtype):
    """A 4-level AutoencoderKL (so vae_scale_factor = 8, 16 latent channels) of ~40k parameters: the pipeline
    and PolicyBase.add_lora expect a VAE; the benchmark never decodes."""
    from diffusers import AutoencoderKL

    with created_in(device, dtype):
        return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                             up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                             layers_per_block=1, norm_num_groups=4, latent_channels=16, use_quant_conv=False,
                             use_post_quant_conv=False).eval()


def build_bench_policy(family: str, spec: dict, *, device: torch.device, dtype: torch.dtype, resolution: int):
    """flowrl's policy adapter around a pipeline of the random transformer, the published scheduler and no text
    encoders; LoRA r = 32 added by the policy itself."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    from flowrl.models.flux import FluxPolicy
    from flowrl.models.sd3 import SD3Policy

    transformer = build_transformer(spec, device, dtype)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(spec["scheduler"]["config"])
    vae = small_vae(device, dtype)
    if family == "sd3":
        pipeline = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=None,
                                            tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                            text_encoder_3=None, tokenizer_3=None)
        policy = SD3Policy(pipeline, height=resolution, width=resolution,
                           max_sequence_length=spec["text"]["t5_tokens"])
    else:
        pipeline = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=None,
                                tokenizer=None, text_encoder_2=None, tokenizer_2=None)
        policy = FluxPolicy(pipeline, height=resolution, width=resolution,
                            max_sequence_length=spec["text"]["t5_tokens"])
    policy.add_lora(rank=32, alpha=64.0, init_seed=0)
    return policy


def random_cond(policy, family: str, spec: dict):
    """A one-prompt TextCond of the real shapes (SD3: CLIP + T5 tokens and the CFG negative; FLUX: T5 + ids)."""
    from flowrl.models.base import TextCond

    text, width = spec["text"], spec["transformer"]["config"]["joint_attention_dim"]
    tokens = text["clip_tokens"] + text["t5_tokens"]
    g = torch.Generator(device=policy.device).manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=g, device=policy.device).to(policy.dtype)  # noqa: E731
    if family == "sd3":
        return TextCond(draw(1, tokens, width), draw(1, text["pooled_dim"]),
                        negative_prompt_embeds=draw(1, tokens, width),
                        negative_pooled_prompt_embeds=draw(1, text["pooled_dim"]))
    return policy.finish_cond(TextCond(draw(1, tokens, width), draw(1, text["pooled_dim"])))


class BareTransformer:
    """The transformer called directly on pre-built inputs: the baselines flowrl is compared with."""

    def __init__(self, policy, family: str, cond, guidance: float):
        self.policy, self.family, self.guidance = policy, family, guidance
        self.transformer = policy.transformer
        self.cond = cond
        _, _, self.h, self.w = policy.latent_shape(1)

    def inputs(self, rows: int, sigma: torch.Tensor) -> dict:
        """Keyword arguments of one transformer call on ``rows`` trajectories at ``sigma`` (a 0-d device tensor);
        SD3 doubles the rows for CFG (negative first, as flowrl and diffusers do)."""
        c, dev = self.cond, self.policy.device
        if self.family == "sd3":
            embeds = torch.cat([c.negative_prompt_embeds.expand(rows, -1, -1), c.prompt_embeds.expand(rows, -1, -1)])
            pooled = torch.cat([c.negative_pooled_prompt_embeds.expand(rows, -1),
                                c.pooled_prompt_embeds.expand(rows, -1)])
            return dict(timestep=self.timestep(rows, sigma), encoder_hidden_states=embeds, pooled_projections=pooled)
        return dict(timestep=self.timestep(rows, sigma), encoder_hidden_states=c.prompt_embeds.expand(rows, -1, -1),
                    pooled_projections=c.pooled_prompt_embeds.expand(rows, -1), txt_ids=c.text_ids,
                    img_ids=self.policy.image_ids(self.h, self.w),
                    guidance=torch.full((rows,), self.guidance, device=dev, dtype=torch.float32))

    def timestep(self, rows: int, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep input: SD3 sigma * 1000 for each CFG row, FLUX sigma in the model dtype."""
        if self.family == "sd3":
            return (sigma * 1000).expand(2 * rows)
        return sigma.to(self.policy.dtype).expand(rows)

    def latents(self, rows: int) -> torch.Tensor:
        """Random latents in the transformer's own layout (FLUX: already packed)."""
        x = torch.randn(self.policy.latent_shape(rows), device=self.policy.device, dtype=self.policy.dtype)
        return self.policy.pack(x) if self.family == "flux" else x

    def forward(self, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        hidden = torch.cat([x, x]) if self.family == "sd3" else x
        return self.transformer(hidden_states=hidden, return_dict=False, **kwargs)[0]

    @torch.no_grad()
    def loop(self, rows: int, sigmas: torch.Tensor) -> torch.Tensor:
        """The bare sampler: transformer calls, CFG mix (SD3), Euler update; conditioning built once."""
        x, sigmas = self.latents(rows), sigmas.to(self.policy.device)
        kwargs = self.inputs(rows, sigmas[0])
        for i in range(len(sigmas) - 1):
            kwargs["timestep"] = self.timestep(rows, sigmas[i])
            out = self.forward(x, kwargs)
            if self.family == "sd3":
                uncond, text = out.chunk(2)
                out = uncond + self.guidance * (text - uncond)
            x = x + (sigmas[i + 1] - sigmas[i]) * out
        return x


def attempt(fn: Callable[[], object]) -> tuple[object, bool]:
    """(fn(), False), or (None, True) when the device ran out of memory; then the failed call's tensors are
    released (outside the ``except`` block, whose traceback would keep them alive)."""
    try:
        return fn(), False
    except RuntimeError as error:
        if not is_oom(error):
            raise
    free_memory()
    return None, True


# -------------------------------------------------------------------------------------- the stages

def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def count_text(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3f}{unit}" if unit == "B" else f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def flops_text(flops: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def bench_family(family: str, args, accelerator, clock: Clock, memory: Memory) -> list[dict]:
    from flowrl.algorithms.losses import POLICY_LOSSES
    from flowrl.recipes.grpo import transition_loss
    from flowrl.sampling import rollout, root_seeds
    from flowrl.training.stats import StatsAccumulator

    device, dtype = accelerator.device, args.torch_dtype
    spec = load_spec(family, args.quick)
    rows: list[dict] = []

    def row(stage: str, flowrl=None, baseline=None, peak=None, baseline_peak=None, note: str = "") -> None:
        ratio = flowrl / baseline if flowrl is not None and baseline else None
        rows.append(dict(family=family, stage=stage, flowrl_s=flowrl, baseline_s=baseline, ratio=ratio,
                         peak_bytes=peak, baseline_peak_bytes=baseline_peak, note=note))

    # 1. Model load: random transformer + LoRA, on the device.
    free_memory()
    memory.reset()
    start = time.perf_counter()
    policy = build_bench_policy(family, spec, device=device, dtype=dtype, resolution=args.resolution)
    if clock.cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    params = sum(p.numel() for p in policy.transformer.parameters())
    lora = sum(p.numel() for p in policy.trainable_parameters())
    resident = memory.allocated()
    row("model load", load_s, None, memory.peak(), None,
        f"{count_text(params)} params incl. LoRA {count_text(lora)} (r=32, fp32); random init, not a checkpoint read"
        + ("" if resident is None else f"; {gib(resident):.2f} GiB resident"))

    guidance, noise_level = GUIDANCE[family], NOISE_LEVEL[family]
    cond = random_cond(policy, family, spec)
    bare = BareTransformer(policy, family, cond, guidance)
    group, steps = args.group, args.steps
    seeds = root_seeds(0, 0, group)
    transformer_rows = group * (2 if family == "sd3" else 1)

    # FLOPs of one transformer row (forward), for achieved TFLOP/s of the baselines.
    one_sigma = policy.sigmas(steps)[1].to(device)
    one_x = bare.latents(1)
    with torch.no_grad():
        row_flops = count_flops(lambda: bare.forward(one_x, bare.inputs(1, one_sigma)))
    if row_flops is not None and family == "sd3":
        row_flops //= 2  # the 1-trajectory call ran 2 CFG rows
    flops_note = "" if row_flops is None else f"{flops_text(row_flops)} per transformer row forward"

    def tflops(flops: float | None, seconds: float | None) -> str:
        return "" if flops is None or not seconds else f"; bare {flops_text(flops / seconds)}/s"

    # 2. Rollout: flowrl's SDE rollout with log-probs against the bare loop.
    def flowrl_rollout(n: int = steps):
        return rollout(policy, ["benchmark prompt"], group_size=group, num_steps=n, guidance_scale=guidance,
                       noise_level=noise_level, seeds=seeds, kind="sde", cond=cond, decode=False)

    sigmas, warm_sigmas = policy.sigmas(steps), policy.sigmas(2)
    result = timed({"flowrl": flowrl_rollout, "bare": lambda: bare.loop(group, sigmas)}, args.rollout_repeats,
                   clock, memory, warmups={"flowrl": lambda: flowrl_rollout(2), "bare": lambda: bare.loop(group, warm_sigmas)})
    (flowrl_s, flowrl_peak, _), (bare_s, bare_peak, _) = result["flowrl"], result["bare"]
    traj = flowrl_rollout()
    finite = bool(torch.isfinite(traj.log_probs).all() and torch.isfinite(traj.final_latents).all())
    row("rollout", flowrl_s, bare_s, flowrl_peak, bare_peak,
        f"G={group}, {steps} SDE steps, {args.resolution} px, {transformer_rows} rows/step "
        f"({'CFG ' + str(guidance) if family == 'sd3' else 'guidance embedding ' + str(guidance)}); "
        f"extra {1e3 * (flowrl_s - bare_s) / steps:+.1f} ms/step; log-probs finite: {finite}"
        + tflops(None if row_flops is None else row_flops * transformer_rows * steps, bare_s))

    # 3. Train step: GRPO transition loss forward + backward against the bare forward + backward.
    micro = args.micro_batch
    traj.advantages = torch.randn(traj.num_rows, traj.num_stored_steps, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(traj.num_rows, traj.num_stored_steps, dtype=torch.bool)
    train_rows, k = torch.arange(micro), traj.num_stored_steps // 2
    params_list = policy.trainable_parameters()
    x_bare, sigma_k = bare.latents(micro), traj.sigmas[k].to(device)
    bare_kwargs = bare.inputs(micro, sigma_k)

    def zero_grad() -> None:
        for p in params_list:
            p.grad = None

    def flowrl_step(beta: float = 0.0) -> None:
        zero_grad()
        loss = transition_loss(policy, traj, train_rows, k, mask, accelerator=accelerator, guidance=guidance,
                               noise_level=noise_level, kind="sde", beta=beta, policy_loss=POLICY_LOSSES["grpo-clip"],
                               clip_low=1e-4, clip_high=1e-4, stats=StatsAccumulator(), on_policy=False)
        loss.backward()

    def bare_step(x=x_bare, kwargs=bare_kwargs) -> None:
        zero_grad()
        with accelerator.autocast():
            out = bare.forward(x, kwargs)
        out.float().square().mean().backward()

    step_rows = micro * (2 if family == "sd3" else 1)
    step_flops = count_flops(lambda: bare_step(bare.latents(1), bare.inputs(1, sigma_k)))
    bare_on = None
    for checkpointing in (False, True):
        stage = f"train step (checkpointing {'on' if checkpointing else 'off'})"
        if checkpointing:
            policy.transformer.enable_gradient_checkpointing()
        else:
            policy.transformer.disable_gradient_checkpointing()
        result, oom = attempt(lambda: timed({"flowrl": flowrl_step, "bare": bare_step}, args.repeats, clock, memory))
        if oom:
            zero_grad()
            free_memory()
            row(stage, note=f"out of memory at micro-batch {micro} ({step_rows} rows): turn checkpointing on or "
                            f"use --micro-batch {max(1, micro // 2)}")
            continue
        (flowrl_s, flowrl_peak, _), (bare_s, bare_peak, _) = result["flowrl"], result["bare"]
        bare_on = bare_s if checkpointing else bare_on
        flops = None if step_flops is None else step_flops * micro  # 1 trajectory (SD3: its 2 CFG rows) x micro
        row(stage, flowrl_s, bare_s, flowrl_peak, bare_peak,
            f"micro-batch {micro} ({step_rows} rows), beta=0" + ("" if checkpointing else tflops(flops, bare_s)))
    result, oom = attempt(lambda: timed({"flowrl": lambda: flowrl_step(KL_BETA)}, args.repeats, clock, memory))
    if oom:
        zero_grad()
        free_memory()
        row("train step + KL reference", note=f"out of memory at micro-batch {micro}")
    else:
        kl_s, kl_peak, _ = result["flowrl"]
        row("train step + KL reference", kl_s, bare_on, kl_peak, None,
            f"beta={KL_BETA}, checkpointing on: + one no-grad pass with the adapter off; baseline = the bare step "
            "with checkpointing on")
    policy.transformer.disable_gradient_checkpointing()
    zero_grad()
    del traj
    free_memory()

    # 4. Attention: one no-grad forward of the rollout batch, SDPA and xformers.
    x_attn, attn_kwargs = bare.latents(group), bare.inputs(group, sigmas[1].to(device))
    forward = torch.no_grad()(lambda: bare.forward(x_attn, attn_kwargs))
    sdpa_s, sdpa_peak, _ = timed({"sdpa": forward}, args.repeats, clock, memory)["sdpa"]
    row("attention sdpa", sdpa_s, sdpa_s, sdpa_peak, None,
        f"one forward of {transformer_rows} rows, torch scaled_dot_product_attention (diffusers' default)"
        + tflops(None if row_flops is None else row_flops * transformer_rows, sdpa_s))
    if importlib.util.find_spec("xformers") is None:
        row("attention xformers", note="not installed (pip install xformers matching the torch build)")
    elif not clock.cuda:
        row("attention xformers", note="installed, but xformers' attention needs a CUDA device")
    else:
        try:
            policy.transformer.enable_xformers_memory_efficient_attention()
            xf_s, xf_peak, _ = timed({"xformers": forward}, args.repeats, clock, memory)["xformers"]
            row("attention xformers", xf_s, sdpa_s, xf_peak, sdpa_peak,
                f"enable_xformers_memory_efficient_attention(); baseline = SDPA forward")
        except Exception as error:  # noqa: BLE001  (an xformers/torch mismatch is a row, not a crash)
            row("attention xformers", note=f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
    for r in rows:
        if flops_note and r["stage"] == "model load":
            r["note"] += f"; {flops_note}"
    del policy, bare
    free_memory()
    return rows


# ------------------------------------------------------------------------------------------ output

def markdown(rows: list[dict], memory_kind: str) -> str:
    lines = ["| family | stage | flowrl | baseline | ratio | peak GiB (flowrl / baseline) | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{gib(r['peak_bytes']):.2f}"
        if r["baseline_peak_bytes"] is not None:
            peak += f" / {gib(r['baseline_peak_bytes']):.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {LABELS[r['family']]} | {r['stage']} | {seconds_text(r['flowrl_s'])} | "
                     f"{seconds_text(r['baseline_s'])} | {ratio} | {peak} | {r['note']} |")
    lines.append(f"(memory: {memory_kind})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() or device.type == "cpu" and not args.quick:
        print(NO_GPU)
        return 1
    from accelerate import Accelerator

    from flowrl.models.base import resolve_dtype

    args.torch_dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    precision = "bf16" if args.torch_dtype == torch.bfloat16 and device.type == "cuda" else "no"
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision)
    clock, memory = Clock(device), Memory(device)
    families = FAMILIES if args.family == "both" else (args.family,)
    start = time.perf_counter()
    rows = []
    for family in families:
        rows += bench_family(family, args, accelerator, clock, memory)
    wall = time.perf_counter() - start
    table = markdown(rows, memory.kind)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"gpu_full_size: {'quick (tiny configs)' if args.quick else 'full size'} on {name}, "
          f"{args.torch_dtype}, torch {torch.__version__}; {wall:.0f} s")
    print(table)
    if args.out is not None:
        meta = dict(device=name, quick=args.quick, dtype=str(args.torch_dtype), torch=torch.__version__,
                    steps=args.steps, group=args.group, resolution=args.resolution, micro_batch=args.micro_batch,
                    repeats=args.repeats, rollout_repeats=args.rollout_repeats, wall_s=wall, memory=memory.kind)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows, table=table), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
