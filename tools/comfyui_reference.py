"""How ComfyUI (and kohya sd-scripts) put a LoRA file onto the native weights of the flowrl families,
re-implemented for tests and ``python -m tools.check_lora_compat`` (it lives in tools/ because tools must not
import the test suite; the tests import it from here). Written from reading the sources, not copied; each
piece names what it follows in github.com/comfyanonymous/ComfyUI:

- ``mmdit_to_diffusers`` / ``flux_to_diffusers`` / ``z_image_to_diffusers``: comfy/utils.py, same names. diffusers
  weight name -> native weight name, or ``(native, (dim, offset, size))`` for a slice of a fused linear (q/k/v ->
  ``attn.qkv``, Flux single-block q/k/v/proj_mlp -> ``linear1``, Z-Image q/k/v -> ``attention.qkv``). ComfyUI takes
  the SD3 slice size as ``depth * 64`` (true of every released MMDiT); the tiny test models have other head sizes,
  so ``hidden`` is passed in. ``flux_to_diffusers`` also holds the FLUX.2 rows (``ff.linear_in``/``linear_out`` ->
  ``img_mlp.0``/``.2``, single-block ``attn.to_qkv_mlp_proj`` -> ``linear1``, ``attn.to_out`` -> ``linear2``):
  ComfyUI runs FLUX.1, Kontext and FLUX.2 [klein] on one native Flux class (comfy/ldm/flux/model.py).
- ``qwen_image_native``: comfy/ldm/qwen_image/model.py. ComfyUI's Qwen-Image keeps diffusers' module names, so
  there is no conversion map: diffusers name == native name.
- ``wan``: comfy/ldm/wan/model.py names its modules as the original Wan code (``blocks.N.self_attn.q``,
  ``cross_attn.k``, ``ffn.0``), not as diffusers (``blocks.N.attn1.to_q``, ``attn2.to_k``, ``ffn.net.0.proj``), and
  comfy/lora.py has no Wan branch nor comfy/lora_convert.py a diffusers-Wan converter: ``diffusers_map`` refuses it
  (``UNMAPPED``).
- ``model_lora_keys_unet``: comfy/lora.py, same name. LoRA key prefix -> native weight: ``lora_unet_<native,
  . as _>`` and the bare native name for every weight; then per model class: SD3 ``transformer.``,
  ``base_model.model.``, ``lora_transformer_``, ``lycoris_`` + diffusers names; Flux (FLUX.1, Kontext, FLUX.2:
  ``model_base.Flux`` and subclasses) ``transformer.``, ``lycoris_``, ``lora_transformer_``, the bare diffusers name
  and ``<single block>.linear1_qkv``; QwenImage ``transformer.``, ``lycoris_`` and the bare name of every native
  weight; Lumina2 (Z-Image) ``diffusion_model.``, ``transformer.``, ``lycoris_`` and the bare name + diffusers names.
- ``load_lora``: comfy/lora.py ``load_lora`` with comfy/weight_adapter/lora.py ``LoRAAdapter.load``: for each
  mapped prefix ``x``, ``x.alpha`` if present, and the first up/down pair found (``lora_up``/``lora_down``,
  ``_lora.up``/``_lora.down``, ``lora_B``/``lora_A``, ...). Keys it never reads are "not loaded".
- ``apply_patches``: comfy/lora.py ``calculate_weight`` + ``LoRAAdapter.calculate_weight``:
  ``weight.narrow(*offset) += strength * scale * up @ down`` with ``scale = alpha / rank`` (rank =
  ``down.shape[0]``) when the file has ``x.alpha``, else **1.0**.
- ``native_shape``: the shape ComfyUI's model allocates for a (fused) attention / MLP weight, from the layer
  constructors in comfy/ldm/flux/layers.py (``DoubleStreamBlock``, ``SingleStreamBlock``), comfy/ldm/lumina/model.py
  (``JointAttention``) and comfy/ldm/qwen_image/model.py (``Attention``).
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
# the FLUX.2 rows of the same tables (diffusers Flux2Transformer2DModel names; its modulation is global, not per block)
FLUX2_DOUBLE = {"ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0",
                "ff_context.linear_out": "txt_mlp.2"}
FLUX2_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
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
        for d, native in (FLUX_DOUBLE | FLUX2_DOUBLE).items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{native}.weight"
    for i in range(depth_single):
        src, dst = f"single_transformer_blocks.{i}", f"{PREFIX}single_blocks.{i}"
        for n, letter in enumerate("qkv"):
            key_map[f"{src}.attn.to_{letter}.weight"] = (f"{dst}.linear1.weight", (0, n * hidden, hidden))
        key_map[f"{src}.proj_mlp.weight"] = (f"{dst}.linear1.weight", (0, 3 * hidden, 4 * hidden))
        for d, native in (FLUX_SINGLE | FLUX2_SINGLE).items():
            key_map[f"{src}.{d}.weight"] = f"{dst}.{native}.weight"
    key_map.update({f"{d}.weight": f"{PREFIX}{n}.weight" for d, n in FLUX_BASIC.items()})
    return key_map


# comfy/utils.py z_image_to_diffusers, the LoRA-relevant ``.weight`` rows: per block (diffusers -> native) and top level.
Z_IMAGE_BLOCK = {"attention.to_out.0": "attention.out", "feed_forward.w1": "feed_forward.w1",
                 "feed_forward.w2": "feed_forward.w2", "feed_forward.w3": "feed_forward.w3",
                 "adaLN_modulation.0": "adaLN_modulation.0"}
Z_IMAGE_BASIC = {"all_final_layer.2-1.linear": "final_layer.linear",
                 "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
                 "all_x_embedder.2-1": "x_embedder", "cap_embedder.1": "cap_embedder.1",
                 "t_embedder.mlp.0": "t_embedder.mlp.0", "t_embedder.mlp.2": "t_embedder.mlp.2"}
# comfy/ldm/qwen_image/model.py: the linear weights of QwenImageTransformerBlock and of the model around the blocks.
QWEN_BLOCK = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
              "attn.to_out.0", "attn.to_add_out", "img_mod.1", "txt_mod.1", "img_mlp.net.0.proj", "img_mlp.net.2",
              "txt_mlp.net.0.proj", "txt_mlp.net.2"]
QWEN_BASIC = ["img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
              "time_text_embed.timestep_embedder.linear_2"]
# flowrl families ComfyUI runs on the same native model class (comfy/supported_models.py -> comfy/model_base.py).
FLUX_CLASS = ("flux", "flux_kontext", "flux2_klein")
UNMAPPED = {"wan": "comfy/lora.py model_lora_keys_unet has no WAN branch and comfy/lora_convert.py no diffusers-Wan "
                   "converter; the native Wan model (comfy/ldm/wan/model.py) names its layers blocks.N.self_attn.q / "
                   "cross_attn.q / ffn.0, so transformer.blocks.N.attn1.to_q ... match nothing and are not loaded"}


def z_image_to_diffusers(n_layers: int, n_refiner: int, hidden: int) -> dict:
    """comfy/utils.py ``z_image_to_diffusers`` (``.weight`` entries, output_prefix ``diffusion_model.``): the same
    rows for ``layers``, ``context_refiner`` and ``noise_refiner`` (ComfyUI reads ``n_refiner_layers``, default 2;
    the tiny model has 1); q/k/v each take ``hidden`` rows of ``attention.qkv``."""
    key_map = {}
    blocks = [f"layers.{i}" for i in range(n_layers)] + [f"{name}.{i}" for name in ("context_refiner", "noise_refiner")
                                                         for i in range(n_refiner)]
    for src in blocks:
        for n, letter in enumerate("qkv"):
            key_map[f"{src}.attention.to_{letter}.weight"] = (f"{PREFIX}{src}.attention.qkv.weight",
                                                              (0, n * hidden, hidden))
        for d, native in Z_IMAGE_BLOCK.items():
            key_map[f"{src}.{d}.weight"] = f"{PREFIX}{src}.{native}.weight"
    key_map.update({f"{d}.weight": f"{PREFIX}{n}.weight" for d, n in Z_IMAGE_BASIC.items()})
    return key_map


def qwen_image_native(num_layers: int) -> dict:
    """comfy/ldm/qwen_image/model.py ``QwenImageTransformer2DModel``: its linear weights, which carry diffusers'
    names, as a diffusers -> native map (an identity up to the ``diffusion_model.`` prefix)."""
    names = [f"transformer_blocks.{i}.{m}" for i in range(num_layers) for m in QWEN_BLOCK] + QWEN_BASIC
    return {f"{n}.weight": f"{PREFIX}{n}.weight" for n in names}


def diffusers_map(family: str, config) -> dict:
    """The family's diffusers -> native map for a diffusers transformer ``config`` (ValueError where ComfyUI has none)."""
    if family in UNMAPPED:
        raise ValueError(f"ComfyUI maps no diffusers-named {family} LoRA: {UNMAPPED[family]}")
    if family == "z_image":
        return z_image_to_diffusers(config.n_layers, config.n_refiner_layers, config.dim)
    if family == "qwen_image":
        return qwen_image_native(config.num_layers)
    hidden = config.num_attention_heads * config.attention_head_dim
    if family == "sd3":
        return mmdit_to_diffusers(config.num_layers, hidden)
    if family in FLUX_CLASS:
        return flux_to_diffusers(config.num_layers, config.num_single_layers, hidden)
    raise ValueError(f"no ComfyUI reference for family {family!r}")


