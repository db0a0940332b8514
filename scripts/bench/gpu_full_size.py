"""Full-size flowrl model families on one NVIDIA GPU: flowrl's rollout and train step against the bare
transformer, peak memory per stage, SDPA against xformers. Random weights, no downloads, no internet.

    python scripts/bench/gpu_full_size.py --family all --out bench_gpu.json   # all 7, ~4-6 min on an H200
    python scripts/bench/gpu_full_size.py --out bench_gpu.json                # both = sd3 + flux, as before
    python scripts/bench/gpu_full_size.py --family qwen_image --micro-batch 2
    python scripts/bench/gpu_full_size.py --quick --device cpu --family all   # tiny configs, ~15 s on a CPU
    python scripts/bench/gpu_full_size.py --count-flops --family all          # FLOPs per row on meta, CPU

What is built. Every family's transformer comes from its architecture config in ``configs/models/*.json`` (each
file's ``_comment`` names its source; parameters counted on the meta device: SD3.5-M 2.243B, FLUX.1-dev and
Kontext-dev 11.901B, FLUX.2-klein-4B 3.876B, Qwen-Image 20.430B, Z-Image-Turbo 6.155B, Wan2.1-T2V-1.3B 1.419B),
created on the GPU in bf16 with torch's default random init. It goes into the family's own diffusers pipeline
class with the published scheduler and the components of the family's tiny pipeline (``policy_class(f).
tiny_pipeline(0)``: its VAE has the real scale factors and latent channels; nothing is decoded; text encoders
removed), and that into flowrl's adapter (``policy_class(f)``), which adds the LoRA (r = 32, alpha 64, the
family's default targets, fp32). Text conditioning is a random ``TextCond`` of the family's real shapes
(``text`` in the JSON: tokens x width, pooled width, the real-token count of families that mask or trim their
padding, the empty negative) through the adapter's own ``finish_cond``; Kontext adds a source latent of the
output size. Sampling settings (guidance, noise level, px) are each family's shipped ``configs/<family>/``
recipe (``SAMPLING``); Wan renders 5-frame clips. So every flowrl number runs flowrl's code:
``flowrl.sampling.rollout`` and ``flowrl.algorithms.transition.transition_loss`` under accelerate's bf16 autocast.

The baseline. ``capture_calls`` records the keyword arguments of every transformer call the adapter's
``velocity`` makes (packing, ids, CFG batched or as two passes, text trimmed, Z-Image's lists) without running
the model; the bare loop replays exactly those calls on the transformer, ``steps`` times. So the ratio is what
flowrl adds around the same model calls (adapter packing and CFG mix, SDE step, log-probs, storage, per-row
generators), for any family, without hand-built inputs. For SD3 and FLUX the calls are the ones the old
hand-built baseline made (the FLOP count per row is unchanged: 2.443 and 21.50 TFLOP); the bare loop no longer
does the CFG mix and Euler update (elementwise, well under 1 ms per step at 512 px), and replays fixed inputs
rather than feeding its output back (same kernels, same shapes).

What is measured (CUDA events, ``torch.cuda.synchronize`` after; a warm-up of each function, then the repeats
interleaved, medians): ``model load`` (build + LoRA, memory held); ``rollout`` (one group of ``--group``
trajectories, ``--steps`` SDE steps with log-probs, no decode; warm-up 2 steps); ``train step``: GRPO
``transition_loss(...).backward()`` on ``--micro-batch`` stored transitions (beta 0) against the bare forward +
backward of the same recorded calls (``out.square().mean()``), checkpointing off and on, then with the KL
reference (beta 0.04) against the bare step with checkpointing on; out-of-memory is a row; peak memory
``max_memory_allocated``, reset before each function's first timed call; ``attention``: one no-grad forward of
the rollout calls with SDPA and, where ``xformers`` imports, after ``enable_xformers_memory_efficient_attention()``
(a family whose processors refuse it gets a "failed" row). FLOPs per row (``torch.utils.flop_counter``) give the
bare baselines' TFLOP/s (H200 dense bf16 peak ~990).

Budget (``--count-flops``; forward TFLOP per transformer row, rows per trajectory-step): SD3.5-M 512 px 2.443 x 2
(CFG batched), FLUX.1-dev 512 px 21.50 x 1, Kontext 384 px 23.44 x 1 (576 noisy + 576 source tokens), klein-4B
384 px 7.06 x 1 (distilled, unguided), Qwen-Image 512 px 15.23 x 2 (true CFG, two passes; 64 / 6 real text
tokens assumed), Z-Image-Turbo 512 px 12.90 x 1 (unguided), Wan 256 px x 5 frames 1.53 x 2 (two passes).
``--family all`` defaults to G = 8, 4 steps, micro-batch 4, 2 repeats; then per family (backward = 2x forward,
recompute +1): rollouts 2 x (2 + 2 x 4) x 8 = 160, train 228, attention 48 row-forwards x rows x F: SD3 2.1,
FLUX 9.4, Kontext 10.2, klein 3.1, Qwen 13.3, Z-Image 5.6, Wan 1.3 PFLOP = 45 PFLOP, 150 s at an assumed 300
TFLOP/s achieved, plus building 58B random parameters and Python overhead: ~4-6 min, under 8. ``--family both``
keeps the old defaults (G = 24, 10 steps, micro-batch 8, 3 repeats: SD3 ~9, FLUX ~40 PFLOP, ~3 min). Qwen-Image
without checkpointing at micro-batch 4 may not fit 139 GiB (two passes of 4 x 1088 tokens, 60 blocks, 41 GiB of
weights): that row then says out of memory.

Output: one markdown table (family, stage, flowrl, baseline, ratio, peak GiB, notes); ``--out FILE`` also writes
it as JSON with the raw seconds and bytes. Without a CUDA device the full mode prints one line and exits 1.
``--quick`` uses each family's tiny-pipeline transformer (SD3 with a dual-attention block and qk-norm) and its
text length, so the whole logic runs in seconds on a CPU (memory is then the process's RSS high-water mark).
"""

