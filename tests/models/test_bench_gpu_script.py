"""scripts/bench/gpu_full_size.py without a GPU: the quick CPU run of every family prints every row of its table,
the published transformer configs it builds have the published parameter counts (counted on the meta device),
and the full mode on a machine without CUDA is one line."""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys

import pytest

from tests import REPO

SCRIPT = REPO / "scripts/bench/gpu_full_size.py"
CONFIGS = {"sd3": REPO / "configs/models/sd35_medium_transformer.json",
           "flux": REPO / "configs/models/flux1_dev_transformer.json",
           "qwen_image": REPO / "configs/models/qwen_image_transformer.json",
           "wan": REPO / "configs/models/wan21_t2v_1_3b_transformer.json",
           "z_image": REPO / "configs/models/z_image_turbo_transformer.json",
           "flux2_klein": REPO / "configs/models/flux2_klein_4b_transformer.json",
           "flux2_dev": REPO / "configs/models/flux2_dev_transformer.json",
           "wan22_ti2v": REPO / "configs/models/wan22_ti2v_5b_transformer.json",
           "wan22_t2v": REPO / "configs/models/wan22_t2v_a14b_transformer.json",
           "qwen_image_edit": REPO / "configs/models/qwen_image_transformer.json",
           "qwen_image_edit_plus": REPO / "configs/models/qwen_image_transformer.json"}
CONFIGS.update({"wan_i2v": REPO / "configs/models/wan21_i2v_14b_transformer.json",
                "wan22_i2v": REPO / "configs/models/wan22_i2v_a14b_transformer.json"})
CONFIGS.update({"ltx2": REPO / "configs/models/ltx2_transformer.json"})
CONFIGS.update({"hunyuan_video15": REPO / "configs/models/hunyuan_video15_480p_transformer.json",
                "hunyuan_video15_i2v": REPO / "configs/models/hunyuan_video15_480p_transformer.json"})
LABELS = {"sd3": "SD3.5-Medium", "flux": "FLUX.1-dev", "flux_kontext": "FLUX.1-Kontext-dev",
          "flux2_klein": "FLUX.2-klein-4B", "flux2_dev": "FLUX.2-dev", "qwen_image": "Qwen-Image",
          "z_image": "Z-Image-Turbo", "wan": "Wan2.1-T2V-1.3B", "wan22_ti2v": "Wan2.2-TI2V-5B",
          "wan22_t2v": "Wan2.2-T2V-A14B", "qwen_image_edit": "Qwen-Image-Edit",
          "qwen_image_edit_plus": "Qwen-Image-Edit-2509"}
LABELS.update({"wan_i2v": "Wan2.1-I2V-14B", "wan22_i2v": "Wan2.2-I2V-A14B"})
LABELS.update({"ltx2": "LTX-2"})
LABELS.update({"hunyuan_video15": "HunyuanVideo-1.5-480p-T2V", "hunyuan_video15_i2v": "HunyuanVideo-1.5-480p-I2V"})
NO_GPU = "needs an NVIDIA GPU (found none); run with --quick --device cpu for a smoke test"
STAGES = ("model load", "rollout", "train step (checkpointing off)", "train step (checkpointing on)",
          "train step + KL reference", "attention sdpa", "attention xformers")


