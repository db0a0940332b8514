"""``flowrl export-lora``: files plain diffusers / ComfyUI load, EMA export, merged transformer, CLI errors.

The per-loader scale checks (ComfyUI, kohya, diffusers for SD3 and FLUX) are in tests/models/test_lora_compat.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors import safe_open
from safetensors.torch import load_file

from flowrl.commands.export import COMFYUI_WEIGHT_NAME, KOHYA_WEIGHT_NAME, export_lora
from flowrl.config import Config
from flowrl.models import build_policy, tiny
from flowrl.models.lora_io import lora_config_dict, lora_state_dict
from flowrl.training.checkpoint import save_checkpoint
from flowrl.training.ema import LoraEMA
from tests import REPO

RANK, ALPHA = 4, 8.0


def _inputs(config):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(2, config.in_channels, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(2, 5, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=g),
                timestep=torch.tensor([300.0, 700.0]))


@torch.no_grad()
def _forward(transformer):
    return transformer(**_inputs(transformer.config), return_dict=False)[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir with one checkpoint whose LoRA (non-zero B) and EMA differ; plus reference outputs."""
    run_dir = tmp_path_factory.mktemp("run")
    policy = build_policy("sd3", "tiny")  # seed 0 = Config().seed, as export rebuilds it
    policy.add_lora(rank=RANK, alpha=ALPHA, init_seed=0)
    g = torch.Generator().manual_seed(1)
    params = policy.trainable_parameters()
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        ema = LoraEMA(policy.named_trainable_parameters(), decay=0.9)
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    raw_out = _forward(policy.transformer)  # the LoRA'd model's output, raw and with EMA weights
    with ema.swapped_in():
        ema_out = _forward(policy.transformer)
    optimizer = torch.optim.AdamW(params)
    save_checkpoint(run_dir, 5, lora_state=lora_state_dict(policy.transformer),
                    lora_config=lora_config_dict(policy.transformer), optimizer=optimizer, ema=ema,
                    trainer_state={"epoch": 5}, config=Config())
    return {"dir": run_dir, "ckpt": run_dir / "checkpoints" / "step_000005", "raw_out": raw_out, "ema_out": ema_out}


def test_diffusers_export_loads_in_plain_diffusers(run, tmp_path):
    (file,) = export_lora(run["dir"], tmp_path, format="diffusers")
    assert file == tmp_path / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), framework="pt") as handle:
        header = handle.metadata()
        keys = list(handle.keys())
    meta = json.loads(header["lora_adapter_metadata"])
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == RANK  # scale folded into lora_B
    assert header["flowrl.alpha_trained"] == "8" and header["flowrl.base_model"] == "sd3:tiny"
    assert keys and all(k.startswith("transformer.") for k in keys)
    pipe = tiny.tiny_sd3_pipeline(0)
    pipe.load_lora_weights(tmp_path)
    torch.testing.assert_close(_forward(pipe.transformer), run["raw_out"], atol=1e-5, rtol=0)
    assert not torch.allclose(run["raw_out"], _forward(tiny.tiny_sd3_pipeline(0).transformer), atol=1e-3)


def test_default_export_is_one_file_per_target_with_a_readme(run, tmp_path):
    paths = export_lora(run["dir"], tmp_path)
    assert [p.name for p in paths] == ["pytorch_lora_weights.safetensors", KOHYA_WEIGHT_NAME, "README.md"]
    assert "ComfyUI" in (tmp_path / "README.md").read_text()


def test_exported_files_take_the_umasks_mode_so_another_user_can_read_them(run, tmp_path):
    """safetensors writes 0600 files; an export is for a ComfyUI or diffusers server that may run as another user."""
    import os

    old = os.umask(0o022)
    try:
        paths = export_lora(run["dir"], tmp_path / "out")
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in paths} == {oct(0o644)}


def test_comfyui_export_is_the_folded_file_and_loads_in_diffusers(run, tmp_path):
    """It used to add .alpha tensors, which SD3's diffusers loader refuses; now lora_B carries alpha / r."""
    (file,) = export_lora(run["ckpt"], tmp_path, format="comfyui")
    assert file == tmp_path / COMFYUI_WEIGHT_NAME
    tensors, raw = load_file(str(file)), load_file(str(run["ckpt"] / "lora.safetensors"))
    assert not any(k.endswith(".alpha") for k in tensors)
    rest = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    assert rest.keys() == raw.keys()
    assert all(torch.equal(rest[k], raw[k] * (ALPHA / RANK if ".lora_B." in k else 1)) for k in raw)
    pipe = tiny.tiny_sd3_pipeline(0)
    pipe.load_lora_weights(tmp_path, weight_name=COMFYUI_WEIGHT_NAME)
    torch.testing.assert_close(_forward(pipe.transformer), run["raw_out"], atol=1e-5, rtol=0)


