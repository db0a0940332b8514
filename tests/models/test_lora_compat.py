"""Every exported LoRA file at the trained scale in every loader: diffusers, ComfyUI (re-implemented in
tools/comfyui_reference.py), kohya sd-scripts-style; the metadata; flowrl reading an export back.

Would have caught: the default file at half strength in ComfyUI (no ``.alpha``, scale 1.0 vs alpha/r = 2),
the SD3 comfyui file refused by diffusers (``.alpha`` keys), and the missing base model in the header."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flowrl.models import build_policy
from flowrl.models.lora_io import (COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, load_lora_into,
                                   lora_config_dict, lora_state_dict, read_lora, write_lora_files)
from tools import comfyui_reference as comfy
from tools.policy_capture import random_lora_policy

RANK, ALPHA = 4, 8.0  # scale 2, as in every shipped config
CONFIG_TEXT = "model:\n  family: {family}\n  path: tiny\nseed: 0\n"


@pytest.fixture(scope="module", params=["sd3", "flux"])
def exported(request, tmp_path_factory):
    family = request.param
    policy = random_lora_policy(family, RANK, ALPHA)
    state, config = lora_state_dict(policy.transformer), lora_config_dict(policy.transformer)
    out = tmp_path_factory.mktemp(f"export_{family}")
    text = CONFIG_TEXT.format(family=family)
    files = write_lora_files(out, state, config, family=family, base_model="tiny", config_text=text)
    files += write_lora_files(out, state, config, family=family, base_model="tiny", config_text=text,
                              format="comfyui")
    base = {k: v.detach().float().clone() for k, v in build_policy(family, "tiny", seed=0).transformer.state_dict().items()}
    deltas = {k[: -len(".lora_A.weight")] + ".weight": (ALPHA / RANK) * state[k.replace("lora_A", "lora_B")] @ v
              for k, v in state.items() if k.endswith(".lora_A.weight")}
    return {"family": family, "policy": policy, "state": state, "dir": out, "files": files, "base": base,
            "deltas": deltas, "config_text": text}


def _inputs(family, config):
    g = torch.Generator().manual_seed(0)
    if family == "sd3":
        return dict(hidden_states=torch.randn(2, config.in_channels, 8, 8, generator=g),
                    encoder_hidden_states=torch.randn(2, 5, config.joint_attention_dim, generator=g),
                    pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=g),
                    timestep=torch.tensor([300.0, 700.0]))
    return dict(hidden_states=torch.randn(2, 16, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(2, 5, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.3, 0.7]), guidance=torch.tensor([3.5, 3.5]),
                txt_ids=torch.zeros(5, 3), img_ids=torch.zeros(16, 3))


@torch.no_grad()
def _forward(family, transformer):
    return transformer(**_inputs(family, transformer.config), return_dict=False)[0]


@torch.no_grad()
def _manual_merge(exported):
    """The base transformer with W + (alpha / r) B A written into each adapted module: the reference."""
    transformer = build_policy(exported["family"], "tiny", seed=0).transformer
    params = dict(transformer.named_parameters())
    for key, delta in exported["deltas"].items():
        params[key].add_(delta)
    return transformer


def test_the_files_and_readme(exported):
    names = {p.name for p in exported["files"]}
    assert names == {DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, "README.md", COMFYUI_WEIGHT_NAME}
    readme = (exported["dir"] / "README.md").read_text()
    assert DIFFUSERS_WEIGHT_NAME in readme and KOHYA_WEIGHT_NAME in readme and "folded" in readme


@pytest.mark.parametrize("name", [DIFFUSERS_WEIGHT_NAME, COMFYUI_WEIGHT_NAME])
def test_loads_in_plain_diffusers_at_the_trained_scale(exported, name):
    """pipe.load_lora_weights gives the manual merge's output (the old SD3 comfyui file did not load at all)."""
    from flowrl.models import tiny

    family = exported["family"]
    pipe = tiny.tiny_sd3_pipeline(0) if family == "sd3" else tiny.tiny_flux_pipeline(0)
    pipe.load_lora_weights(str(exported["dir"]), weight_name=name)
    reference = _forward(family, _manual_merge(exported))
    torch.testing.assert_close(_forward(family, pipe.transformer), reference, atol=1e-5, rtol=0)
    assert not torch.allclose(reference, _forward(family, _base_transformer(family)), atol=1e-3)


def _base_transformer(family):
    return build_policy(family, "tiny", seed=0).transformer


