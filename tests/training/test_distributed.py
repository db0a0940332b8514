"""Two CPU processes under ``accelerate launch`` reproduce one process with the same global batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.training.metrics import read_metrics
from tests import REPO
from tests.checkpoint_asserts import assert_same_optimizer_state, assert_same_safetensors
from tests.two_processes import TWO_PROCESSES, launch_with, launch_failure

COMMON = ["configs/smoke/sd3_tiny.yaml", "train.epochs=2", "log.progress=false", "log.eval_every=0",
          "train.beta=0.04", "train.learning_rate=1e-2", "train.clip_range=0.2"]


def _run(launcher: list[str], run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``flowrl train`` of the COMMON config under ``launcher``, asserted to succeed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "flowrl", "train", *COMMON, f"run_dir={run_dir}", *overrides]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, launch_failure(result.stderr)
    return result


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    """One process sampling 4 prompts a batch, the global batch every two-process run below makes, with a
    checkpoint each epoch for the FSDP2 test's comparison of checkpoint files (saving changes no number). It runs
    in the test process: a launch would only add the imports' seconds."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", *COMMON, f"run_dir={run_dir}", "sampling.prompts_per_batch=4",
                 "train.checkpoint_every=1"]) == 0
    return run_dir


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, one_process_run):
    """The same global batch set by hand (2 prompts a process). The FSDP2 test below and the full fine-tuning ones
    launch with ``sampling.groups_per_epoch=4`` instead, the batch derived per process
    (tests/recipes/test_run_options.py holds the derivation)."""
    # --multi_gpu selects accelerate's torchrun launcher; without CUDA each process joins a gloo group.
    _run(TWO_PROCESSES, tmp_path / "two", "sampling.prompts_per_batch=2")
    one, two = read_metrics(one_process_run), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in a:
            if key.startswith("perf/") or key == "step":
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    lora_one = load_file(one_process_run / "lora" / "pytorch_lora_weights.safetensors")
    lora_two = load_file(tmp_path / "two" / "lora" / "pytorch_lora_weights.safetensors")
    assert lora_one.keys() == lora_two.keys()
    for key in lora_one:
        # Adam divides by sqrt(v): on near-zero gradients float-order noise can move single entries by
        # up to the learning rate, so compare each tensor as a whole.
        difference = (lora_one[key] - lora_two[key]).norm() / lora_one[key].norm().clamp(min=1e-12)
        assert difference < 1e-2, (key, float(difference))


FSDP2_CPU = launch_with("--config_file", "configs/accelerate/fsdp2_cpu_2proc.yaml")


