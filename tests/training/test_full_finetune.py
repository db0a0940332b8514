"""Full fine-tuning (``model.trainable: full``, ``model.trainable_modules``) on the tiny SD3 pipeline: the base
weights move while the reference stays the base, GRPO and NFT train, a killed run resumes bit for bit, a pattern
trains only its modules, 2 FSDP2 processes match 1, the exported transformer folder loads in plain diffusers and
gives the trained model's images, the SVD LoRA is exact on a low-rank difference, and bad input is one line."""

import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.training.metrics import read_metrics
from tests import REPO
from tests.checkpoint_asserts import assert_same_optimizer_state, assert_same_safetensors
from tests.two_processes import launch_with, launch_failure

COMMON = ["configs/smoke/sd3_tiny.yaml", "log.progress=false", "log.eval_every=0", "train.beta=0.04",
          "train.learning_rate=1e-3", "model.trainable=full", "log.report_prompts=0"]


def _train(run_dir, *overrides):
    assert main(["train", *COMMON, f"run_dir={run_dir}", *overrides]) == 0


def _base_transformer():
    from flowrl.models.tiny import tiny_sd3_pipeline

    return tiny_sd3_pipeline(0).transformer


def _without_timings(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "grpo"
    _train(run, "train.epochs=3", "train.checkpoint_every=1", "train.clip_range=0.2")
    return run


def test_the_reference_is_the_base_swapped_in_and_the_trained_weights_come_back_bit_for_bit():
    from flowrl.models import build_policy

    policy = build_policy("sd3", "tiny")
    policy.train_full(["attn"])
    policy.full_weights.take_base()
    base = {n: p.detach().clone() for n, p in policy.named_trainable_parameters()}
    assert base and all("attn" in n for n in base)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p))
    trained = {n: p.detach().clone() for n, p in policy.named_trainable_parameters()}
    with policy.reference():
        assert all(torch.equal(p, base[n]) for n, p in policy.named_trainable_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in policy.named_trainable_parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.trainable_parameters())
    assert not any(p.requires_grad for p in policy.vae.parameters())


def test_grpo_moves_the_base_weights_and_the_kl_sees_the_frozen_base(grpo_run):
    weights = load_file(grpo_run / "checkpoints" / "step_000002" / "weights.safetensors")
    base = dict(_base_transformer().named_parameters())
    assert weights.keys() == base.keys()  # every transformer weight trains, and only those are saved
    assert all(not torch.equal(weights[k], base[k]) for k in weights)
    assert not (grpo_run / "checkpoints" / "step_000002" / "lora.safetensors").exists()
    metrics = read_metrics(grpo_run)
    assert metrics[0]["loss/kl"] == 0.0 and metrics[-1]["loss/kl"] > 0  # the reference stays the base


def test_a_killed_run_resumes_bit_for_bit(grpo_run, tmp_path):
    # What a kill after the second checkpoint leaves: that checkpoint latest, no later one, no export.
    resumed = tmp_path / "resumed"
    shutil.copytree(grpo_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    shutil.rmtree(resumed / "transformer")
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    _train(resumed, "train.epochs=3", "train.checkpoint_every=1", "train.clip_range=0.2", "train.resume=latest")
    assert _without_timings(read_metrics(resumed)) == _without_timings(read_metrics(grpo_run))
    assert_same_safetensors(grpo_run, resumed, ("checkpoints/step_000002/weights.safetensors",
                                                "checkpoints/step_000002/ema.safetensors",
                                                "transformer/diffusion_pytorch_model.safetensors"))
    assert_same_optimizer_state(grpo_run / "checkpoints/step_000002/optimizer.pt",
                                resumed / "checkpoints/step_000002/optimizer.pt")


def test_nft_trains_only_the_modules_a_pattern_matches(tmp_path):
    run = tmp_path / "nft"
    _train(run, "recipe=nft", "train.epochs=2", "model.trainable_modules=[attn\\.to_q, attn\\.to_k]")
    base = dict(_base_transformer().named_parameters())
    weights = load_file(next((run / "checkpoints").glob("step_*")) / "weights.safetensors")
    assert weights and all(".attn.to_q." in k or ".attn.to_k." in k for k in weights)
    assert all(not torch.equal(weights[k], base[k]) for k in weights)
    exported = load_file(run / "transformer" / "diffusion_pytorch_model.safetensors")
    untouched = [k for k in base if k not in weights]
    assert untouched and all(torch.equal(exported[k], base[k]) for k in untouched)
    assert read_metrics(run)[-1]["loss/kl"] > 0


def test_the_exported_folder_loads_in_plain_diffusers_and_gives_the_trained_models_images(grpo_run, tmp_path):
    from diffusers import SD3Transformer2DModel

    from flowrl.models import build_policy
    from flowrl.models.tiny import tiny_sd3_pipeline

    ema = load_file(grpo_run / "checkpoints" / "step_000002" / "ema.safetensors")  # what the run exported
    loaded = SD3Transformer2DModel.from_pretrained(grpo_run / "transformer")
    assert all(torch.equal(p, ema[n]) for n, p in loaded.named_parameters())

    pipe = tiny_sd3_pipeline(0)
    pipe.transformer = loaded
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=["a red cube"], num_inference_steps=3, guidance_scale=4.5, height=64, width=64,
                  output_type="pt", max_sequence_length=32)
    exported = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images

    policy = build_policy("sd3", "tiny")  # flowrl's trained model: the EMA weights in the policy
    policy.train_full()
    with torch.no_grad():
        for name, param in policy.named_trainable_parameters():
            param.copy_(ema[name])
    seeds = [0]
    trained = policy.pipeline_images(["a red cube"], group_size=1, num_steps=3, guidance_scale=4.5, seeds=seeds)
    base = build_policy("sd3", "tiny").pipeline_images(["a red cube"], group_size=1, num_steps=3,
                                                       guidance_scale=4.5, seeds=seeds)
    assert torch.allclose(exported, trained, atol=1e-6)
    assert not torch.allclose(exported, base, atol=1e-4)


