"""GPU memory per process of LoRA training for the Wan video families under FSDP2 with sequence (context)
parallelism, by arithmetic: which model needs how many context processes at which resolution and clip length.

Parameters are counted exactly on the ``meta`` device from ``configs/models/*_transformer.json`` (nothing is
downloaded or allocated); the LoRA is r = 32 on the family's default targets (``to_q``, ``to_k``, ``to_v``,
``to_out.0``), on both experts of Wan2.2-A14B. Per GPU, with N processes (FSDP2 shards over all of them, the world
being data x context) and a context degree c:

- frozen transformer, bf16, sharded: 2 bytes x all parameters / N (A14B: both experts);
- the gathered blocks while computing: the largest block in bf16, twice (the block computing and the one
  prefetched);
- the LoRA in float32: weights, gradients, AdamW's two moments and the EMA, 5 x 4 bytes a parameter, sharded / N;
- the VAE in bf16 (Wan2.1's, or Wan2.2's for TI2V-5B); the text encoder 0: ``model.text_cache=disk`` with
  ``model.free_text_encoders`` (UMT5-XXL would add 11.4 GB);
- activations of one train micro-batch of one prompt with CFG, i.e. 2 rows in the graph, each of S latent tokens
  (the attention sequence: latent frames x h x w / the (1, 2, 2) patches), S / c of them on this GPU, with gradient
  checkpointing: each block's input is kept (2 bytes x hidden width per token per block), and one block at a time
  is recomputed with its full activations, **assumed** 34 x hidden width bytes per token (Korthikanti et al. 2022's
  per-layer count for a bf16 transformer block with a fused attention kernel, which keeps no S x S scores).

Not counted: the CUDA context and allocator slack (~2-4 GB), the reward models, the VAE decode of a rollout's clips
(chunked over frames), and the rollout's own forward (no gradients: one block's activations, less than the train
step's). The estimate is arithmetic, not a measurement.

    .venv/bin/python scripts/bench/memory_estimate.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
LORA_RANK = 32
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
LORA_BYTES = 5 * 4  # float32 weight, gradient, two AdamW moments, EMA
ACTIVATION_BYTES_PER_TOKEN = 34  # x hidden width, one block recomputed with gradient checkpointing (assumed)
ROWS_IN_GRAPH = 2  # one prompt per micro-batch, its conditional and unconditional (CFG) rows
GPU_GB = 80.0
MODELS = {  # name: (configs/models file, experts, VAE config (diffusers AutoencoderKLWan kwargs))
    "Wan2.1-T2V-1.3B": ("wan21_t2v_1_3b", 1, {}),
    "Wan2.2-TI2V-5B": ("wan22_ti2v_5b", 1, {"base_dim": 160, "z_dim": 48, "is_residual": True, "in_channels": 12,
                                            "out_channels": 12, "decoder_base_dim": 256, "patch_size": 2,
                                            "scale_factor_spatial": 16}),
    "Wan2.2-T2V-A14B": ("wan22_t2v_a14b", 2, {}),
}
SIZES = {"480p": (832, 480), "720p": (1280, 720)}
FRAMES = (81,)
DEGREES = (1, 2, 4, 8)


def counted(name: str) -> dict:
    """Parameter counts of one model (meta device): all, largest block, LoRA, VAE; and its layout."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    file, experts, vae_config = MODELS[name]
    spec = json.loads((ROOT / f"configs/models/{file}_transformer.json").read_text())
    with init_empty_weights():
        transformer = WanTransformer3DModel.from_config(spec["transformer"]["config"])
        vae = AutoencoderKLWan(**vae_config)
    lora = sum(LORA_RANK * (m.in_features + m.out_features) for n, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and n.endswith(LORA_TARGETS))
    config = spec["transformer"]["config"]
    return dict(experts=experts, params=experts * sum(p.numel() for p in transformer.parameters()),
                block=max(sum(p.numel() for p in b.parameters()) for b in transformer.blocks), lora=experts * lora,
                vae=sum(p.numel() for p in vae.parameters()), layers=config["num_layers"],
                width=config["num_attention_heads"] * config["attention_head_dim"],
                heads=config["num_attention_heads"], spatial=spec["text"]["vae_scale_factor"],
                temporal=spec["text"]["vae_scale_factor_temporal"])


