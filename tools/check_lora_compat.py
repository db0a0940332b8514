"""Does each exported LoRA file load at the trained scale in each loader? ``python -m tools.check_lora_compat RUN_DIR``.

For every ``*.safetensors`` in ``RUN_DIR/lora`` (or in an export dir given directly) and each loader -- diffusers
``load_lora_weights``, ComfyUI (the re-implementation in tools/comfyui_reference.py: key map, alpha rule,
fused-slice patches) and a kohya sd-scripts-style reader -- it prints the keys matched out of the file's
total, the scale the loader applies against the trained alpha / r, and the max difference of the merged
weights against a manual merge ``W + (alpha / r) B A`` of the trained adapter.

The trained adapter is the run's latest checkpoint (its EMA weights when kept, as RUN_DIR/lora holds them);
an export dir without a run falls back to the diffusers file read back through flowrl (weaker: self-referential).
The reference loaders live in tools/ beside this check (they are test oracles, not runtime code, shared with the
LoRA tests), which is why this is a tool run from the repository root with ``python -m`` rather than part of the
package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from tools import comfyui_reference as comfy


def trained_adapter(run_dir: Path, export_dir: Path) -> tuple[dict, dict, str]:
    """(state, peft config, where from) of the adapter the export should reproduce."""
    from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME, read_lora
    from flowrl.training.checkpoint import read_checkpoint_lora, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(run_dir)
    except FileNotFoundError:
        state, config = read_lora(export_dir / DIFFUSERS_WEIGHT_NAME)
        return state, config, f"{export_dir / DIFFUSERS_WEIGHT_NAME} read back by flowrl (no checkpoint)"
    ema = (ckpt / "ema.safetensors").is_file()
    state, config = read_checkpoint_lora(ckpt, ema=ema)
    return state, config, f"{ckpt / ('ema' if ema else 'lora')}.safetensors"


def module_deltas(state: dict, config: dict) -> dict[str, torch.Tensor]:
    """{``<module>.weight``: (alpha / r) B A}: the manual merge's update per module."""
    scale = float(config["lora_alpha"]) / int(config["r"])
    return {k[: -len(".lora_A.weight")] + ".weight": scale * state[k.replace("lora_A", "lora_B")] @ v
            for k, v in state.items() if k.endswith(".lora_A.weight")}


def effective_scale(got: dict, unit: dict) -> float:
    """Least-squares s in got = s * B A (``unit``: the deltas at scale 1), over all modules."""
    num = sum(float((got[k] * unit[k]).sum()) for k in unit)
    den = sum(float((unit[k] * unit[k]).sum()) for k in unit)
    return num / den if den else float("nan")


def check_diffusers(file: Path, policy_factory, expected: dict, unit: dict) -> str:
    from peft.tuners.lora import LoraLayer

    policy = policy_factory()
    try:
        policy.pipeline.load_lora_weights(str(file.parent), weight_name=file.name)
    except Exception as error:  # noqa: BLE001 -- report any loader failure as a row
        return f"does not load: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"
    got, scales = {}, set()
    for name, module in policy.transformer.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            adapter = module.active_adapters[0]
            scales.add(round(module.scaling[adapter], 6))
            got[f"{name}.weight"] = module.get_delta_weight(adapter).detach().float()
    n_file = _lora_keys(file)
    if not got:
        return f"keys 0/{n_file}: loads nothing (diffusers has no converter for these names)"
    matched = 2 * len(set(got) & set(expected)) if not _is_kohya(file) else 2 * len(got)
    return _row(matched, n_file, scales, got, expected, unit)


def check_comfyui(file: Path, family: str, base: dict, dmap: dict, expected: dict, unit: dict) -> str:
    native = comfy.native_weights(base, dmap)
    lora = load_file(str(file))
    patches, loaded = comfy.load_lora(lora, comfy.model_lora_keys_unet(family, native.keys(), dmap))
    patched = comfy.apply_patches(native, patches)
    scales = {round(comfy.patch_scale(*p), 6) for p in patches.values()}
    got = {k: patched[k] - native[k] for k in native}
    return _row(len(loaded), len(lora), scales, got, comfy.to_native(expected, dmap, native),
                comfy.to_native(unit, dmap, native))


def check_kohya(file: Path, base: dict, dmap: dict, expected: dict, unit: dict) -> str:
    native = comfy.native_weights(base, dmap)
    lora = load_file(str(file))
    deltas, loaded, scales = comfy.sd_scripts_deltas(lora, native.keys())
    if not loaded:
        return f"keys 0/{len(lora)}: no lora_unet_ names (not a kohya-format file)"
    got = {k: deltas.get(k, torch.zeros_like(v)) for k, v in native.items()}
    return _row(len(loaded), len(lora), {round(s, 6) for s in scales.values()}, got,
                comfy.to_native(expected, dmap, native), comfy.to_native(unit, dmap, native))


def _row(matched: int, total: int, scales: set, got: dict, expected: dict, unit: dict) -> str:
    keys = set(expected) | set(got)
    zero = torch.zeros(())
    diff = max(float((got.get(k, zero) - expected.get(k, zero)).abs().max()) for k in keys)
    unit = {k: unit.get(k, torch.zeros_like(got[k])) for k in got}
    return (f"keys {matched}/{total}  scale applied {sorted(scales)}  effective {effective_scale(got, unit):.4f}  "
            f"max|dW - manual merge| {diff:.1e}")


def _lora_keys(file: Path) -> int:
    with safe_open(str(file), framework="pt") as handle:
        return len(list(handle.keys()))


def _is_kohya(file: Path) -> bool:
    with safe_open(str(file), framework="pt") as handle:
        return any(k.startswith("lora_unet_") for k in handle.keys())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run dir (checks RUN_DIR/lora) or an export dir")
    args = parser.parse_args(argv)
    from flowrl.models import build_policy

    run_dir = Path(args.run_dir)
    export_dir = run_dir / "lora" if (run_dir / "lora").is_dir() else run_dir
    files = sorted(export_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"check_lora_compat: no .safetensors files in {export_dir}")
    with safe_open(str(files[0]), framework="pt") as handle:
        meta = handle.metadata() or {}
    family, path = meta.get("flowrl.model_family", "sd3"), meta.get("flowrl.model_path", "tiny")
    config_file = next((d / "config.yaml" for d in (run_dir, export_dir.parent) if (d / "config.yaml").is_file()), None)
    seed = int((yaml.safe_load(config_file.read_text()) or {}).get("seed", 0)) if config_file else 0  # tiny weights
    state, config, source = trained_adapter(run_dir, export_dir)
    trained_scale = float(config["lora_alpha"]) / int(config["r"])
    expected, unit = module_deltas(state, config), module_deltas(state, {"r": 1, "lora_alpha": 1})
    base_policy = build_policy(family, path, seed=seed)
    base = {k: v.detach().float() for k, v in base_policy.transformer.state_dict().items()}
    dmap = comfy.diffusers_map(family, base_policy.transformer.config)
    print(f"{export_dir}: {family} {path}; trained adapter {source}: r={config['r']} alpha={config['lora_alpha']} "
          f"-> trained scale {trained_scale:g}")
    for file in files:
        print(f"{file.name}")
        print(f"  diffusers  {check_diffusers(file, lambda: build_policy(family, path, seed=seed), expected, unit)}")
        print(f"  comfyui    {check_comfyui(file, family, base, dmap, expected, unit)}")
        print(f"  kohya      {check_kohya(file, base, dmap, expected, unit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
