"""The diffusers-key export (``pytorch_lora_weights.safetensors``) of every newer family in ComfyUI's LoraLoader,
through the key maps re-implemented in tools/comfyui_reference.py: each LoRA module lands on a native weight of
its shape (or the right rows of a fused one), no key is left unloaded, and strength 1.0 applies the trained
``(alpha / r) B A``.

FLUX.1 Kontext and FLUX.2 [klein] go through comfy/utils.py ``flux_to_diffusers`` (one native Flux class), Z-Image
through ``z_image_to_diffusers`` (Lumina2 class), Qwen-Image through its own names (its native model keeps diffusers'
names). Wan has no diffusers map in ComfyUI: its diffusers file is not loaded there at all, its kohya file (Wan's
original module names) is, as the last two tests show."""

import pytest
import torch
from safetensors.torch import load_file

from flowrl.models import build_policy
from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME, lora_config_dict, lora_state_dict, write_lora_files
from tools import comfyui_reference as comfy
from tools.policy_capture import random_lora_policy

RANK, ALPHA = 4, 8.0  # scale 2, as in every shipped config
MAPPED = ["flux_kontext", "flux2_klein", "qwen_image", "z_image"]


def _export(family, out):
    """Tiny policy + default-target LoRA with random non-zero A and B, exported in the diffusers format."""
    policy = random_lora_policy(family, RANK, ALPHA)
    state, config = lora_state_dict(policy.transformer), lora_config_dict(policy.transformer)
    assert set(config["target_modules"]) == set(policy.default_lora_targets())
    write_lora_files(out, state, config, family=family, base_model="tiny", config_text=None, format="diffusers")
    deltas = {k[: -len(".lora_A.weight")] + ".weight": (ALPHA / RANK) * state[k.replace("lora_A", "lora_B")].float()
              @ a.float() for k, a in state.items() if k.endswith(".lora_A.weight")}  # the peft delta of each module
    return policy, load_file(str(out / DIFFUSERS_WEIGHT_NAME)), deltas


@pytest.fixture(scope="module", params=MAPPED)
def exported(request, tmp_path_factory):
    family = request.param
    policy, lora, deltas = _export(family, tmp_path_factory.mktemp(f"comfy_{family}"))
    base = {k: v.detach().float().clone() for k, v in build_policy(family, "tiny", seed=0).transformer.state_dict().items()}
    config = policy.transformer.config
    dmap = comfy.diffusers_map(family, config)
    native = comfy.native_weights(base, dmap)
    return {"family": family, "config": config, "lora": lora, "deltas": deltas, "base": base, "dmap": dmap,
            "native": native, "key_map": comfy.model_lora_keys_unet(family, native.keys(), dmap)}


def test_every_module_maps_to_a_native_weight_of_its_shape(exported):
    """``transformer.<module>`` -> a native weight whose shape (ComfyUI's constructor formula where it fuses or
    renames) equals the diffusers weight's, or a row slice of a fused weight of exactly that many rows."""
    family, base, key_map = exported["family"], exported["base"], exported["key_map"]
    modules = {k[: -len(".lora_A.weight")] for k in exported["lora"] if k.endswith(".lora_A.weight")}
    assert modules and all(m.startswith("transformer.") for m in modules)
    for module in sorted(modules):
        assert module in key_map, f"{family}: ComfyUI has no target for {module}"
        target, diffusers_shape = key_map[module], tuple(base[module[len("transformer."):] + ".weight"].shape)
        key, offset = target if isinstance(target, tuple) else (target, None)
        native_shape = comfy.native_shape(family, exported["config"], key) or tuple(exported["native"][key].shape)
        assert tuple(exported["native"][key].shape) == native_shape, f"{family}: {key} assembled at the wrong size"
        if offset is None:
            assert native_shape == diffusers_shape, f"{family}: {module} {diffusers_shape} -> {key} {native_shape}"
        else:
            dim, start, size = offset
            assert dim == 0 and start + size <= native_shape[0], f"{family}: {module} slice outside {key}"
            assert (size, *native_shape[1:]) == diffusers_shape, f"{family}: {module} -> rows of {key}"