def tokens(model: dict, size: tuple[int, int], frames: int) -> int:
    """Attention sequence of one row: latent frames x latent h x w over the (1, 2, 2) patches."""
    width, height = size
    latent_frames = (frames - 1) // model["temporal"] + 1
    return latent_frames * (height // model["spatial"] // 2) * (width // model["spatial"] // 2)


def per_gpu(model: dict, sequence: int, processes: int, degree: int) -> dict[str, float]:
    """GB per GPU by component (see the module docstring)."""
    local = sequence / degree
    parts = {
        "frozen transformer (bf16, sharded)": 2 * model["params"] / processes,
        "gathered blocks (bf16, 2)": 2 * 2 * model["block"],
        "LoRA + grad + AdamW + EMA (fp32, sharded)": LORA_BYTES * model["lora"] / processes,
        "VAE (bf16)": 2 * model["vae"],
        "block inputs kept (checkpointing)": ROWS_IN_GRAPH * local * model["layers"] * model["width"] * 2,
        "one block recomputed": ROWS_IN_GRAPH * local * model["width"] * ACTIVATION_BYTES_PER_TOKEN,
    }
    return {k: v / GB for k, v in parts.items()}


def main() -> int:
    processes = 8
    models = {name: counted(name) for name in MODELS}
    print(f"Memory per GPU, {processes} GPUs, FSDP2 + context parallelism (GB; LoRA r={LORA_RANK}; 1 prompt per "
          f"micro-batch with CFG = {ROWS_IN_GRAPH} rows; gradient checkpointing; {GPU_GB:.0f} GB GPUs)\n")
    print("| model | size | frames | tokens per row | " + " | ".join(f"context {c}" for c in DEGREES)
          + " | smallest context degree that fits |")
    print("|---|---|---|---|" + "---|" * len(DEGREES) + "---|")
    for name, model in models.items():
        for label, size in SIZES.items():
            for frames in FRAMES:
                sequence = tokens(model, size, frames)
                totals = [sum(per_gpu(model, sequence, processes, c).values()) for c in DEGREES]
                fits = next((c for c, t in zip(DEGREES, totals) if t <= GPU_GB - 4), None)
                print(f"| {name} | {label} {size[0]}x{size[1]} | {frames} | {sequence:,} | "
                      + " | ".join(f"{t:.1f}" for t in totals) + f" | {fits or 'none of these'} |")
    a14b = models["Wan2.2-T2V-A14B"]
    sequence = tokens(a14b, SIZES["720p"], 81)
    print(f"\nWan2.2-T2V-A14B, 720p x 81 frames ({sequence:,} tokens per row), {processes} GPUs: "
          f"{a14b['params'] / 1e9:.2f}B parameters (2 experts), largest block {a14b['block'] / 1e6:.0f}M, "
          f"LoRA {a14b['lora'] / 1e6:.1f}M, VAE {a14b['vae'] / 1e6:.0f}M, {a14b['heads']} heads\n")
    degrees = (1, 4, 8)
    print("| per GPU (GB) | " + " | ".join("FSDP2 only" if c == 1 else f"FSDP2 + Ulysses {c}" for c in degrees) + " |")
    print("|---|" + "---|" * len(degrees))
    columns = [per_gpu(a14b, sequence, processes, c) for c in degrees]
    for key in columns[0]:
        print(f"| {key} | " + " | ".join(f"{col[key]:.2f}" for col in columns) + " |")
    print("| **total** | " + " | ".join(f"**{sum(col.values()):.2f}**" for col in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