def run_script(*args: str, cuda_visible: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow  # a whole command in subprocesses, 10-20 s
def test_quick_cpu_run_prints_every_row_of_every_family(tmp_path):
    from flowrl.models import FAMILIES

    assert set(FAMILIES) == set(LABELS)
    out = tmp_path / "bench.json"
    proc = run_script("--quick", "--device", "cpu", "--family", "all", "--repeats", "1", "--out", str(out),
                      timeout=300)  # one timed call a stage: the rows, not the timings, are under test
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| family | stage | flowrl | baseline | ratio |")
    for label in LABELS.values():
        for stage in STAGES:
            assert any(line.startswith(f"| {label} | {stage} |") for line in table), (label, stage, proc.stdout)
    data = json.loads(out.read_text())
    assert data["meta"]["quick"] is True and len(data["rows"]) == len(FAMILIES) * len(STAGES)
    assert data["meta"]["families"] == list(FAMILIES)
    rows = {(r["family"], r["stage"]): r for r in data["rows"]}
    for family in FAMILIES:
        rollout = rows[family, "rollout"]
        assert rollout["flowrl_s"] > 0 and rollout["baseline_s"] > 0 and rollout["ratio"] > 0
        assert "log-probs finite: True" in rollout["note"]
        for stage in ("train step (checkpointing off)", "train step (checkpointing on)"):
            assert rows[family, stage]["ratio"] > 0
    assert data["table"] in proc.stdout


def test_full_mode_without_cuda_is_one_line():
    for args in ((), ("--device", "cpu")):
        proc = run_script(*args, cuda_visible="", timeout=60)
        assert proc.returncode == 1
        assert proc.stdout.strip() == NO_GPU, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr


@functools.lru_cache(maxsize=None)
def _meta_model(family: str):
    """(spec, model) on the meta device. Buffers too: SD3's 384x384 sin-cos table takes ~20 s to fill on 2 busy
    cores and is not a parameter."""
    import diffusers
    from accelerate import init_empty_weights

    spec = json.loads(CONFIGS[family].read_text())
    model_class = getattr(diffusers, spec["transformer"]["class"])
    config = spec["transformer"]["config"]
    accepted = set(inspect.signature(model_class.__init__).parameters) - {"self"}
    assert set(config) <= accepted, set(config) - accepted  # every field is one of the class's keywords
    with init_empty_weights(include_buffers=True):
        model = model_class.from_config(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    return spec, model


@pytest.mark.parametrize("family, low, high, exact", [
    ("sd3", 2.24e9, 2.5e9, 2_243_171_520),   # SD3.5-Medium: "2.5B" with its 226M-value position table
    ("flux", 11.85e9, 11.95e9, 11_901_408_320),  # FLUX.1-dev: "12B"
    ("qwen_image", 20.0e9, 20.6e9, 20_430_401_088),  # Qwen-Image: "20B"
    ("wan", 1.3e9, 1.45e9, 1_418_996_800),  # Wan2.1-T2V-1.3B: "1.3B"
    ("z_image", 6.0e9, 6.3e9, 6_154_908_736),  # Z-Image-Turbo: "6B"
    ("flux2_klein", 3.8e9, 4.1e9, 3_875_544_576),  # FLUX.2 [klein] 4B: "4B"
    ("flux2_dev", 32.0e9, 32.5e9, 32_223_281_152),  # FLUX.2 [dev]: "32B"
    ("wan22_ti2v", 4.9e9, 5.1e9, 4_999_787_712),  # Wan2.2-TI2V-5B: "5B"
    ("wan_i2v", 16.3e9, 16.5e9, 16_394_878_784),  # Wan2.1-I2V-14B: "14B" (the model card's; 16.4B with its CLIP layers)
    ("ltx2", 18.8e9, 19.0e9, 18_876_174_592),  # LTX-2: "19B" (video and audio streams together)
    ("hunyuan_video15", 8.3e9, 8.35e9, 8_326_608_160),  # HunyuanVideo-1.5: "8.3B" (T2V and I2V: one architecture)
    ("wan22_i2v", 14.2e9, 14.4e9, 14_288_901_184),  # Wan2.2-I2V-A14B: "A14B", 14B per expert
])
def test_published_configs_have_published_sizes(family, low, high, exact):
    spec, model = _meta_model(family)
    params = sum(p.numel() for p in model.parameters())
    assert low <= params <= high and params == exact
    config = model.config
    if family not in ("sd3", "flux"):
        # every new family pads (or trims from) 512 text tokens; LTX-2 1024 (its Gemma text, registers 128)
        assert spec["text"]["tokens"] == {"ltx2": 1024, "hunyuan_video15": 1000}.get(family, 512)  # HunyuanVideo-1.5: 1000
        return
    if family == "sd3":
        assert (config.num_layers, config.num_attention_heads, config.attention_head_dim) == (24, 24, 64)
        assert list(config.dual_attention_layers) == list(range(13)) and config.qk_norm == "rms_norm"
        assert (config.joint_attention_dim, config.pooled_projection_dim, config.caption_projection_dim) == \
            (4096, 2048, 1536)
        assert (config.patch_size, config.in_channels, config.out_channels) == (2, 16, 16)
        assert (config.pos_embed_max_size, config.sample_size) == (384, 128)
        assert spec["scheduler"]["config"]["shift"] == 3.0
    else:
        assert (config.num_layers, config.num_single_layers) == (19, 38)
        assert (config.num_attention_heads, config.attention_head_dim) == (24, 128)
        assert (config.joint_attention_dim, config.pooled_projection_dim, config.in_channels) == (4096, 768, 64)
        assert config.guidance_embeds is True and list(config.axes_dims_rope) == [16, 56, 56]
        assert spec["scheduler"]["config"]["use_dynamic_shifting"] is True
    assert spec["text"]["t5_tokens"] == (256 if family == "sd3" else 512)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_default_lora_targets_exist_in_the_full_size_models(family):
    """The benchmark's LoRA (flowrl's default targets, r = 32) attaches to every target in the published models."""
    from peft import LoraConfig

    from flowrl.models.base import FLUX_LORA_TARGETS, SD3_LORA_TARGETS

    targets = SD3_LORA_TARGETS if family == "sd3" else FLUX_LORA_TARGETS
    import copy

    model = copy.deepcopy(_meta_model(family)[1])  # the cached model stays without adapter
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        assert any(name == target or name.endswith("." + target) for name in names), target
    model.add_adapter(LoraConfig(r=32, lora_alpha=64, target_modules=list(targets), init_lora_weights="gaussian"))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora == (18_776_064 if family == "sd3" else 130_844_672)