from __future__ import annotations

from functools import partial
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before diffusers reads it: nothing here may download

import torch  # noqa: E402
from gpu_timing import (Bare, Clock, Memory, attempt, call_rows, capture_calls, count_flops,  # noqa: E402
                        count_text, created_in, flops_text, free_memory, gib, markdown, timed, write_json,
                        xformers_forward)

from flowrl.models import FAMILIES, policy_class  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = "needs an NVIDIA GPU (found none); run with --quick --device cpu for a smoke test"
LABELS = {"sd3": "SD3.5-Medium", "flux": "FLUX.1-dev", "flux_kontext": "FLUX.1-Kontext-dev",
          "flux2_klein": "FLUX.2-klein-4B", "flux2_dev": "FLUX.2-dev", "qwen_image": "Qwen-Image",
          "z_image": "Z-Image-Turbo", "wan": "Wan2.1-T2V-1.3B", "wan22_ti2v": "Wan2.2-TI2V-5B",
          "wan22_t2v": "Wan2.2-T2V-A14B", "qwen_image_edit": "Qwen-Image-Edit",
          "qwen_image_edit_plus": "Qwen-Image-Edit-2509", "wan_i2v": "Wan2.1-I2V-14B", "wan22_i2v": "Wan2.2-I2V-A14B",
          "ltx2": "LTX-2", "hunyuan_video15": "HunyuanVideo-1.5-480p-T2V",
          "hunyuan_video15_i2v": "HunyuanVideo-1.5-480p-I2V"}