def test_export_lora_svd_prints_its_error_and_loads_in_diffusers(grpo_run, tmp_path, capsys):
    from flowrl.models.tiny import tiny_sd3_pipeline

    out = tmp_path / "export"
    assert main(["export-lora", str(grpo_run), str(out), "--svd-rank", "4", "--ema"]) == 0
    printed = capsys.readouterr().out
    assert "SVD LoRA rank 4:" in printed and "relative reconstruction error mean" in printed and "max" in printed
    pipe = tiny_sd3_pipeline(0)
    pipe.load_lora_weights(out)  # plain diffusers reads the extracted LoRA
    assert (out / "transformer" / "config.json").is_file()


def test_svd_factors_are_exact_at_full_rank_and_optimal_below():
    from flowrl.models.svd_lora import extract_lora, svd_factors

    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(24, 3, generator=generator), torch.randn(3, 16, generator=generator)
    delta = left @ right  # [24, 16], rank 3 by construction
    for rank in (3, 8, 16):
        a, b, error = svd_factors(delta, rank)
        assert a.shape == (rank, 16) and b.shape == (24, rank)
        assert error < 1e-5 and torch.allclose(b @ a, delta, atol=1e-4)
    s = torch.linalg.svdvals(delta)
    _, _, error = svd_factors(delta, 1)  # Eckart-Young: the tail of the singular values
    assert error == pytest.approx(float(s[1:].norm() / s.norm()), rel=1e-4)

    base = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24))
    trained = {"0.weight": base[0].weight.detach() + delta, "1.weight": base[1].weight.detach() + 0.5}
    state, config, report = extract_lora(base, trained, 3)
    assert set(state) == {"0.lora_A.weight", "0.lora_B.weight"} and config["r"] == 3
    assert report.errors["0"] < 1e-5 and set(report.left_out) == {"1.weight"}
    assert "1 layers" in report.summary() and "cannot hold" in report.summary()