@pytest.mark.parametrize("name", [DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME])
def test_comfyui_applies_the_trained_update(exported, name):
    """Through ComfyUI's key map and alpha rule every key is read and the delta is (alpha / r) B A."""
    family, base = exported["family"], exported["base"]
    dmap = comfy.diffusers_map(family, _base_transformer(family).config)
    native = comfy.native_weights(base, dmap)
    lora = load_file(str(exported["dir"] / name))
    patches, loaded = comfy.load_lora(lora, comfy.model_lora_keys_unet(family, native.keys(), dmap))
    assert loaded == set(lora), f"not loaded: {sorted(set(lora) - loaded)[:3]}"
    assert {comfy.patch_scale(*p) for p in patches.values()} == {1.0}  # the scale is in lora_B
    patched = comfy.apply_patches(native, patches)
    expected = comfy.to_native(exported["deltas"], dmap, native)
    for key in native:
        torch.testing.assert_close(patched[key] - native[key], expected[key], atol=1e-6, rtol=0)


def test_the_old_unfolded_file_was_half_strength_in_comfyui(exported):
    """The defect, shown with the reference: B unscaled and no .alpha -> ComfyUI applies B A, not 2 B A."""
    family, base = exported["family"], exported["base"]
    dmap = comfy.diffusers_map(family, _base_transformer(family).config)
    native = comfy.native_weights(base, dmap)
    old = {f"transformer.{k}": v for k, v in exported["state"].items()}
    patches, _ = comfy.load_lora(old, comfy.model_lora_keys_unet(family, native.keys(), dmap))
    patched = comfy.apply_patches(native, patches)
    expected = comfy.to_native(exported["deltas"], dmap, native)
    key = next(k for k in native if expected[k].abs().max() > 0)
    torch.testing.assert_close(patched[key] - native[key], expected[key] / 2, atol=1e-6, rtol=0)


def test_kohya_reader_applies_the_trained_update(exported):
    family, base = exported["family"], exported["base"]
    dmap = comfy.diffusers_map(family, _base_transformer(family).config)
    native = comfy.native_weights(base, dmap)
    lora = load_file(str(exported["dir"] / KOHYA_WEIGHT_NAME))
    deltas, loaded, scales = comfy.sd_scripts_deltas(lora, native.keys())
    assert loaded == set(lora) and set(scales.values()) == {1.0}
    expected = comfy.to_native(exported["deltas"], dmap, native)
    fused = [k for k in lora if k.endswith("attn_qkv.lora_down.weight")]
    assert fused and all(lora[k].shape[0] == 3 * RANK for k in fused)  # q, k, v fused into one rank-3r LoRA
    for key in native:
        torch.testing.assert_close(deltas.get(key, torch.zeros_like(native[key])), expected[key], atol=1e-6, rtol=0)


def test_metadata(exported):
    for name in (DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, COMFYUI_WEIGHT_NAME):
        with safe_open(str(exported["dir"] / name), framework="pt") as handle:
            meta = handle.metadata()
        assert meta["flowrl.base_model"] == f"{exported['family']}:tiny" and meta["flowrl.model_path"] == "tiny"
        assert meta["flowrl.rank"] == "4" and meta["flowrl.alpha_trained"] == "8" and meta["flowrl.alpha_stored"] == "4"
        assert meta["flowrl.scale_folded"] == "true" and meta["flowrl.scale_trained"] == "2"
        assert json.loads(meta["flowrl.target_modules"]) == sorted(exported["policy"].default_lora_targets())
        assert meta["flowrl.config_sha256"] == hashlib.sha256(exported["config_text"].encode()).hexdigest()[:16]
        assert meta["flowrl.version"] and meta["base_model_name_or_path"] == "tiny"
        if name != KOHYA_WEIGHT_NAME:
            adapter = json.loads(meta["lora_adapter_metadata"])
            assert adapter["transformer.r"] == RANK and adapter["transformer.lora_alpha"] == RANK
            assert adapter["transformer.base_model_name_or_path"] == "tiny"
        with safe_open(str(exported["dir"] / name), framework="pt") as handle:
            assert not any(k.endswith(".alpha") for k in handle.keys()) or name == KOHYA_WEIGHT_NAME


def test_flowrl_reads_an_export_back_as_the_trained_adapter(exported):
    """lora.init_from / sample --lora: the unfolded adapter, same alpha, same B, same outputs."""
    family = exported["family"]
    state, config = read_lora(exported["dir"])
    assert config["lora_alpha"] == ALPHA and int(config["r"]) == RANK
    assert all(torch.allclose(state[k], exported["state"][k], atol=1e-7, rtol=0) for k in exported["state"])
    policy = build_policy(family, "tiny", seed=0)
    load_lora_into(policy, exported["dir"] / DIFFUSERS_WEIGHT_NAME)
    assert policy.transformer.peft_config["default"].lora_alpha == ALPHA
    torch.testing.assert_close(_forward(family, policy.transformer),
                               _forward(family, exported["policy"].transformer), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="kohya-format"):
        read_lora(exported["dir"] / KOHYA_WEIGHT_NAME)


def test_check_lora_compat_script(exported, capsys):
    from tools import check_lora_compat

    assert check_lora_compat.main([str(exported["dir"])]) == 0
    out = capsys.readouterr().out
    assert out.count("comfyui    keys") == 3 and "effective 2.0000" in out