MODELS = ROOT / "configs/models"
SPECS = {"sd3": MODELS / "sd35_medium_transformer.json", "flux": MODELS / "flux1_dev_transformer.json",
         "flux_kontext": MODELS / "flux1_dev_transformer.json",  # Kontext [dev] is FLUX.1 [dev]'s architecture
         "flux2_klein": MODELS / "flux2_klein_4b_transformer.json", "flux2_dev": MODELS / "flux2_dev_transformer.json",
         "qwen_image": MODELS / "qwen_image_transformer.json", "z_image": MODELS / "z_image_turbo_transformer.json",
         "wan": MODELS / "wan21_t2v_1_3b_transformer.json", "wan22_ti2v": MODELS / "wan22_ti2v_5b_transformer.json",
         "wan22_t2v": MODELS / "wan22_t2v_a14b_transformer.json",  # each of its two experts
         "qwen_image_edit": MODELS / "qwen_image_transformer.json",  # the Edit models run Qwen-Image's architecture
         "qwen_image_edit_plus": MODELS / "qwen_image_transformer.json",
         "wan_i2v": MODELS / "wan21_i2v_14b_transformer.json",
         "wan22_i2v": MODELS / "wan22_i2v_a14b_transformer.json",  # each of its two experts
         "ltx2": MODELS / "ltx2_transformer.json",
         "hunyuan_video15": MODELS / "hunyuan_video15_480p_transformer.json",
         "hunyuan_video15_i2v": MODELS / "hunyuan_video15_480p_transformer.json"}  # one architecture for both
# (guidance_scale, noise_level, resolution) of the shipped configs/<family>/ recipes (sampling.*, model.height).
SAMPLING = {"sd3": (4.5, 0.7, 512), "flux": (3.5, 0.9, 512), "flux_kontext": (2.5, 0.9, 384),
            "flux2_klein": (1.0, 0.5, 384), "flux2_dev": (4.0, 1.0, 512), "qwen_image": (4.0, 1.2, 512), "z_image": (1.0, 0.7, 512),
            "wan": (5.0, 0.9, 256), "wan22_ti2v": (4.0, 0.9, 480), "wan22_t2v": (4.0, 0.9, 480),
            "qwen_image_edit": (4.0, 1.0, 384), "qwen_image_edit_plus": (4.0, 1.0, 384),
            "wan_i2v": (5.0, 0.9, 240), "wan22_i2v": (3.5, 0.9, 480), "ltx2": (1.0, 0.8, 512),
            "hunyuan_video15": (1.0, 0.25, 480), "hunyuan_video15_i2v": (1.0, 0.25, 480)}
QUICK_OVERRIDES = {"sd3": {"dual_attention_layers": [0], "qk_norm": "rms_norm"}}  # MMDiT-X and qk-norm, shrunk
KL_BETA = 0.04
STAGES = ("model load", "rollout", "train step (checkpointing off)", "train step (checkpointing on)",
          "train step + KL reference", "attention sdpa", "attention xformers")
ALL_DEFAULTS = dict(group=8, steps=4, micro_batch=4, repeats=2)  # --family all: the budget in the docstring


# ----------------------------------------------------------------------------------------- options

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=(*FAMILIES, "both", "all"), default="both", help="both = sd3 + flux")
    p.add_argument("--steps", type=int, help="SDE steps per rollout (default 10; all 4; quick 3)")
    p.add_argument("--group", type=int, help="trajectories per group (default 24; all 8; quick 4)")
    p.add_argument("--resolution", type=int, help="px (default: each family's recipe; quick: its tiny size)")
    p.add_argument("--micro-batch", type=int, help="transitions per train step (default 8; all 4; quick 2)")
    p.add_argument("--repeats", type=int, help="timed calls (default: rollouts 2, others 3; all and quick 2)")
    p.add_argument("--quick", action="store_true", help="tiny configs of the same classes: seconds, logic only")
    p.add_argument("--count-flops", action="store_true", help="FLOPs per row of the full models on meta, CPU")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (only with --quick)")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--out", type=Path, default=None, help="also write the table and raw figures as JSON here")
    p.add_argument("--context-parallel", action="store_true",
                   help="only check context parallelism (Ulysses, ring) on every GPU against one: needs 2 or more")
    args = p.parse_args(argv)
    q, light = args.quick, args.family == "all" and not args.quick
    args.steps = args.steps or (3 if q else ALL_DEFAULTS["steps"] if light else 10)
    args.group = args.group or (4 if q else ALL_DEFAULTS["group"] if light else 24)
    args.micro_batch = min(args.micro_batch or (2 if q else ALL_DEFAULTS["micro_batch"] if light else 8), args.group)
    args.rollout_repeats = args.repeats or 2
    args.repeats = args.repeats or (2 if q or light else 3)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the train step uses a middle stored transition)")
    if args.resolution is not None and args.resolution % 16:
        p.error("--resolution must be a multiple of 16 (VAE factor 8, then 2x2 patches)")
    args.families = {"both": ("sd3", "flux"), "all": FAMILIES}.get(args.family, (args.family,))
    return args


