"""GPU memory per process of full fine-tuning (``model.trainable: full``) under FSDP2, by arithmetic from the configs.

For each shipped full fine-tuning config it reads the run config (recipe, ``train.ema``, text cache, trainable
modules, mixed precision) and the accelerate config it launches with (``num_processes``, the wrapped block class),
and builds the published transformer from ``configs/models/*_transformer.json`` on the ``meta`` device (exact
parameter counts, nothing downloaded or allocated). Per GPU, with P trained parameters and N processes:

- trained weights, float32 master copies: 4P / N (FSDP2 shards them; a partial pattern trains a subset);
- their gradients, float32: 4P / N; AdamW's two moments, float32: 8P / N;
- the EMA (``train.ema``), float32 like the weights: 4P / N; recipe nft's old policy adds another 4P / N;
- the reference, the base's trained tensors in float32, sharded as the weights: 4P / N
  (:mod:`flowrl.models.full_weights`; against a replicated frozen bf16 copy of the transformer, 2 x all params,
  or an offload to host memory, 0 GPU bytes but 4P / N over PCIe for every reference forward);
- frozen transformer tensors (a partial pattern): bf16, sharded: 2 (all - P) / N;
- the gathered blocks while computing: the largest wrapped block in bf16 (accelerate's FSDP2 mixed precision casts
  at the all-gather), twice (the block computing and the one prefetched), plus the root module's tensors, which
  FSDP2 keeps gathered between a forward and its backward;
- the text encoders in bf16 unless ``model.text_cache=disk`` with ``model.free_text_encoders`` (0), and the VAE.

Activations, the reward models and the CUDA context are not counted (``scripts/bench/gpu_full_size.py`` measures
activation peaks). Also printed: the host memory rank 0 takes to write a checkpoint (the whole weights, EMA and AdamW
state in float32: 16P; the other processes take part in the gathers and keep nothing, and a resume reads the files
one tensor at a time, the AdamW file memory-mapped).

    .venv/bin/python scripts/bench/full_ft_memory.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # config -> (name, transformer spec, text encoders spec, accelerate config)
    "configs/sd35_medium/grpo_ocr_full.yaml": ("SD3.5-Medium", "sd35_medium"),
    "configs/flux1_dev/grpo_pickscore_full.yaml": ("FLUX.1-dev", "flux1_dev"),
}
GB = 1e9


def meta_model(spec: dict, library: str) -> torch.nn.Module:
    """The model of a ``configs/models`` entry on the meta device."""
    import importlib

    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), spec["class"])
    with init_empty_weights():
        if library == "diffusers":
            return cls.from_config(spec["config"])
        model = cls(cls.config_class(**spec["config"]))
        model.tie_weights()
        return model


def count(module: torch.nn.Module, names=None) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if names is None or n in names)


def launch_config(config_file: Path) -> Path:
    """The accelerate config named in the run config's header (``--config_file ...``)."""
    found = re.search(r"--config_file\s+(\S+)", config_file.read_text())
    if not found:
        raise SystemExit(f"{config_file}: no accelerate --config_file in its header")
    return ROOT / found.group(1)


def estimate(config_path: str, name: str, models: str) -> dict[str, float]:
    from flowrl.config import Config, load_config
    from flowrl.models.full_weights import matched_parameters

    cfg = load_config(Config, ROOT / config_path, [])
    accelerate = yaml.safe_load(launch_config(ROOT / config_path).read_text())
    n = int(accelerate["num_processes"])
    block_class = accelerate.get("fsdp_config", {}).get("fsdp_transformer_layer_cls_to_wrap", "")
    transformer = meta_model(json.loads((ROOT / f"configs/models/{models}_transformer.json").read_text())
                             ["transformer"], "diffusers")
    total = count(transformer)
    trained_names = set(matched_parameters(transformer, cfg.model.trainable_modules))
    p = count(transformer, trained_names)
    blocks = [m for m in transformer.modules() if type(m).__name__ in block_class.split(",")]
    largest_block = max((count(b) for b in blocks), default=total)
    in_blocks = sum(count(b) for b in blocks)
    root = total - in_blocks  # embeddings, norms and the output layer: FSDP2's root group
    encoders = json.loads((ROOT / f"configs/models/{models}_text_encoders.json").read_text())
    text = sum(count(meta_model(e, "transformers")) for k, e in encoders.items() if not k.startswith("_"))
    freed = cfg.model.text_cache == "disk" and cfg.model.free_text_encoders
    rows = {
        "trained weights fp32": 4 * p / n,
        "gradients fp32": 4 * p / n,
        "AdamW moments fp32": 8 * p / n,
        "EMA fp32": 4 * p / n if cfg.train.ema else 0.0,
        "NFT old policy fp32": 4 * p / n if cfg.recipe == "nft" else 0.0,
        "reference (base) fp32": 4 * p / n,
        "frozen transformer bf16": 2 * (total - p) / n,
        "gathered blocks bf16": 2 * (2 * largest_block + root),
        "text encoders bf16": 0.0 if freed else 2 * text,
        "VAE bf16": 2 * 83.7e6,  # the 16-channel VAE of SD3 and FLUX, 83.7M parameters
    }
    return {"name": name, "config": config_path, "processes": n, "total": total, "trained": p, "rows": rows,
            "host_checkpoint": 16 * p, "replicated_reference": 2 * total, "dtype": cfg.model.dtype}


def main() -> None:
    results = [estimate(path, name, models) for path, (name, models) in RUNS.items()]
    keys = list(results[0]["rows"])
    print("| per GPU (GB) | " + " | ".join(f"{r['name']} ({r['processes']} GPUs, FSDP2)" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| transformer parameters, trained | " + " | ".join(
        f"{r['total'] / 1e9:.3f}B, {r['trained'] / 1e9:.3f}B" for r in results) + " |")
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{r['rows'][key] / GB:.2f}" for r in results) + " |")
    print("| **total before activations** | " + " | ".join(
        f"**{sum(r['rows'].values()) / GB:.2f}**" for r in results) + " |")
    print()
    for r in results:
        ref = r["rows"]["reference (base) fp32"]
        print(f"- {r['name']}: the sharded base copy costs {ref / GB:.2f} GB per GPU; a replicated frozen bf16 "
              f"transformer would cost {r['replicated_reference'] / GB:.2f} GB; offloading it to host memory costs "
              f"0 GB of GPU but moves {ref / GB:.2f} GB over PCIe per reference forward. Writing a checkpoint "
              f"gathers {r['host_checkpoint'] / GB:.1f} GB of host memory on rank 0 (weights, EMA, AdamW in fp32).")


if __name__ == "__main__":
    main()
