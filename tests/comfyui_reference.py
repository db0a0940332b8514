"""How ComfyUI (and kohya sd-scripts) put a LoRA file onto SD3 / Flux weights, re-implemented for tests and
``scripts/check_lora_compat.py``. Written from reading the sources, not copied; each piece names what it follows
in github.com/comfyanonymous/ComfyUI:

- ``mmdit_to_diffusers`` / ``flux_to_diffusers``: comfy/utils.py, same names. diffusers weight name -> native
  weight name, or ``(native, (dim, offset, size))`` for a slice of a fused linear (q/k/v -> ``attn.qkv``,
  Flux single-block q/k/v/proj_mlp -> ``linear1``). ComfyUI takes the SD3 slice size as ``depth * 64`` (true of
  every released MMDiT); the tiny test models have other head sizes, so ``hidden`` is passed in.
- ``model_lora_keys_unet``: comfy/lora.py, same name. LoRA key prefix -> native weight: ``lora_unet_<native,
  . as _>`` and the bare native name for every weight; for SD3 ``transformer.``, ``base_model.model.``,
  ``lora_transformer_`` and ``lycoris_`` + diffusers names; for Flux ``transformer.``, ``lycoris_``,
  ``lora_transformer_`` and ``<single block>.linear1_qkv``.
- ``load_lora``: comfy/lora.py ``load_lora`` with comfy/weight_adapter/lora.py ``LoRAAdapter.load``: for each
  mapped prefix ``x``, ``x.alpha`` if present, and the first up/down pair found (``lora_up``/``lora_down``,
  ``_lora.up``/``_lora.down``, ``lora_B``/``lora_A``, ...). Keys it never reads are "not loaded".
- ``apply_patches``: comfy/lora.py ``calculate_weight`` + ``LoRAAdapter.calculate_weight``:
  ``weight.narrow(*offset) += strength * scale * up @ down`` with ``scale = alpha / rank`` (rank =
  ``down.shape[0]``) when the file has ``x.alpha``, else **1.0**.
- ``sd_scripts_deltas``: kohya-ss/sd-scripts networks/lora_sd3.py and lora_flux.py ``create_network_from_weights``
  and ``LoRAModule``: modules named ``lora_unet_<module, . as _>``, alpha defaulting to the rank (``lora_down``
  rows), ``scale = alpha / rank``.
"""

from __future__ import annotations

import torch