def test_comfyui_loads_every_key_and_applies_the_trained_delta(exported):
    """No key is left unloaded, no ``.alpha`` is read (scale 1.0), and at strength 1.0 each native weight moves by
    the trained ``(alpha / r) B A`` of the modules mapped onto it, fused slices included."""
    lora, native = exported["lora"], exported["native"]
    patches, loaded = comfy.load_lora(lora, exported["key_map"])
    assert loaded == set(lora), f"not loaded: {sorted(set(lora) - loaded)[:3]}"
    assert len(patches) == len(exported["deltas"])  # one patch per module: none overwrote another
    assert {comfy.patch_scale(*p) for p in patches.values()} == {1.0}  # the scale is folded into lora_B
    patched = comfy.apply_patches(native, patches, strength=1.0)
    expected = comfy.to_native(exported["deltas"], exported["dmap"], native)
    moved = 0
    for key in native:
        torch.testing.assert_close(patched[key] - native[key], expected[key], atol=1e-6, rtol=0)
        moved += bool(expected[key].abs().max() > 0)
    assert moved > 0


def test_wan_diffusers_keys_are_not_mapped_by_comfyui(tmp_path):
    """Not supported, and not faked: ComfyUI maps Wan LoRAs only by native names (``diffusion_model.blocks.N.
    self_attn.q``, ``lora_unet_blocks_N_self_attn_q``); the diffusers names of the export match none of them."""
    policy, lora, _ = _export("wan", tmp_path)
    with pytest.raises(ValueError, match="no WAN branch"):
        comfy.diffusers_map("wan", policy.transformer.config)
    native = [f"{comfy.PREFIX}blocks.{i}.{attn}.{p}.weight" for i in range(policy.transformer.config.num_layers)
              for attn in ("self_attn", "cross_attn") for p in "qkvo"]  # comfy/ldm/wan/model.py attention layers
    native += [f"{comfy.PREFIX}blocks.{i}.ffn.{n}.weight" for i in range(policy.transformer.config.num_layers)
               for n in (0, 2)]
    patches, loaded = comfy.load_lora(lora, comfy.model_lora_keys_unet("wan", native, {}))
    assert lora and not patches and not loaded


def test_wan_kohya_file_loads_in_comfyui_by_native_names(tmp_path):
    """Wan's way into ComfyUI is the kohya file: ``lora_unet_<native name>`` keys, matched by ComfyUI's generic
    rule against the native Wan weights listed by hand from the original Wan model (self_attn / cross_attn q, k,
    v, o), each moved by the trained ``(alpha / r) B A`` of its diffusers module at strength 1.0."""
    from flowrl.models.lora_io import KOHYA_WEIGHT_NAME

    policy, _, deltas = _export("wan", tmp_path)
    write_lora_files(tmp_path, lora_state_dict(policy.transformer), lora_config_dict(policy.transformer), family="wan",
                     base_model="tiny", config_text=None, format="kohya")
    kohya = load_file(str(tmp_path / KOHYA_WEIGHT_NAME))
    layers = policy.transformer.config.num_layers
    diffusers_of = {"self_attn": "attn1", "cross_attn": "attn2"}
    pieces = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"}
    native = {f"{comfy.PREFIX}blocks.{i}.{attn}.{p}.weight": f"blocks.{i}.{diffusers_of[attn]}.{d}.weight"
              for i in range(layers) for attn in diffusers_of for p, d in pieces.items()}
    patches, loaded = comfy.load_lora(kohya, comfy.model_lora_keys_unet("wan", list(native), {}))
    assert loaded == set(kohya) and len(patches) == len(deltas) == len(native)
    for key, (up, down, alpha) in patches.items():
        delta = comfy.patch_scale(up, down, alpha) * up.float() @ down.float()
        torch.testing.assert_close(delta, deltas[native[key]], atol=1e-6, rtol=0)