def _without_timings(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def _relative(a, b):
    return float((a - b).norm() / a.norm().clamp(min=1e-12))


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_and_resume_exactly(tmp_path, one_process_run):
    """FSDP2 (accelerate's fully_shard path, 2 gloo CPU processes, the LoRA'd transformer sharded per
    JointTransformerBlock): the same metrics as 1 process to the DDP test's tolerance, checkpoint files of
    the 1-process layout (gathered LoRA, EMA and AdamW state), an exact resume from the first checkpoint
    (a run killed after it, as tests/training/test_resume.py kills one) and the exported LoRA equal."""
    import shutil

    import torch

    overrides = ["sampling.groups_per_epoch=4", "train.checkpoint_every=1"]
    two, one, resumed = tmp_path / "two", one_process_run, tmp_path / "resumed"
    result = _run(FSDP2_CPU, two, *overrides)
    assert "FSDP2 over 2 processes: 30 of 30 LoRA tensors sharded" in result.stdout + result.stderr

    # 1. Metrics: as the DDP test compares them (sums over two shards reorder float additions).
    metrics_one, metrics_two = read_metrics(one), read_metrics(two)
    assert len(metrics_one) == len(metrics_two) == 2
    for a, b in zip(metrics_one, metrics_two):
        for key in a:
            if not key.startswith("perf/") and key != "step":
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key

    # 2. Checkpoints: the same files, keys, shapes and optimizer layout as 1 process, values to tolerance.
    for step in ("step_000000", "step_000001"):
        ck_one, ck_two = one / "checkpoints" / step, two / "checkpoints" / step
        assert sorted(p.name for p in ck_two.iterdir()) == sorted(
            [*(p.name for p in ck_one.iterdir()), "rng_rank1.pt"])
        for name in ("lora.safetensors", "ema.safetensors"):
            a, b = load_file(ck_one / name), load_file(ck_two / name)
            assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
            assert max(_relative(a[k], b[k]) for k in a) < 1e-2, (step, name)
        opt_one = torch.load(ck_one / "optimizer.pt", weights_only=True)
        opt_two = torch.load(ck_two / "optimizer.pt", weights_only=True)
        assert opt_one["param_groups"] == opt_two["param_groups"]
        assert opt_one["state"].keys() == opt_two["state"].keys()
        for index, state in opt_one["state"].items():
            for key, value in state.items():
                other = opt_two["state"][index][key]
                assert type(other) is torch.Tensor and other.shape == value.shape, (index, key)  # whole, not shards
                # exp_avg_sq holds squared gradients: their relative error doubles the gradients'
                assert _relative(value.double(), other.double()) < 1e-2, (step, index, key)

    # 3. Resume: the FSDP2 run killed after its first checkpoint and resumed under FSDP2 is bit-exact.
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000001")
    shutil.rmtree(resumed / "lora")
    (resumed / "checkpoints" / "latest").write_text("step_000000\n")
    _run(FSDP2_CPU, resumed, *overrides, "train.resume=latest")
    assert _without_timings(read_metrics(resumed)) == _without_timings(metrics_two)
    assert_same_safetensors(two, resumed, ("checkpoints/step_000001/lora.safetensors",
                                           "checkpoints/step_000001/ema.safetensors",
                                           "lora/pytorch_lora_weights.safetensors"))
    assert_same_optimizer_state(two / "checkpoints/step_000001/optimizer.pt",
                                resumed / "checkpoints/step_000001/optimizer.pt")

    # 4. Export: the FSDP2 run's final adapter (EMA weights, gathered) equals the 1-process one's.
    lora_one = load_file(one / "lora" / "pytorch_lora_weights.safetensors")
    lora_two = load_file(two / "lora" / "pytorch_lora_weights.safetensors")
    assert lora_one.keys() == lora_two.keys()
    assert max(_relative(lora_one[k], lora_two[k]) for k in lora_one) < 1e-2


def test_deepspeed_launch_without_cuda_is_one_line_and_no_run_dir(tmp_path):
    """`distributed_type: DEEPSPEED` sets ACCELERATE_USE_DEEPSPEED=true in every process; without CUDA
    (here) flowrl stops with one line before the run directory exists (accelerate would drop DeepSpeed
    silently on the CPU)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_DEEPSPEED": "true"}
    result = subprocess.run([sys.executable, "-m", "flowrl", "train", "configs/smoke/sd3_tiny.yaml",
                             f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "DeepSpeed" in lines[0] and "needs CUDA" in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, env, message", [
    ([], {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "ZeRO-3 is not supported"),
    ([], {}, "train.combine"),  # set below: with one reward the run would fall back to weighted
    (["train.resume=latest"], {}, "train.resume"),
    ([], {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, "gradient_accumulation_steps is 4"),
    ([], {"FLOWRL_NO_DEEPSPEED_PACKAGE": "1"}, "is not installed"),
])
def test_deepspeed_launch_refusals_on_a_simulated_gpu_machine(monkeypatch, overrides, env, message):
    """What a DeepSpeed launch on a CUDA machine refuses, with CUDA and the package simulated."""
    import importlib.machinery
    import importlib.util

    import torch

    from flowrl.config import Config, ConfigError, load_config
    from flowrl.recipes import build

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    missing = "FLOWRL_NO_DEEPSPEED_PACKAGE" in env
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        None if missing else importlib.machinery.ModuleSpec(name, None)) if name == "deepspeed" else real(name, *a))
    cfg = load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml", overrides)
    if message == "train.combine":
        cfg.train.combine = "marble"
    with pytest.raises(ConfigError, match=message) as error:
        build.check_deepspeed_launch(cfg, on_cpu=False)
    assert "\n" not in str(error.value)


class _StubAccelerator:
    def __init__(self, distributed_type):
        self.distributed_type, self.sync_gradients, self.unsynced = distributed_type, True, 0

    def no_sync(self, model):
        import contextlib

        self.unsynced += 1
        return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MULTI_GPU", "FSDP"])
def test_micro_batch_marks_the_accumulation_boundary(kind):
    """DeepSpeed: accelerate's sync_gradients is False during every backward but the step's last (so the
    engine steps once per optimizer step) and True after each; DDP/FSDP: no_sync on all but the last."""
    from accelerate.utils import DistributedType

    from flowrl.training.accumulate import micro_batch

    accelerator, seen = _StubAccelerator(DistributedType[kind]), []
    for i in range(3):
        with micro_batch(accelerator, None, last=i == 2):
            seen.append(accelerator.sync_gradients)
        assert accelerator.sync_gradients
    if kind == "DEEPSPEED":
        assert seen == [False, False, True] and accelerator.unsynced == 0
    else:
        assert seen == [True, True, True] and accelerator.unsynced == 2