LAUNCHERS = {  # 2 CPU processes: FSDP2 (accelerate's fully_shard path over gloo) and DDP
    "fsdp2": ["--config_file", "configs/accelerate/fsdp2_cpu_2proc.yaml"],
    "ddp": ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_processes_match_one(tmp_path, launcher):
    overrides = ["train.epochs=2", "sampling.groups_per_epoch=4"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launch = [*launch_with(*LAUNCHERS[launcher]), "-m", "flowrl", "train"]
    result = subprocess.run([*launch, *COMMON, f"run_dir={tmp_path / 'two'}", *overrides], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, launch_failure(result.stderr)
    if launcher == "fsdp2":
        assert "FSDP2 over 2 processes: 66 of 66 trained transformer tensors sharded" in result.stdout + result.stderr
    _train(tmp_path / "one", *overrides)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 2 and two[-1]["loss/kl"] > 0
    for a, b in zip(one, two):
        for key in a:
            if not key.startswith("perf/") and key != "step":
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    for name in ("checkpoints/step_000001/weights.safetensors", "transformer/diffusion_pytorch_model.safetensors"):
        a, b = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        assert a.keys() == b.keys()
        assert max(float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) for k in a) < 1e-3, name


def _one_line(code, err, words, run=None):
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert all(word in errors[0] for word in words), errors[0]
    assert run is None or not run.exists(), f"{run} was left behind"


@pytest.mark.parametrize("overrides, words", [
    (["model.trainable=lora", "model.trainable_modules=[attn]"], ["model.trainable_modules", "lora.target_modules"]),
    (["lora.target_modules=[attn.to_q]"], ["lora.target_modules", "model.trainable_modules"]),
    (["model.trainable_modules=[nothing_is_named_so]"], ["model.trainable_modules", "matches no module"]),
    (["model.trainable_modules=['(']"], ["model.trainable_modules", "not a regular expression"]),
    (["model.trainable=partial"], ["model.trainable"]),
    (["model.quantize=int8"], ["model.quantize", "model.trainable=lora"]),
], ids=["modules_with_lora", "lora_targets_with_full", "pattern_matches_nothing", "bad_regex", "unknown_mode",
        "quantized_base"])
def test_bad_input_is_one_line_and_leaves_no_run_dir(overrides, words, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)
    run = tmp_path / "run"
    code = main(["train", *COMMON, f"run_dir={run}", "train.epochs=1", *overrides])
    _one_line(code, capsys.readouterr().err, words, run)


def test_resuming_a_lora_checkpoint_as_full_and_svd_of_a_lora_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)
    run = tmp_path / "lora_run"
    assert main(["train", *COMMON, f"run_dir={run}", "model.trainable=lora", "train.epochs=1"]) == 0
    capsys.readouterr()
    code = main(["train", *COMMON, f"run_dir={run}", "train.epochs=2", "train.resume=latest"])
    _one_line(code, capsys.readouterr().err, ["holds a LoRA", "model.trainable"])
    code = main(["export-lora", str(run), str(tmp_path / "out"), "--svd-rank", "4"])
    _one_line(code, capsys.readouterr().err, ["--svd-rank", "holds a LoRA already"])


def test_a_lora_fused_into_the_base_continues_as_full_training(tmp_path):
    """``lora.init_from`` with ``model.trainable=full``: the adapter's update is fused into the base weights, the peft
    layers are gone, and the model (and its reference) gives the LoRA'd model's velocities."""
    from flowrl.models import build_policy
    from flowrl.models.full_weights import merge_lora
    from flowrl.models.lora_io import load_lora_into, lora_config_dict, lora_state_dict, write_lora_files

    lora = build_policy("sd3", "tiny")
    lora.add_lora(rank=4, alpha=8, init_seed=0)
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    write_lora_files(tmp_path, lora_state_dict(lora.transformer), lora_config_dict(lora.transformer), family="sd3",
                     base_model="tiny", config_text=None, format="diffusers")
    full = build_policy("sd3", "tiny")
    load_lora_into(full, tmp_path / "pytorch_lora_weights.safetensors")
    merge_lora(full)
    full.train_full()
    full.full_weights.take_base()
    assert not any("lora" in n for n, _ in full.transformer.named_parameters())
    cond = lora.encode(["a red cube"], negative=False)
    x = lora.init_noise(1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = lora.velocity(x, 0.5, cond, 1.0)
        assert torch.allclose(full.velocity(x, 0.5, cond, 1.0), expected, atol=1e-5)
        with full.reference():
            assert torch.allclose(full.velocity(x, 0.5, cond, 1.0), expected, atol=1e-5)


def test_eval_of_a_full_checkpoint_is_one_line(grpo_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)
    code = main(["eval", "configs/smoke/sd3_tiny.yaml", "--checkpoint", str(grpo_run), "--out", str(tmp_path / "e")])
    _one_line(code, capsys.readouterr().err, ["full fine-tuning weights", "--svd-rank"], tmp_path / "e")


@pytest.mark.parametrize("args, words", [
    (["--format", "kohya"], ["fully fine-tuned weights", "--format kohya", "--svd-rank"]),
    (["--svd-rank", "0"], ["--svd-rank must be >= 1"]),
    (["--svd-rank", "4096"], ["--svd-rank 4096 is above the full rank", "use --svd-rank"]),
])
def test_an_export_of_full_weights_it_cannot_write_as_asked_is_one_line_and_writes_nothing(grpo_run, tmp_path, capsys,
                                                                                          monkeypatch, args, words):
    """--format kohya names a LoRA file, which full weights have only through --svd-rank; a rank of 0, or above every
    layer's full rank (all zero padding), is refused. None of them leaves a file or folder behind."""
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)
    out = tmp_path / "out"
    code = main(["export-lora", str(grpo_run), str(out), *args])
    _one_line(code, capsys.readouterr().err, words, out)