def model_lora_keys_unet(family: str, native_keys, dmap: dict) -> dict:
    """comfy/lora.py ``model_lora_keys_unet`` for the family's model class: LoRA prefix -> native target."""
    key_map = {}
    for k in native_keys:
        if k.endswith(".weight"):
            key_map["lora_unet_" + k[len(PREFIX): -len(".weight")].replace(".", "_")] = k
            key_map[k[: -len(".weight")]] = k  # generic format
    if family == "qwen_image":  # the QwenImage branch: built from the native weights, no conversion
        for k in native_keys:
            name = k[len(PREFIX): -len(".weight")]
            key_map[name] = key_map[f"transformer.{name}"] = key_map[f"lycoris_{name.replace('.', '_')}"] = k
        return key_map
    for k, to in dmap.items():
        name = k[: -len(".weight")]
        key_map[f"transformer.{name}"] = to
        key_map[f"lycoris_{name.replace('.', '_')}"] = to
        if family == "sd3":
            key_map[f"base_model.model.{name}"] = to
        if family in ("sd3", *FLUX_CLASS):
            key_map[f"lora_transformer_{name.replace('.', '_')}"] = to
        if family in FLUX_CLASS or family == "z_image":
            key_map[name] = to  # Flux: "DiffSynth" format; Lumina2: bare diffusers names
        if family == "z_image":
            key_map[f"{PREFIX}{name}"] = to
    if family in FLUX_CLASS:
        hidden = next(off[2] for k, (_, off) in ((k, v) for k, v in dmap.items() if isinstance(v, tuple)))
        for k in native_keys:
            if ".linear1." in k:
                key_map[k.replace(".linear1.weight", ".linear1_qkv")] = (k, (0, 0, hidden * 3))
    return key_map


