"""Peak GPU memory of one FLUX.1-dev GRPO step on one GPU under ``model.quantize`` (none = bf16, int8, nf4), by
arithmetic from the configs; which settings fit 24 GB and 40 GB.

Counted exactly, on the ``meta`` device (nothing allocated, nothing downloaded): the transformer of
``configs/models/flux1_dev_transformer.json`` (every ``nn.Linear`` weight is what a scheme quantises; biases,
norms and embeddings stay bf16), the LoRA of the sized config (``--config``, by default
``configs/flux1_dev/grpo_pickscore_24gb.yaml``: its ``lora.rank`` on its ``lora.target_modules``, fp32), the FLUX VAE
and PickScore (CLIP ViT-H/14, the reward of ``configs/flux1_dev/grpo_pickscore*.yaml``).

Bytes per quantised weight, from the libraries' layouts (a ``out x in`` Linear):
  bf16  2 B per weight;
  int8  torchao Int8WeightOnlyConfig: 1 B per weight + per output row an fp32 scale and an int8 zero point (5 B);
  fp8   torchao Float8WeightOnlyConfig: 1 B per weight + an fp32 scale per row (4 B);
  nf4   bitsandbytes NF4 with double quantisation (flowrl's BitsAndBytesConfig): 0.5 B per weight + an 8-bit absmax
        per 64 weights + an fp32 scale per 256 absmax values.
LoRA state per parameter: fp32 weight 4 + gradient 4 + EMA 4 (``train.ema``) + AdamW's two fp32 moments 8, or
AdamW8bit's two uint8 moments with an fp32 scale per 256 values (2 x (1 + 4/256)) for moments of tensors of
>= 4096 values (all of FLUX's LoRA tensors at r >= 2).

Assumed (stated, not measured; ``scripts/bench/gpu_full_size.py`` measures the activation peaks on a GPU):
  - the text encoders are off the GPU during training (``model.text_cache=disk`` + ``model.free_text_encoders``;
    T5-XXL and CLIP-L are 9.77 GB in bf16, on the GPU only while the cache is filled at start: see the start row);
  - tokens per row: (H/16) x (W/16) image tokens + the config's T5 tokens (``model.max_sequence_length``, 512 when
    unset, FluxPipeline's default); hidden width 3072; bf16 activations, SDPA
    (flash / memory-efficient attention: no tokens^2 matrix);
  - training with gradient checkpointing: each of the 57 blocks keeps its input hidden states (tokens x 3072) per
    row, and the one block being recomputed holds ``BLOCK_TENSORS`` = 24 tensors of tokens x 3072 per row (its
    saved activations: norms, q/k/v, attention output, the 4x MLP) plus as much again for their gradients;
  - sampling: no grad, a batch of ``group_size`` rows (one prompt per rollout batch, FLUX has no CFG pass), a
    block's live activations ``SAMPLE_TENSORS`` = 12 tensors of tokens x 3072 per row;
  - CUDA context, cuBLAS workspaces and allocator fragmentation: 1.5 GB.
The step's peak is the resident weights and state plus the larger of the sampling and the training transient.

    .venv/bin/python scripts/bench/quant_memory.py                # the table for docs/scaling.md
    .venv/bin/python scripts/bench/quant_memory.py --config configs/flux1_dev/grpo_pickscore.yaml --micro-batch 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "configs/models/flux1_dev_transformer.json"
HIDDEN, BLOCK_TENSORS, SAMPLE_TENSORS, OVERHEAD_GB = 3072, 24, 12, 1.5
DEFAULT_CONFIG = "configs/flux1_dev/grpo_pickscore_24gb.yaml"
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore_v1's architecture), config.json architecture fields
PICKSCORE = {"text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                             "num_hidden_layers": 24, "vocab_size": 49408, "max_position_embeddings": 77},
             "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16,
                               "num_hidden_layers": 32, "patch_size": 14, "image_size": 224},
             "projection_dim": 1024}
# FLUX.1-dev's vae/config.json (AutoencoderKL, 16 latent channels)
FLUX_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "layers_per_block": 2, "use_quant_conv": False, "use_post_quant_conv": False}
TEXT_ENCODERS_GB = 9.77  # docs/scaling.md section 2, scripts/text_encoder_memory.py: CLIP-L + T5-XXL in bf16


def on_meta(build):
    from accelerate import init_empty_weights

    with init_empty_weights():
        return build()


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def transformer_weight_bytes(model: torch.nn.Module) -> dict[str, float]:
    """{scheme: bytes of the base transformer's weights} for bf16, int8, fp8 and nf4."""
    linear = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantised = sum(o * i for o, i in linear)
    rows = sum(o for o, _ in linear)
    rest = 2 * (count(model) - quantised)  # biases, norms, embeddings: bf16 under every scheme
    return {"bf16": 2 * count(model),
            "int8": quantised + 5 * rows + rest,
            "fp8": quantised + 4 * rows + rest,
            "nf4": quantised * (0.5 + 1 / 64 + 4 / (64 * 256)) + rest}


def lora_parameters(model: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters of a LoRA of ``rank`` on ``targets`` (peft on the meta model)."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)), model)
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def lora_state_bytes(params: int, optimizer: str, ema: bool = True) -> float:
    moments = 8 if optimizer == "adamw" else 2 * (1 + 4 / 256)
    return params * (4 + 4 + moments + (4 if ema else 0))


def activation_bytes(size: int, group: int, micro_batch: int, text_tokens: int) -> tuple[float, float]:
    """(sampling transient, training transient) in bytes at ``size`` px."""
    tokens = (size // 16) ** 2 + text_tokens
    per_tensor = tokens * HIDDEN * 2  # one bf16 tensor of tokens x hidden, one row
    sampling = group * SAMPLE_TENSORS * per_tensor
    training = micro_batch * (57 * per_tensor + 2 * BLOCK_TENSORS * per_tensor)
    return sampling, training


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"the FLUX.1-dev config sized (default {DEFAULT_CONFIG})")
    parser.add_argument("--rank", type=int, help="LoRA rank (default: the config's lora.rank)")
    parser.add_argument("--micro-batch", type=int, default=1, help="train.micro_batch_size (default 1)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    import diffusers
    import transformers

    from flowrl.config import Config, load_config
    from flowrl.models.flux import FLUX_LORA_TARGETS

    cfg = load_config(Config, str(ROOT / args.config), [])
    rank = args.rank or cfg.lora.rank
    targets = list(cfg.lora.target_modules or FLUX_LORA_TARGETS)
    text_tokens = cfg.model.max_sequence_length or 512

    spec = json.loads(SPEC.read_text())["transformer"]
    transformer = on_meta(lambda: getattr(diffusers, spec["class"]).from_config(spec["config"]))
    base_params, weights = count(transformer), transformer_weight_bytes(transformer)
    lora = lora_parameters(transformer, rank, targets)
    vae = count(on_meta(lambda: diffusers.AutoencoderKL(**FLUX_VAE)))
    reward = count(on_meta(lambda: transformers.CLIPModel(transformers.CLIPConfig(**PICKSCORE))))
    gb = 1e9
    print(f"FLUX.1-dev transformer {base_params / 1e9:.3f}B parameters; weights: "
          + ", ".join(f"{k} {v / gb:.2f} GB" for k, v in weights.items()))
    print(f"{args.config}: LoRA r={rank} on {len(targets)} target modules, {text_tokens} T5 tokens")
    print(f"LoRA r={rank}: {lora / 1e6:.1f}M parameters; state (weight, grad, EMA, moments): AdamW "
          f"{lora_state_bytes(lora, 'adamw') / gb:.2f} GB, AdamW8bit {lora_state_bytes(lora, 'adamw8bit') / gb:.2f} GB")
    print(f"VAE {vae / 1e6:.1f}M -> {2 * vae / gb:.2f} GB; PickScore (CLIP ViT-H/14) {reward / 1e6:.0f}M -> "
          f"{2 * reward / gb:.2f} GB (bf16); text encoders {TEXT_ENCODERS_GB} GB, only while the cache fills")
    rows = []
    for scheme, optimizer in (("bf16", "adamw"), ("int8", "adamw8bit"), ("nf4", "adamw8bit")):
        start = weights[scheme] + 2 * vae + TEXT_ENCODERS_GB * gb + OVERHEAD_GB * gb  # filling the text cache
        resident = weights[scheme] + lora_state_bytes(lora, optimizer) + 2 * (vae + reward) + OVERHEAD_GB * gb
        for size in (512, 1024):
            for group in (8, 24):
                sampling, training = activation_bytes(size, group, args.micro_batch, text_tokens)
                step = resident + max(sampling, training)
                peak = max(step, start)
                rows.append(dict(scheme=scheme, optimizer=optimizer, size=size, group=group, start_gb=start / gb,
                                 resident_gb=resident / gb, sampling_gb=sampling / gb, training_gb=training / gb,
                                 step_gb=step / gb, peak_gb=peak / gb, fits_24=peak <= 24 * gb, fits_40=peak <= 40 * gb))
    print(f"\n| base | optimizer | px | group | weights + state | sampling | train (mb {args.micro_batch}) | step peak "
          "| start (cache fill) | 24 GB | 40 GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['optimizer']} | {r['size']} | {r['group']} | {r['resident_gb']:.1f} | "
              f"{r['sampling_gb']:.1f} | {r['training_gb']:.1f} | **{r['step_gb']:.1f}** | {r['start_gb']:.1f} | "
              f"{'fits' if r['fits_24'] else '-'} | {'fits' if r['fits_40'] else '-'} |")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
