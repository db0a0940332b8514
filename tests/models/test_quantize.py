"""A quantised frozen base with a LoRA on top (``model.quantize``, issue 34 item 2), on the tiny SD3 model on a CPU.

int8 (torchao weight-only) runs on the CPU, so it is the scheme tested end to end: a 2-epoch GRPO run trains only
the LoRA (the quantised weights' int8 data and scales are the same bits after it), its exported LoRA loads into the
unquantised base in plain diffusers and draws the unquantised run's images within a stated tolerance, the reference
is the same quantised model with the adapter off, and resume works with the 8-bit optimizer on it. nf4 and fp8 need
CUDA: here they are the one-line errors a CPU run gets, as is each option a quantised base cannot combine with.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("torchao")

from flowrl.cli import main
from flowrl.config import Config, load_config
from flowrl.models import build_policy
from flowrl.models.quantize import check_quantize, is_quantized, quantized_tensors
from flowrl.models.tiny import tiny_sd3_pipeline
from flowrl.recipes.grpo import train
from flowrl.training.metrics import read_metrics
from tests.two_processes import TWO_PROCESSES, launch_failure

SMOKE = "configs/smoke/sd3_tiny.yaml"
RUN = ["log.eval_every=0", "log.report_prompts=0", "log.progress=false", "train.epochs=2", "train.learning_rate=1e-2",
       "train.async_rewards=false"]
PROMPTS, SEED = ["a red apple", "a blue car"], 0


def plain_base(policy) -> dict[str, torch.Tensor]:
    """The base's weights that are not quantised (norms, biases, embeddings), by name."""
    return {n: p.detach().clone() for n, p in policy.transformer.named_parameters()
            if "lora_" not in n and not hasattr(p, "__tensor_flatten__")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-epoch GRPO run on the tiny SD3 model, unquantised and under int8, with the int8 run's policy and
    copies of its quantised and plain base weights as built."""
    import flowrl.recipes.start as start

    root, captured = tmp_path_factory.mktemp("quantize"), {}
    real_build = start.build_training_policy

    def build_and_capture(cfg, device):
        policy = real_build(cfg, device)
        captured[cfg.model.quantize] = dict(policy=policy, quantized=quantized_tensors(policy.transformer),
                                            plain=plain_base(policy),
                                            lora={n: p.detach().clone() for n, p in policy.named_trainable_parameters()})
        captured[cfg.model.quantize]["quantized"] = {k: v.clone() for k, v in captured[cfg.model.quantize][
            "quantized"].items()}
        return policy

    start.build_training_policy = build_and_capture
    try:
        for scheme in ("none", "int8"):
            train(load_config(Config, SMOKE, [*RUN, f"run_dir={root / scheme}", f"model.quantize={scheme}"]))
    finally:
        start.build_training_policy = real_build
    return root, captured


def test_int8_run_trains_only_the_lora_and_leaves_the_quantised_base_bit_for_bit(runs):
    _, captured = runs
    run = captured["int8"]
    policy = run["policy"]
    after = quantized_tensors(policy.transformer)
    # every linear of the transformer is int8 data + a scale (and zero point) per output row; none moved a bit
    assert after and set(after) == set(run["quantized"])
    assert {"qdata", "scale"} <= {name.rsplit(".", 1)[1] for name in after}
    assert all(v.dtype == torch.int8 for k, v in after.items() if k.endswith(".qdata"))
    assert all(torch.equal(run["quantized"][k], after[k]) for k in after)
    plain = plain_base(policy)
    assert plain and all(torch.equal(run["plain"][k], plain[k]) for k in plain)
    # the LoRA is plain float32 and trained
    lora = dict(policy.named_trainable_parameters())
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in lora.values())
    assert any(not torch.equal(run["lora"][n], lora[n]) for n in lora)
    assert not is_quantized(captured["none"]["policy"].transformer)


def render(pipeline, lora_dir=None) -> torch.Tensor:
    """Plain diffusers: the pipeline's own __call__ on fixed prompts and seed -> [2, 3, 64, 64] in [0, 1]."""
    if lora_dir is not None:
        pipeline.load_lora_weights(str(lora_dir))
    generator = torch.Generator().manual_seed(SEED)
    return pipeline(PROMPTS, num_inference_steps=4, guidance_scale=4.5, generator=generator, output_type="pt",
                    height=64, width=64, max_sequence_length=32).images


def test_exported_lora_loads_into_the_unquantised_base_and_matches_the_unquantised_run(runs):
    root, _ = runs
    keys = list(load_file(str(root / "int8" / "lora" / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert not any(word in k for k in keys for word in ("base_layer", "qdata", "scale", "quant", "default"))
    assert keys == list(load_file(str(root / "none" / "lora" / "pytorch_lora_weights.safetensors")))
    base = render(tiny_sd3_pipeline(0))
    plain_run = render(tiny_sd3_pipeline(0), root / "none" / "lora")
    int8_run = render(tiny_sd3_pipeline(0), root / "int8" / "lora")
    # Measured (torch 2.14.1, torchao 0.18.0, 2 CPU cores): the trained LoRA moves the images by 0.050 max / 0.0038
    # mean from the base; the int8-trained LoRA's images differ from the unquantised run's by 0.0017 max / 1.1e-4
    # mean, and int8 itself (the same LoRA over the int8 base rather than the unquantised one) by 0.0089 max.
    # Tolerance: no pixel further than int8's own rounding moves it (0.01), and on average under 10% of what
    # training changed, so a LoRA that learnt something else (or nothing) fails.
    change = (plain_run - base).abs().mean().item()
    assert change > 1e-3, "the runs did not train: nothing to compare"
    assert (int8_run - plain_run).abs().max().item() < 0.01
    assert (int8_run - plain_run).abs().mean().item() < 0.1 * change


def test_export_merge_fuses_the_lora_into_the_unquantised_base(runs, tmp_path):
    """``flowrl export-lora --merge`` of the int8 run rebuilds the base from the run's config without quantising
    it: the fused transformer is plain float weights, loadable with ``from_pretrained``."""
    from diffusers import SD3Transformer2DModel

    from flowrl.commands.export import export_lora

    root, _ = runs
    export_lora(root / "int8", tmp_path / "out", merge=True)
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "out" / "transformer")
    assert not is_quantized(merged) and all(type(p) is torch.nn.Parameter for p in merged.parameters())


def test_reference_is_the_same_quantised_model_with_the_adapter_off():
    torch.manual_seed(0)
    policy = build_policy("sd3", "tiny", quantize="int8")
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.copy_(torch.randn_like(param) * 0.05)  # a LoRA that changes the output
    bare_int8, plain = build_policy("sd3", "tiny", quantize="int8"), build_policy("sd3", "tiny")
    x = policy.init_noise(2, generator=torch.Generator().manual_seed(1))  # [2, C, h, w]
    cond = policy.encode(PROMPTS)
    with torch.no_grad():
        adapted = policy.velocity(x, 0.5, cond, 4.5)
        with policy.reference():
            reference = policy.velocity(x, 0.5, cond, 4.5)
        assert is_quantized(policy.transformer)  # the reference pass ran on these weights, not a copy
        expected = bare_int8.velocity(x, 0.5, cond, 4.5)
        unquantised = plain.velocity(x, 0.5, cond, 4.5)
    assert torch.equal(reference, expected)  # the quantised base, exactly
    assert not torch.allclose(reference, adapted, atol=1e-4)  # the adapter was off
    assert (reference - unquantised).abs().max() > 0  # and the base is the quantised one, not the float one
    assert policy.velocity(x, 0.5, cond, 4.5).equal(adapted)  # and back on after the block


def test_resume_with_a_quantised_base_and_8bit_adam(tmp_path):
    """Checkpoints hold only the LoRA, EMA and (8-bit) optimizer state; a run resumed from epoch 1 on the
    quantised base, with gradient checkpointing on and a cosine schedule, ends with the uninterrupted run's LoRA
    and learning rates."""
    common = [*RUN, "model.quantize=int8", "train.optimizer=adamw8bit", "model.gradient_checkpointing=true",
              "train.checkpoint_every=1", "sampling.num_steps=2", "sampling.group_size=2",
              "sampling.prompts_per_batch=1", "train.micro_batch_size=2", "lora.rank=2", "train.ema=false",
              "train.lr_scheduler=cosine", "train.lr_warmup_steps=1"]  # the lr is a tensor under AdamW8bit
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(load_config(Config, SMOKE, [*common, f"run_dir={full}", "train.epochs=3"]))
    shutil.copytree(full, resumed)  # the run as a kill after its second checkpoint leaves it
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    shutil.rmtree(resumed / "lora")
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    train(load_config(Config, SMOKE, [*common, f"run_dir={resumed}", "train.epochs=3", "train.resume=latest"]))
    step = resumed / "checkpoints" / "step_000002"
    lora = load_file(str(step / "lora.safetensors"))
    assert all("lora_" in k for k in lora)  # no base weight in a checkpoint
    assert json.loads((step / "trainer_state.json").read_text())["epoch"] == 2
    expected = load_file(str(full / "checkpoints" / "step_000002" / "lora.safetensors"))
    assert all(torch.equal(lora[k], expected[k]) for k in expected)
    lrs = [[r["optim/lr"] for r in read_metrics(run)] for run in (full, resumed)]
    assert lrs[0] == lrs[1] and len(set(lrs[0])) == 3  # warm-up, then cosine: three different rates


def test_adamw8bit_keeps_8bit_moments_that_a_checkpoint_saves_and_loads(tmp_path):
    """torchao's AdamW8bit quantises the moments of tensors of >= 4096 values (the tiny LoRA's are smaller and
    keep float32 ones); its state goes through the checkpoint's torch.save / torch.load(weights_only=True)."""
    from flowrl.recipes.build import build_optimizer

    cfg = load_config(Config, SMOKE, ["train.optimizer=adamw8bit"])
    param = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = build_optimizer(cfg, [param], "cpu")
    param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state[param]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit" and state["exp_avg"].codes.dtype == torch.uint8
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    again = build_optimizer(cfg, [param], "cpu")
    again.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert torch.equal(again.state[param]["exp_avg"].codes, state["exp_avg"].codes)


BAD = [  # (overrides, words of the one error line); each on this CPU machine
    (["model.quantize=nf4"], ["model.quantize=nf4", "CUDA"]),
    (["model.quantize=fp8"], ["model.quantize=fp8", "compute capability"]),
    (["model.quantize=int4"], ["model.quantize", "int4"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[o[0] for o, _ in BAD])
def test_a_scheme_this_machine_cannot_run_is_one_line_and_no_run_dir(tmp_path, capsys, overrides, words):
    run = tmp_path / "run"
    assert main(["train", SMOKE, f"run_dir={run}", "train.epochs=1", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowrl train: error:") and all(w in err[0] for w in words), err
    assert not run.exists()


def test_nf4_on_a_cpu_is_one_stderr_line_in_a_fresh_process(tmp_path):
    """The whole stderr of the command, imports included: torchao and diffusers log nothing on the way."""
    import subprocess
    import sys

    from tests import REPO

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FLOWRL_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "flowrl", "train", SMOKE, f"run_dir={tmp_path / 'run'}",
                             "model.quantize=nf4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("flowrl train: error: model.quantize=nf4 needs a CUDA GPU")
    assert not (tmp_path / "run").exists()


def test_nf4_without_bitsandbytes_and_fp8_on_an_older_gpu_are_one_line(monkeypatch):
    import importlib.util

    import flowrl.models.quantize as quantize

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(quantize.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="needs bitsandbytes, which is not installed"):
        check_quantize("nf4", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9.*this GPU has 8.0"):
        check_quantize("fp8", "cuda")
    check_quantize("int8", "cuda")  # int8 runs wherever torchao does


def test_options_a_quantised_base_cannot_combine_with_are_one_line(tmp_path, capsys, monkeypatch):
    import flowrl.recipes.build as build

    def one_line(*overrides) -> str:
        run = tmp_path / "run"
        assert main(["train", SMOKE, f"run_dir={run}", "train.epochs=1", *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("flowrl train: error:"), err
        assert not run.exists()
        return err[0]

    with monkeypatch.context() as env:  # an FSDP launch (accelerate sets this): the quantised weights cannot shard
        env.setenv("ACCELERATE_USE_FSDP", "true")
        assert "cannot be sharded by FSDP" in one_line("model.quantize=int8")
        assert "adamw8bit's 8-bit state cannot be sharded" in one_line("train.optimizer=adamw8bit")
    with monkeypatch.context() as env:  # torchao's 8-bit AdamW compiles its step: no C++ compiler, no CPU run
        env.setattr(build.shutil, "which", lambda name: None)
        assert "needs a C++ compiler" in one_line("train.optimizer=adamw8bit")
    with monkeypatch.context() as env:
        real_find_spec = build.importlib.util.find_spec
        env.setattr(build.importlib.util, "find_spec", lambda name, *a: None if name == "torchao"
                    else real_find_spec(name, *a))
        assert "flowrl[quant]" in one_line("train.optimizer=adamw8bit")


def test_quant_memory_script_counts_flux_and_orders_the_schemes(capsys):
    """scripts/bench/quant_memory.py (the docs/scaling.md table): FLUX.1-dev's 11.901B parameters, counted on the
    meta device, the sized config's LoRA and T5 length, and nf4 < int8 < bf16 in weights and every row's step peak."""
    import importlib.util

    from tests import REPO

    spec = importlib.util.spec_from_file_location("quant_memory", REPO / "scripts/bench/quant_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--json"])
    out = capsys.readouterr().out
    # the 24 GB config's LoRA, r 32 on train_flux.py's 12 targets, by hand: 19 double-stream blocks x (8 square
    # 3072 projections + 4 feed-forward 3072<->12288) + 38 single-stream blocks x q, k, v, at r (in + out) each
    by_hand = 32 * (19 * (8 * 6144 + 4 * 15360) + 38 * 3 * 6144)
    assert by_hand == 89_653_248 and "LoRA r=32: 89.7M" in out and "12 target modules, 128 T5 tokens" in out
    assert "11.901B parameters" in out and "bf16 23.80 GB" in out
    rows = json.loads(out[out.index("\n[") + 1:])
    peak = {(r["scheme"], r["size"], r["group"]): r["step_gb"] for r in rows}
    for size, group in {(s, g) for _, s, g in peak}:
        assert peak["nf4", size, group] < peak["int8", size, group] < peak["bf16", size, group]


@pytest.mark.slow
def test_two_ddp_processes_on_a_quantised_base_match_one(tmp_path):
    """DDP leaves the quantised base alone (it would broadcast it, and torchao's tensors cannot be viewed for
    that): 2 gloo CPU processes under int8 give 1 process's metrics and LoRA on the same global batch, to the
    tolerance of tests/training/test_distributed.py."""
    import subprocess

    from tests import REPO

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    common = [SMOKE, *RUN, "model.quantize=int8", "train.beta=0.04", "train.clip_range=0.2"]
    result = subprocess.run([*TWO_PROCESSES, "-m", "flowrl", "train", *common, f"run_dir={tmp_path / 'two'}",
                             "sampling.prompts_per_batch=2"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, launch_failure(result.stderr)
    assert main(["train", *common, f"run_dir={tmp_path / 'one'}", "sampling.prompts_per_batch=4"]) == 0
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        for key in a:
            if not key.startswith("perf/") and key != "step":
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    lora_one, lora_two = (load_file(tmp_path / r / "lora" / "pytorch_lora_weights.safetensors") for r in ("one", "two"))
    for key in lora_one:
        assert (lora_one[key] - lora_two[key]).norm() / lora_one[key].norm().clamp(min=1e-12) < 1e-2, key