def load_spec(family: str, quick: bool, tiny) -> dict:
    """The family's transformer/scheduler/text shapes from configs/models; with --quick the transformer is the
    tiny pipeline's (plus ``QUICK_OVERRIDES``) and the text as long as the tiny pipeline's."""
    spec = json.loads(SPECS[family].read_text())
    text = spec["text"]
    text.setdefault("tokens", text.get("clip_tokens", 0) + text.get("t5_tokens", 0))
    if quick:
        config = {k: v for k, v in dict(tiny.transformer.config).items() if not k.startswith("_")}
        spec["transformer"] = {"class": type(tiny.transformer).__name__,
                               "config": {**config, **QUICK_OVERRIDES.get(family, {})}}
        spec["scheduler"] = dict(config=dict(tiny.scheduler.config))
        short = policy_class(family).tiny_max_sequence_length
        text["tokens"] = min(text["tokens"], short)
        for key in ("real_tokens", "negative_real_tokens"):
            if key in text:
                text[key] = min(text[key], short // 2)
    config = spec["transformer"]["config"]
    text["width"] = (config.get("joint_attention_dim") or config.get("text_dim") or config.get("cap_feat_dim")
                     or 2 * config.get("caption_channels", 0)
                     or config.get("text_embed_dim"))  # HunyuanVideo-1.5: its Qwen2.5-VL states  # LTX-2: its video and audio streams' text, joined
    text["pooled_dim"] = config.get("pooled_projection_dim") or 0
    if "text_embed_2_dim" in config:  # HunyuanVideo-1.5: the pooled slot holds its 256 byT5 glyph states, flattened
        text["pooled_dim"] = 256 * config["text_embed_2_dim"]
    return spec


# --------------------------------------------------------------------------------------- building

def build_transformer(spec: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer of ``spec`` with torch's default random init, created on ``device`` in ``dtype``; floating
    buffers (SD3's fp32 sin-cos table) cast to ``dtype`` as ``from_pretrained(dtype=...)`` loads them, and
    any buffer computed on the CPU whatever the default device (that table again) moved to ``device``."""
    import diffusers

    with created_in(device, dtype):
        model = getattr(diffusers, spec["transformer"]["class"]).from_config(spec["transformer"]["config"])
    for sub in model.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[name] = buffer.to(dtype)
    return model.to(device).eval()


def build_bench_policy(family: str, spec: dict, tiny, *, device: torch.device, dtype: torch.dtype,
                       resolution: int, lora: bool = True):
    """flowrl's policy adapter around the family's own pipeline class: the tiny pipeline's components (its VAE has
    the real scale factors and latent channels; nothing is decoded), the text encoders removed, the random
    full-size (or --quick tiny) transformer and the published scheduler in; LoRA r = 32 added by the policy."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cls = policy_class(family)
    components = dict(tiny.components)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if name in components:
            components[name] = None
    components["transformer"] = build_transformer(spec, device, dtype)
    if components.get("transformer_2") is not None:  # Wan2.2 A14B: the low-noise expert, the same architecture
        components["transformer_2"] = build_transformer(spec, device, dtype)
    components["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(spec["scheduler"]["config"])
    if family.startswith("qwen_image_edit"):  # the tests' tiny edit VAE downsamples x32 (short source token runs);
        from flowrl.models.tiny_qwen_image import tiny_qwen_image_pipeline  # Qwen-Image's tiny VAE has the real x8

        components["vae"] = tiny_qwen_image_pipeline(0).vae
    components["vae"] = components["vae"].to(device=device, dtype=dtype)
    pipeline = type(tiny)(**components, **spec.get("pipeline", {}))
    text = spec["text"]
    scale = (getattr(pipeline, "vae_scale_factor", None) or getattr(pipeline, "vae_scale_factor_spatial", None)
             or pipeline.vae_spatial_compression_ratio)  # Wan: spatial; LTX-2: its compression ratio
    if family != "ltx2":  # LTX-2's tiny VAE compresses x8, the released one x32 (and its audio VAE is tiny too)
        assert scale == text["vae_scale_factor"], (family, scale, text)  # the tiny VAE has the real factors
    extra = {"num_frames": text["num_frames"]} if cls.video else {}
    policy = cls(pipeline, height=resolution, width=resolution, max_sequence_length=text["tokens"], **extra)
    if lora:
        policy.add_lora(rank=32, alpha=64.0, init_seed=0)
    return policy


def random_cond(policy, spec: dict, device):
    """A one-prompt TextCond of the family's real shapes: ``tokens`` x ``width`` embeddings (rows past
    ``real_tokens`` zero: the padding the adapter masks or trims), pooled ``[1, pooled_dim]`` (0 where none),
    the negative likewise, the adapter's own ``finish_cond`` (FLUX ids, masks); Kontext adds a source of the
    output's size, Qwen-Image-Edit one (Plus two) of the output's size, Wan I2V a first frame's condition."""
    from flowrl.models.base import TextCond

    text = spec["text"]
    g = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=policy.dtype)  # noqa: E731

    def embeds(real: int | None) -> torch.Tensor:
        e = draw(1, text["tokens"], text["width"])
        if real is not None:
            e[:, real:] = 0
        return e

    cond = TextCond(embeds(text.get("real_tokens")), draw(1, text["pooled_dim"]),
                    negative_prompt_embeds=embeds(text.get("negative_real_tokens", text.get("real_tokens"))),
                    negative_pooled_prompt_embeds=draw(1, text["pooled_dim"]))
    cond = policy.finish_cond(cond)
    if policy.family == "flux_kontext":
        cond.image_latents = draw(*policy.latent_shape(1))
    if policy.family.startswith("qwen_image_edit"):  # sources of the output's size (real ones are ~1024 px)
        cond.image_latents = draw(1, 2 if policy.several_sources else 1, *policy.latent_shape(1)[1:])
    if policy.family in ("wan_i2v", "wan22_i2v"):  # the first frame: mask + latents [1, T + C, F, h, w], CLIP states
        _, channels, *grid = policy.latent_shape(1)
        cond.image_latents = draw(1, policy.transformer.config.in_channels - channels, *grid)
        image_dim = policy.pipeline.transformer.config.image_dim
        if image_dim is not None:
            cond.image_embeds = draw(1, text.get("image_tokens", 257), image_dim)
    if policy.family == "hunyuan_video15_i2v":  # the first frame: latents [1, C, 1, h, w], SigLIP states [1, T, Di]
        _, channels, _, *grid = policy.latent_shape(1)
        cond.image_latents = draw(1, channels, 1, *grid)
        cond.image_embeds = draw(1, policy.pipeline.vision_num_semantic_tokens, policy.pipeline.vision_states_dim)
    return cond


# -------------------------------------------------------------------------------------- the stages

def bench_family(family: str, args, accelerator, clock: Clock, memory: Memory) -> list[dict]:
    from flowrl.algorithms.losses import grpo_clip_loss
    from flowrl.algorithms.transition import TransitionSettings, transition_loss
    from flowrl.sampling import RolloutSettings, rollout, root_seeds
    from flowrl.training.stats import StatsAccumulator

    device, dtype = accelerator.device, args.torch_dtype
    if family == "ltx2" and not args.quick:
        raise NotImplementedError("LTX-2 needs its released video and audio VAE configs (the tiny ones compress x8 "
                                  "and carry 2 audio channels where the transformer takes 128); --quick runs it")
    tiny = policy_class(family).tiny_pipeline(0)
    spec = load_spec(family, args.quick, tiny)
    guidance, noise_level, resolution = SAMPLING[family]
    resolution = args.resolution or (policy_class(family).tiny_size[0] if args.quick else resolution)
    rows: list[dict] = []

    def row(stage: str, flowrl=None, baseline=None, peak=None, baseline_peak=None, note: str = "") -> None:
        ratio = flowrl / baseline if flowrl is not None and baseline else None
        rows.append(dict(family=family, stage=stage, flowrl_s=flowrl, baseline_s=baseline, ratio=ratio,
                         peak_bytes=peak, baseline_peak_bytes=baseline_peak, note=note))

    # 1. Model load: random transformer + LoRA, on the device.
    free_memory()
    memory.reset()
    start = time.perf_counter()
    policy = build_bench_policy(family, spec, tiny, device=device, dtype=dtype, resolution=resolution)
    del tiny
    if clock.cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    params = sum(p.numel() for p in policy.transformer.parameters())
    lora = sum(p.numel() for p in policy.trainable_parameters())
    resident = memory.allocated()
    row("model load", load_s, None, memory.peak(), None,
        f"{count_text(params)} params incl. LoRA {count_text(lora)} (r=32, fp32); random init, not a checkpoint read"
        + ("" if resident is None else f"; {gib(resident):.2f} GiB resident"))

    cond = random_cond(policy, spec, device)
    bare = Bare(policy)
    group, steps = args.group, args.steps
    seeds = root_seeds(0, 0, group)
    sigmas = policy.sigmas(steps).to(device)
    rollout_calls = capture_calls(policy, policy.init_noise(group), sigmas[0], cond.select([0] * group), guidance)
    transformer_rows = call_rows(rollout_calls)
    passes = len(rollout_calls)
    mode = ("guidance embedding " if policy.guidance_in_model else "CFG " if guidance > 1 else "unguided, ") + \
        f"{guidance}" + (f", {passes} passes" if passes > 1 else "")

    # FLOPs of one transformer row (forward), for achieved TFLOP/s of the baselines.
    one_calls = capture_calls(policy, policy.init_noise(1), sigmas[1], cond, guidance)
    flops = count_flops(lambda: bare.loop(one_calls, 1))
    row_flops = None if flops is None else flops // call_rows(one_calls)
    flops_note = "" if row_flops is None else f"{flops_text(row_flops)} per transformer row forward"

    def tflops(flops, seconds) -> str:
        return "" if flops is None or not seconds else f"; bare {flops_text(flops / seconds)}/s"

    # 2. Rollout: flowrl's SDE rollout with log-probs against the bare loop of the same transformer calls.
    last = {}

    def flowrl_rollout(n: int = steps):
        settings = RolloutSettings(num_steps=n, guidance_scale=guidance, noise_level=noise_level, kind="sde",
                                   decode=False)
        last["traj"] = rollout(policy, ["benchmark prompt"], settings, group_size=group, seeds=seeds, cond=cond)

    result = timed({"flowrl": flowrl_rollout, "bare": lambda: bare.loop(rollout_calls, steps)},
                   args.rollout_repeats, clock, memory,
                   warmups={"flowrl": lambda: flowrl_rollout(2), "bare": lambda: bare.loop(rollout_calls, 2)})
    (flowrl_s, flowrl_peak, _), (bare_s, bare_peak, _) = result["flowrl"], result["bare"]
    traj = last.pop("traj")  # the last timed rollout's trajectory
    finite = bool(torch.isfinite(traj.log_probs).all() and torch.isfinite(traj.final_latents).all())
    shape = "x".join(str(s) for s in policy.latent_shape(1)[1:])
    row("rollout", flowrl_s, bare_s, flowrl_peak, bare_peak,
        f"G={group}, {steps} SDE steps, {resolution} px (latents {shape}), {transformer_rows} rows/step ({mode}); "
        f"extra {1e3 * (flowrl_s - bare_s) / steps:+.1f} ms/step; log-probs finite: {finite}"
        + tflops(None if row_flops is None else row_flops * transformer_rows * steps, bare_s))

    # 3. Train step: GRPO transition loss forward + backward against the bare forward + backward.
    micro = args.micro_batch
    advantages = torch.randn(traj.num_rows, traj.num_stored_steps, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(traj.num_rows, traj.num_stored_steps, dtype=torch.bool)
    train_rows, k = torch.arange(micro), traj.num_stored_steps // 2
    params_list = policy.trainable_parameters()
    sigma_k = traj.sigmas[k].item()

    def calls_for(index: torch.Tensor) -> list[dict]:  # what transition_loss's velocity call hands the model
        return capture_calls(policy, traj.latents[index, k].to(device), sigma_k,
                             traj.cond.select(traj.prompt_ids[index]), guidance)

    step_calls = calls_for(train_rows)
    step_rows = call_rows(step_calls)

    def zero_grad() -> None:
        for p in params_list:
            p.grad = None

    def flowrl_step(beta: float = 0.0) -> None:
        zero_grad()
        settings = TransitionSettings(policy_loss=partial(grpo_clip_loss, clip_low=1e-4, clip_high=1e-4),
                                      guidance=guidance, kind="sde", beta=beta)
        loss = transition_loss(policy, traj, advantages, train_rows, k, mask, settings=settings,
                               accelerator=accelerator, noise_level=noise_level, stats=StatsAccumulator(),
                               on_policy=False)
        loss.backward()

    def bare_step(calls=step_calls) -> None:
        zero_grad()
        with accelerator.autocast():
            loss = bare.loss(calls)
        loss.backward()

    one_step = calls_for(train_rows[:1])
    step_flops = count_flops(lambda: bare_step(one_step))
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
        flops = None if step_flops is None else step_flops * micro  # 1 trajectory (CFG: its 2 rows) x micro
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
    traj = step_calls = one_step = None  # freed before the next stage (closures above hold these names)
    free_memory()

    # 4. Attention: one no-grad forward of the rollout batch, SDPA and xformers.
    forward = torch.no_grad()(lambda: bare.forward(rollout_calls))
    sdpa_s, sdpa_peak, _ = timed({"sdpa": forward}, args.repeats, clock, memory)["sdpa"]
    row("attention sdpa", sdpa_s, sdpa_s, sdpa_peak, None,
        f"one forward of {transformer_rows} rows, torch scaled_dot_product_attention (diffusers' default)"
        + tflops(None if row_flops is None else row_flops * transformer_rows, sdpa_s))
    row("attention xformers", *xformers_forward(policy.transformer, forward, sdpa_s, sdpa_peak, args.repeats, clock,
                                                memory))
    if flops_note:
        rows[0]["note"] += f"; {flops_note}"
    policy = bare = rollout_calls = None  # freed before the next family (closures above hold these names)
    free_memory()
    return rows


def meta_flops(families, resolution: int | None) -> list[str]:
    """Forward FLOPs per transformer row of the full-size models at each family's bench size, counted by
    torch's flop counter on the meta device (no weights, no compute): the numbers of the docstring's budget."""
    lines = []
    meta = torch.device("meta")
    for family in families:
        tiny = policy_class(family).tiny_pipeline(0)
        spec = load_spec(family, False, tiny)
        size = resolution or SAMPLING[family][2]
        policy = build_bench_policy(family, spec, tiny, device=meta, dtype=torch.bfloat16, resolution=size, lora=False)
        cond = random_cond(policy, spec, "cpu")
        x = torch.randn(policy.latent_shape(1)).to(torch.bfloat16)
        calls = capture_calls(policy, x, policy.sigmas(10)[1], cond, SAMPLING[family][0])
        with torch.device(meta):  # tensors a forward makes without a device (RoPE tables) on meta too
            flops = count_flops(lambda: Bare(policy).loop(calls, 1))
        per_row = None if flops is None else flops / call_rows(calls)
        params = sum(p.numel() for p in policy.transformer.parameters())
        lines.append(f"{LABELS[family]}: {params:,} params; {size} px; {call_rows(calls)} rows/trajectory/step; "
                     + ("flop count failed" if per_row is None else f"{per_row / 1e12:.3f} TFLOP per row forward"))
        print(lines[-1], flush=True)
        policy = tiny = None  # freed before the next family (the flop-count closure holds the name)
    return lines


def context_parallel_section(out: Path | None) -> int:
    """Context parallelism on this machine's GPUs (NCCL) against one process, per kind: the rollout's velocities and
    log-probs, one GRPO step's LoRA gradients summed over the group (scripts/bench/context_parallel_check.py)."""
    import subprocess
    import tempfile

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"context parallelism needs 2 or more GPUs on this machine (found {gpus}); nothing checked")
        return 1
    lines = ["| kind | GPUs | dtype | velocity max diff | log-prob max diff | LoRA grad rel. diff |", "|---|---|---|---|---|---|"]
    results = {}
    for kind in ("ulysses", "ring"):
        with tempfile.TemporaryDirectory() as folder:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
                                   str(ROOT / "scripts/bench/context_parallel_check.py"), folder, kind, "cuda"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=600)
            if proc.returncode:
                lines.append(f"| {kind} | {gpus} | failed: {proc.stderr.strip().splitlines()[-1][:120]} | | | |")
                continue
            r = results[kind] = json.loads((Path(folder) / "rank0.json").read_text())
        lines.append(f"| {kind} | {gpus} | {r['dtype']} | {r['velocity']:.3g} | {r['log_prob']:.3g} | "
                     f"{r['grad_relative']:.3g} |")
    lines += ["", context_parallel_training(gpus)]
    print("\n".join(lines))
    if out is not None:
        out.write_text(json.dumps({"context_parallel": results, "table": lines}, indent=1))
    return 0


def context_parallel_training(gpus: int) -> str:
    """Two epochs of GRPO on the tiny Wan smoke config with Ulysses 2 on 2 GPUs against 1 GPU without it, as
    tests/training/test_context_parallel_training.py runs them on CPU processes: the largest relative difference
    of the logged metrics and of the exported LoRA tensors."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    from flowrl.training.metrics import read_metrics

    common = ["-m", "flowrl", "train", "configs/smoke/wan_tiny.yaml", "device=cuda", "train.epochs=2",
              "log.progress=false", "log.eval_every=0", "log.report_prompts=0", "train.learning_rate=1e-2"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    with tempfile.TemporaryDirectory() as folder:
        runs = {"context": [*launch, *common, f"run_dir={folder}/context", "parallel.context.ulysses=2"],
                "one": [sys.executable, *common, f"run_dir={folder}/one"]}
        for name, command in runs.items():
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1" if name == "context" else "0"})
            if proc.returncode:
                return f"training with Ulysses 2 ({name} run) failed: {proc.stderr.strip().splitlines()[-1][:160]}"
        metrics = [read_metrics(Path(folder) / name) for name in runs]
        worst = max((abs(b[k] - a[k]) / max(abs(a[k]), 1e-6), k) for a, b in zip(*metrics[::-1]) for k in a
                    if k != "step" and not k.startswith("perf/") and isinstance(a[k], float))
        lora = [load_file(Path(folder) / name / "lora" / "pytorch_lora_weights.safetensors") for name in runs]
        lora_diff = max(float((lora[0][k] - lora[1][k]).norm() / lora[1][k].norm().clamp(min=1e-12)) for k in lora[1])
    return (f"GRPO training, Ulysses 2 on 2 GPUs vs 1 GPU (tiny Wan, 2 epochs): metrics max rel. diff {worst[0]:.3g} "
            f"({worst[1]}), LoRA max rel. diff {lora_diff:.3g}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.count_flops:
        meta_flops(args.families, args.resolution)
        return 0
    if args.context_parallel:
        return context_parallel_section(args.out)
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
    start = time.perf_counter()
    rows = []
    failed = []
    for family in args.families:
        family_start = time.perf_counter()
        try:  # one family that cannot run at full size must not cost a device session the others' rows
            rows += bench_family(family, args, accelerator, clock, memory)
        except Exception as error:  # noqa: BLE001 - reported in one line, the run goes on
            failed.append(f"{LABELS[family]}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            print(f"{LABELS[family]}: failed: {failed[-1]}", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(f"{LABELS[family]}: {time.perf_counter() - family_start:.0f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    table = markdown(rows, memory.kind, LABELS)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"gpu_full_size: {'quick (tiny configs)' if args.quick else 'full size'} on {name}, "
          f"{args.torch_dtype}, torch {torch.__version__}; {wall:.0f} s")
    print(table)
    for line in failed:
        print(f"not measured: {line}")
    if args.out is not None:
        meta = dict(device=name, quick=args.quick, dtype=str(args.torch_dtype), torch=torch.__version__,
                    families=list(args.families), steps=args.steps, group=args.group, resolution=args.resolution,
                    micro_batch=args.micro_batch, repeats=args.repeats, rollout_repeats=args.rollout_repeats,
                    wall_s=wall, memory=memory.kind)
        write_json(args.out, meta, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