def native_shape(family: str, config, key: str) -> tuple[int, ...] | None:
    """The shape ComfyUI's native model gives the fused / renamed attention and MLP weight ``key`` (None: a weight
    this reference has no formula for). Flux: comfy/ldm/flux/layers.py (FLUX.2: SiLU-gated MLP, first layer twice
    as wide); Z-Image: comfy/ldm/lumina/model.py ``JointAttention``; Qwen-Image: comfy/ldm/qwen_image/model.py."""
    name = key[len(PREFIX): -len(".weight")]
    leaf = name.split(".", 2)[-1]
    if family in FLUX_CLASS:
        h = config.num_attention_heads * config.attention_head_dim
        ratio = getattr(config, "mlp_ratio", 4.0)
        hidden_mlp = int(h * ratio)
        first = 2 * hidden_mlp if family == "flux2_klein" else hidden_mlp
        return {"img_attn.qkv": (3 * h, h), "txt_attn.qkv": (3 * h, h), "img_attn.proj": (h, h),
                "txt_attn.proj": (h, h), "img_mlp.0": (first, h), "txt_mlp.0": (first, h),
                "img_mlp.2": (h, hidden_mlp), "txt_mlp.2": (h, hidden_mlp), "linear1": (3 * h + first, h),
                "linear2": (h, h + hidden_mlp)}.get(leaf)
    if family == "z_image":
        head = config.dim // config.n_heads
        kv = config.n_kv_heads or config.n_heads
        return {"attention.qkv": ((config.n_heads + 2 * kv) * head, config.dim),
                "attention.out": (config.dim, config.n_heads * head)}.get(leaf)
    if family == "qwen_image":
        inner = config.num_attention_heads * config.attention_head_dim
        attn = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "attn.to_out.0", "attn.to_add_out")
        return (inner, inner) if leaf in attn else None
    return None


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