# comfy/utils.py MMDIT_MAP_BLOCK / flux block_map, the LoRA-relevant ``.weight`` rows: diffusers -> native.
MMDIT_BLOCK = {
    "norm1_context.linear": "context_block.adaLN_modulation.1", "attn.to_add_out": "context_block.attn.proj",
    "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2",
    "norm1.linear": "x_block.adaLN_modulation.1", "attn.to_out.0": "x_block.attn.proj",
    "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
}
MMDIT_BASIC = {
    "context_embedder": "context_embedder", "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2", "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "proj_out": "final_layer.linear",
}
FLUX_DOUBLE = {
    "attn.to_out.0": "img_attn.proj", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
FLUX_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
FLUX_BASIC = {
    "proj_out": "final_layer.linear", "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}
PREFIX = "diffusion_model."


def mmdit_to_diffusers(depth: int, hidden: int | None = None) -> dict:
    """comfy/utils.py ``mmdit_to_diffusers`` (``.weight`` entries, output_prefix ``diffusion_model.``)."""
    size, key_map = hidden or depth * 64, {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"{PREFIX}joint_blocks.{i}"
        for n, letter in enumerate("qkv"):
            key_map[f"{src}.attn.to_{letter}.weight"] = (f"{dst}.x_block.attn.qkv.weight", (0, n * size, size))
            key_map[f"{src}.attn.add_{letter}_proj.weight"] = (f"{dst}.context_block.attn.qkv.weight",
                                                               (0, n * size, size))
        for d, native in MMDIT_BLOCK.items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{native}.weight"
    key_map.pop(f"transformer_blocks.{depth - 1}.norm1_context.linear.weight", None)  # swap_scale_shift there
    key_map.update({f"{d}.weight": f"{PREFIX}{n}.weight" for d, n in MMDIT_BASIC.items()})
    return key_map


def flux_to_diffusers(depth: int, depth_single: int, hidden: int) -> dict:
    """comfy/utils.py ``flux_to_diffusers`` (``.weight`` entries, output_prefix ``diffusion_model.``)."""
    key_map = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"{PREFIX}double_blocks.{i}"
        for n, letter in enumerate("qkv"):
            key_map[f"{src}.attn.to_{letter}.weight"] = (f"{dst}.img_attn.qkv.weight", (0, n * hidden, hidden))
            key_map[f"{src}.attn.add_{letter}_proj.weight"] = (f"{dst}.txt_attn.qkv.weight", (0, n * hidden, hidden))
        for d, native in FLUX_DOUBLE.items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{native}.weight"
    for i in range(depth_single):
        src, dst = f"single_transformer_blocks.{i}", f"{PREFIX}single_blocks.{i}"
        for n, letter in enumerate("qkv"):
            key_map[f"{src}.attn.to_{letter}.weight"] = (f"{dst}.linear1.weight", (0, n * hidden, hidden))
        key_map[f"{src}.proj_mlp.weight"] = (f"{dst}.linear1.weight", (0, 3 * hidden, 4 * hidden))
        for d, native in FLUX_SINGLE.items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{native}.weight"
    key_map.update({f"{d}.weight": f"{PREFIX}{n}.weight" for d, n in FLUX_BASIC.items()})
    return key_map


def diffusers_map(family: str, config) -> dict:
    """The family's diffusers -> native map for a diffusers transformer ``config``."""
    hidden = config.num_attention_heads * config.attention_head_dim
    if family == "sd3":
        return mmdit_to_diffusers(config.num_layers, hidden)
    return flux_to_diffusers(config.num_layers, config.num_single_layers, hidden)


def model_lora_keys_unet(family: str, native_keys, dmap: dict) -> dict:
    """comfy/lora.py ``model_lora_keys_unet`` for an SD3 or Flux model: LoRA prefix -> native target."""
    key_map = {}
    for k in native_keys:
        if k.endswith(".weight"):
            key_map["lora_unet_" + k[len(PREFIX): -len(".weight")].replace(".", "_")] = k
            key_map[k[: -len(".weight")]] = k  # generic format
    for k, to in dmap.items():
        name = k[: -len(".weight")]
        key_map[f"transformer.{name}"] = to
        key_map[f"lycoris_{name.replace('.', '_')}"] = to
        key_map[f"lora_transformer_{name.replace('.', '_')}"] = to
        if family == "sd3":
            key_map[f"base_model.model.{name}"] = to
    if family == "flux":
        hidden = next(off[2] for k, (_, off) in ((k, v) for k, v in dmap.items() if isinstance(v, tuple)))
        for k in native_keys:
            if ".linear1." in k:
                key_map[k.replace(".linear1.weight", ".linear1_qkv")] = (k, (0, 0, hidden * 3))
    return key_map


UP_DOWN = [(".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
           (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
           (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
           (".lora_B.default.weight", ".lora_A.default.weight")]  # LoRAAdapter.load, in its order


def load_lora(lora: dict[str, torch.Tensor], key_map: dict) -> tuple[dict, set[str]]:
    """comfy/lora.py ``load_lora`` (LoRA part): -> ({target: (up, down, alpha or None)}, keys read)."""
    patches, loaded = {}, set()
    for x, target in key_map.items():
        alpha = None
        if f"{x}.alpha" in lora:
            alpha = lora[f"{x}.alpha"].item()
            loaded.add(f"{x}.alpha")
        for up_suffix, down_suffix in UP_DOWN:
            if f"{x}{up_suffix}" in lora:
                patches[target] = (lora[f"{x}{up_suffix}"], lora[f"{x}{down_suffix}"], alpha)
                loaded.update({f"{x}{up_suffix}", f"{x}{down_suffix}"})
                break
    return patches, loaded


def patch_scale(up: torch.Tensor, down: torch.Tensor, alpha) -> float:
    """comfy/weight_adapter/lora.py ``LoRAAdapter.calculate_weight``: alpha / rank with an alpha, else 1.0."""
    return alpha / down.shape[0] if alpha is not None else 1.0


def apply_patches(weights: dict[str, torch.Tensor], patches: dict, strength: float = 1.0) -> dict[str, torch.Tensor]:
    """comfy/lora.py ``calculate_weight``: each patch adds ``strength * scale * up @ down`` to its (narrowed) target."""
    out = {k: v.clone() for k, v in weights.items()}
    for target, (up, down, alpha) in patches.items():
        key, offset = (target[0], target[1]) if isinstance(target, tuple) else (target, None)
        weight = out[key] if offset is None else out[key].narrow(*offset)
        diff = torch.mm(up.float().flatten(1), down.float().flatten(1)).reshape(weight.shape)
        weight += strength * patch_scale(up, down, alpha) * diff
    return out


def sd_scripts_deltas(lora: dict[str, torch.Tensor], native_keys) -> tuple[dict[str, torch.Tensor], set[str], dict]:
    """kohya sd-scripts ``create_network_from_weights`` + ``LoRAModule``: -> ({native weight: scale * up @ down},
    keys read, {module: scale}); alpha defaults to the module's rank."""
    names = {"lora_unet_" + k[len(PREFIX): -len(".weight")].replace(".", "_"): k for k in native_keys}
    deltas, loaded, scales = {}, set(), {}
    for key, down in lora.items():
        module = key.split(".")[0]
        if not key.endswith(".lora_down.weight") or module not in names:
            continue
        up = lora[f"{module}.lora_up.weight"]
        alpha = float(lora[f"{module}.alpha"]) if f"{module}.alpha" in lora else float(down.shape[0])
        scales[module] = alpha / down.shape[0]
        deltas[names[module]] = scales[module] * up.float() @ down.float()
        loaded.update({key, f"{module}.lora_up.weight"} | ({f"{module}.alpha"} & lora.keys()))
    return deltas, loaded, scales


# --- bridging to a diffusers model (the tests hold no native checkpoint: qkv slices make it exact) ------
def native_weights(diffusers_state: dict[str, torch.Tensor], dmap: dict) -> dict[str, torch.Tensor]:
    """The native model's weights assembled from a diffusers state dict (fused linears concatenated)."""
    sizes: dict[str, list] = {}
    for k, to in dmap.items():
        if k in diffusers_state and isinstance(to, tuple):
            key, (_, offset, size) = to
            sizes.setdefault(key, []).append((offset, diffusers_state[k]))
    out = {to: diffusers_state[k].float().clone() for k, to in dmap.items() if isinstance(to, str) and k in diffusers_state}
    for key, parts in sizes.items():
        rows = max(offset + t.shape[0] for offset, t in parts)
        weight = torch.zeros(rows, parts[0][1].shape[1])
        for offset, t in parts:
            weight[offset: offset + t.shape[0]] = t.float()
        out[key] = weight
    return out


def to_native(diffusers_deltas: dict[str, torch.Tensor], dmap: dict, like: dict[str, torch.Tensor]) -> dict:
    """Per-module diffusers deltas (keys ``<module>.weight``) placed into native-shaped zero tensors."""
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    for k, delta in diffusers_deltas.items():
        to = dmap[k]
        if isinstance(to, tuple):
            out[to[0]].narrow(*to[1]).add_(delta)
        else:
            out[to].add_(delta)
    return out