def test_ema_export_uses_ema_weights(run, tmp_path):
    export_lora(run["dir"], tmp_path, ema=True)
    pipe = tiny.tiny_sd3_pipeline(0)
    pipe.load_lora_weights(tmp_path)
    out = _forward(pipe.transformer)
    torch.testing.assert_close(out, run["ema_out"], atol=1e-5, rtol=0)
    assert not torch.allclose(out, run["raw_out"], atol=1e-4)

    no_ema = tmp_path / "no_ema"
    shutil.copytree(run["ckpt"], no_ema)
    (no_ema / "ema.safetensors").unlink()
    with pytest.raises(ValueError, match="no EMA weights"):
        export_lora(no_ema, tmp_path / "out", ema=True)


def test_merge_writes_a_plain_transformer(run, tmp_path):
    paths = export_lora(run["dir"], tmp_path, merge=True)
    assert paths[-1] == tmp_path / "transformer"
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(_forward(merged), run["raw_out"], atol=1e-4, rtol=0)


def _flowrl(*args):
    """The real command line in a subprocess (one test keeps the process boundary honest)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _in_process(capsys, *args):
    """``flowrl ARGS`` through :func:`flowrl.cli.main` in this process: the same parsing and one-line errors
    without a 5-second interpreter start per call."""
    from flowrl.cli import main
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def test_cli_export_comfyui(run, tmp_path):
    result = _flowrl("export-lora", str(run["dir"]), str(tmp_path / "out"), "--format", "comfyui")
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'out' / COMFYUI_WEIGHT_NAME}" in result.stdout
    assert (tmp_path / "out" / COMFYUI_WEIGHT_NAME).is_file()


def test_cli_missing_checkpoint_is_one_line_error(tmp_path, capsys):
    result = _in_process(capsys, "export-lora", str(tmp_path / "missing_run"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "no checkpoint" in result.stderr


def _one_line_error(result, text):
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert text in result.stderr, result.stderr


def test_cli_bad_input_is_one_line_error(run, tmp_path, capsys):
    untrained = tmp_path / "untrained"  # a run dir that has its config but no adapter yet
    untrained.mkdir()
    (untrained / "config.yaml").write_text("model:\n  family: sd3\n  path: tiny\n")
    _one_line_error(_in_process(capsys, "export-lora", str(untrained), str(tmp_path / "a")), "holds no adapter")
    out = tmp_path / "out"
    assert _in_process(capsys, "export-lora", str(run["dir"]), str(out), "--format", "diffusers").returncode == 0
    _one_line_error(_in_process(capsys, "export-lora", str(run["dir"]), str(out), "--format", "diffusers"), "--force")
    assert _in_process(capsys, "export-lora", str(run["dir"]), str(out), "--format", "diffusers", "--force").returncode == 0
    no_ema = tmp_path / "no_ema"
    shutil.copytree(run["ckpt"], no_ema)
    (no_ema / "ema.safetensors").unlink()
    _one_line_error(_in_process(capsys, "export-lora", str(no_ema), str(tmp_path / "b"), "--ema"), "no EMA weights")


def test_lora_state_dict_is_a_copy_so_the_ema_export_holds_the_ema_weights():
    """export_final_lora reads the state inside ema_weights(...): a view of the live float32 parameters
    would turn back into the raw weights when the block restores them, before the file is written."""
    from flowrl.recipes.finish import export_final_lora

    policy = build_policy("sd3", "tiny", seed=0)
    policy.add_lora(rank=RANK, alpha=ALPHA, init_seed=0)
    ema = LoraEMA(policy.named_trainable_parameters(), decay=0.5)
    ema.step()  # diffusers' first EMA step copies the weights
    ema.step()
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(0.25)  # the live weights move; the EMA lags at half the step
    ema.step()
    raw = lora_state_dict(policy.transformer)
    with ema.swapped_in():
        averaged = lora_state_dict(policy.transformer)
    assert all(not torch.equal(raw[k], averaged[k]) for k in raw)
    assert all(torch.equal(raw[k], v) for k, v in lora_state_dict(policy.transformer).items())  # restored
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        (Path(out) / "config.yaml").write_text("model:\n  family: sd3\n  path: tiny\n")
        file = export_final_lora(policy, ema, Path(out) / "lora")
        written = load_file(str(file))
        with safe_open(str(file), framework="pt") as handle:
            header = handle.metadata()
    assert header["flowrl.base_model"] == "sd3:tiny" and header["flowrl.config_sha256"] != "unknown"
    exported = {k.removeprefix("transformer."): v for k, v in written.items()}
    assert exported.keys() == averaged.keys()
    scale = ALPHA / RANK  # folded into lora_B
    assert all(torch.equal(exported[k], averaged[k] * (scale if ".lora_B." in k else 1)) for k in averaged)
