"""The shipped launch material is consistent: accelerate configs, prompt files, the multi-node script.

What is checked against the installed libraries rather than by eye: every file in
configs/accelerate is accepted by accelerate's own launcher and resolves to the process count,
precision and backend it claims; FSDP block classes exist in diffusers and occur in the SD3 / FLUX
transformers; every prompt file a flowrl config names exists and loads; OCR prompts quote their
target text; the launch script is valid bash and builds the accelerate command it documents.
"""

import importlib
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from flowrl.commands.data import DATASETS
from flowrl.config import Config, load_config
from flowrl.data.prompts import load_prompts
from tests import REPO
from tests.two_processes import launch_with, launch_failure

ACCELERATE = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
# training configs: not the accelerate launchers, provenance tables or reward service configs
FLOWRL_CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml")
                        if not {"accelerate", "provenance", "serve"} & set(p.relative_to(REPO / "configs").parts))
GPU_CONFIGS = [p for p in FLOWRL_CONFIGS if p.parent.name not in ("smoke", "toy")]
LAUNCH_SCRIPT = REPO / "scripts" / "launch_multinode.sh"

# file -> (distributed_type, num_processes, mixed_precision) it is documented to give
EXPECTED = {
    "ddp_8gpu.yaml": ("MULTI_GPU", 8, "bf16"),
    "ddp_1gpu.yaml": ("NO", 1, "bf16"),
    "fsdp2_sd3.yaml": ("FSDP", 8, "bf16"),
    "fsdp2_flux.yaml": ("FSDP", 8, "bf16"),
    "fsdp2_qwen_image.yaml": ("FSDP", 8, "bf16"),
    "fsdp2_wan.yaml": ("FSDP", 8, "bf16"),
    "fsdp2_z_image.yaml": ("FSDP", 8, "bf16"),
    "fsdp2_flux2.yaml": ("FSDP", 8, "bf16"),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 8, "bf16"),
    "multi_cpu_2proc.yaml": ("MULTI_GPU", 2, "no"),  # torchrun launcher on CPU: see configs/accelerate/README.md
    "fsdp2_cpu_2proc.yaml": ("FSDP", 2, "no"),  # flowrl moves the gloo group onto accelerate's FSDP2 path
}
# FSDP file -> (model family, where diffusers defines each block class)
FSDP_BLOCKS = {
    "fsdp2_sd3.yaml": ("sd3", {"JointTransformerBlock": "diffusers.models.attention"}),
    "fsdp2_cpu_2proc.yaml": ("sd3", {"JointTransformerBlock": "diffusers.models.attention"}),
    "fsdp2_flux.yaml": ("flux", {"FluxTransformerBlock": "diffusers.models.transformers.transformer_flux",
                                 "FluxSingleTransformerBlock": "diffusers.models.transformers.transformer_flux"}),
    "fsdp2_qwen_image.yaml": ("qwen_image", {
        "QwenImageTransformerBlock": "diffusers.models.transformers.transformer_qwenimage"}),
    "fsdp2_wan.yaml": ("wan", {"WanTransformerBlock": "diffusers.models.transformers.transformer_wan"}),
    "fsdp2_z_image.yaml": ("z_image", {"ZImageTransformerBlock": "diffusers.models.transformers.transformer_z_image"}),
    "fsdp2_flux2.yaml": ("flux2_klein", {
        "Flux2TransformerBlock": "diffusers.models.transformers.transformer_flux2",
        "Flux2SingleTransformerBlock": "diffusers.models.transformers.transformer_flux2"}),
}
ids = lambda p: str(p.relative_to(REPO))  # noqa: E731


def _read(path: Path) -> dict:
    with path.open() as f:
        return yaml.safe_load(f)


def test_every_accelerate_file_is_listed_and_documented():
    names = {p.name for p in ACCELERATE}
    assert names == set(EXPECTED)
    readme = (REPO / "configs" / "accelerate" / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in names)


@pytest.mark.parametrize("path", ACCELERATE, ids=ids)
def test_accelerate_file_has_the_keys_accelerate_needs(path):
    data = _read(path)
    assert isinstance(data, dict)
    for key in ("compute_environment", "distributed_type", "num_processes", "mixed_precision"):
        assert key in data, f"{path.name} lacks {key}"
    distributed_type, num_processes, precision = EXPECTED[path.name]
    assert data["compute_environment"] == "LOCAL_MACHINE"
    assert str(data["distributed_type"]) == distributed_type  # 'NO' must be quoted, or YAML reads False
    assert data["num_processes"] == num_processes
    assert data["mixed_precision"] == precision


@pytest.mark.parametrize("path", ACCELERATE, ids=ids)
def test_accelerate_launcher_accepts_file(path):
    """Top-level keys pass accelerate's own loader; nested fsdp/deepspeed keys name real launcher options."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    config = load_config_from_file(str(path))  # rejects unknown top-level keys
    options = {action.dest for action in launch_command_parser()._actions}
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", "")):
        for key in getattr(config, section):
            name = key if key.startswith(prefix) else prefix + key
            assert name in options, f"{path.name}: {section}.{key} is not an accelerate launch option"

    launch = importlib.import_module("accelerate.commands.launch")
    validate = getattr(launch, "_validate_launch_command", None)
    if validate is None:
        pytest.skip("this accelerate has no _validate_launch_command")
    args, _, _ = validate(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    distributed_type, num_processes, precision = EXPECTED[path.name]
    assert args.num_processes == num_processes and args.mixed_precision == precision
    assert args.use_fsdp == (distributed_type == "FSDP")
    assert args.use_deepspeed == (distributed_type == "DEEPSPEED")
    assert args.multi_gpu == (distributed_type == "MULTI_GPU")


@pytest.mark.parametrize("name", sorted(FSDP_BLOCKS))
def test_fsdp_files_wrap_the_right_blocks(name):
    family, blocks = FSDP_BLOCKS[name]
    fsdp = _read(REPO / "configs" / "accelerate" / name)["fsdp_config"]
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_use_orig_params"] is True
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False
    assert fsdp["fsdp_state_dict_type"] in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    wrapped = fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    assert sorted(wrapped) == sorted(blocks)
    for cls_name, module in blocks.items():
        assert isinstance(getattr(importlib.import_module(module), cls_name), type)

    from flowrl.models import policy_class

    transformer = policy_class(family).tiny_pipeline(0).transformer
    assert sorted(type(transformer)._no_split_modules) == sorted(wrapped)  # diffusers' own unit of sharding
    present = {type(m).__name__ for m in transformer.modules()}
    assert set(wrapped) <= present, f"{name}: {set(wrapped) - present} not in the {family} transformer"


def test_deepspeed_clipping_matches_the_gpu_configs():
    deepspeed = _read(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml")["deepspeed_config"]
    assert deepspeed["zero_stage"] == 2
    assert deepspeed["offload_optimizer_device"] == deepspeed["offload_param_device"] == "none"
    norms = {load_config(Config, p).train.max_grad_norm for p in GPU_CONFIGS}
    assert norms == {float(deepspeed["gradient_clipping"])}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=ids)
def test_reward_kwargs_match_the_reward_constructors(path):
    """Names resolve and kwargs bind to each reward's signature, without loading any reward model."""
    from flowrl.rewards_api import REWARD_REGISTRY, _split_path, check_reward_kwargs

    for spec in load_config(Config, path).rewards:
        module, attr = _split_path(REWARD_REGISTRY.get(spec.name, spec.name))
        check_reward_kwargs(spec.name, getattr(importlib.import_module(module), attr), spec.kwargs)


def _prepared(name: str) -> bool:
    """A path `flowrl data prepare` writes (data/NAME/FILE): real configs point there, and it is not shipped."""
    parts = Path(name).parts
    return (len(parts) == 3 and parts[0] == "data" and parts[1] in DATASETS
            and parts[2] in DATASETS[parts[1]][0])


@pytest.mark.parametrize("path", FLOWRL_CONFIGS, ids=ids)
def test_every_prompt_file_a_config_names_exists_and_loads(path):
    """Shipped files exist and load; a prepared set is a file `flowrl data prepare` writes."""
    data = load_config(Config, path).data
    for name in (data.prompts, data.test_prompts):
        if name and not _prepared(name):
            assert (REPO / name).is_file(), f"{path.name}: missing prompt file {name}"
            assert len(load_prompts(REPO / name)) > 0


def test_real_configs_train_on_the_prepared_sets():
    """A GPU config trains on a full prompt set, never on a shipped sample (assets/prompts/README.md)."""
    for path in GPU_CONFIGS:
        data = load_config(Config, path).data
        for name in (data.prompts, data.test_prompts):
            assert not name or not name.startswith("assets/prompts/") or not any(
                sample in name for sample in ("ocr_", "pickscore_", "geneval_")), f"{path.name}: {name} is a sample"


def test_ocr_samples_quote_their_target_text():
    targets = {}
    for name in ("ocr_train.jsonl", "ocr_test.jsonl"):
        prompts = load_prompts(REPO / "assets" / "prompts" / name)
        for prompt, meta in zip(prompts.prompts, prompts.metadata):
            text = meta.get("text")
            assert isinstance(text, str) and text.strip(), f"{name}: no metadata.text for {prompt!r}"
            assert f'"{text}"' in prompt, f"{name}: {text!r} is not quoted in {prompt!r}"
        targets[name] = {m["text"].lower() for m in prompts.metadata}
    assert not targets["ocr_train.jsonl"] & targets["ocr_test.jsonl"], "train and test OCR texts overlap"


def test_held_out_prompt_files_are_disjoint_from_training():
    for path in GPU_CONFIGS:
        data = load_config(Config, path).data
        if data.test_prompts and not _prepared(data.prompts):
            train, test = load_prompts(REPO / data.prompts), load_prompts(REPO / data.test_prompts)
            assert not set(train.prompts) & set(test.prompts), path.name


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=ids)
def test_gpu_configs_have_a_launch_header(path):
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#")
    # a training config is launched with accelerate; a sampling-only one (self-guidance) with flowrl sample
    assert "accelerate launch --config_file configs/accelerate/" in header or "flowrl sample configs/" in header
    if not path.name.startswith("_"):
        assert str(path.relative_to(REPO)) in header and "Hardware" in header


def test_launch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(LAUNCH_SCRIPT)], check=True)


def _dry_run(env: dict, *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "NNODES", "NODE_RANK", "GPUS_PER_NODE")}
    return subprocess.run(["bash", str(LAUNCH_SCRIPT), *args], env={**clean, "DRY_RUN": "1", **env},
                          capture_output=True, text=True, cwd=REPO)


def test_launch_script_builds_the_multinode_command():
    out = _dry_run({"MASTER_ADDR": "10.0.0.1", "NNODES": "2", "NODE_RANK": "1", "GPUS_PER_NODE": "8"},
                   "configs/sd35_medium/grpo_ocr.yaml", "train.epochs=5")
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    for flag, value in (("--num_machines", "2"), ("--machine_rank", "1"), ("--main_process_ip", "10.0.0.1"),
                        ("--num_processes", "16"), ("--main_process_port", "29500")):
        assert words[words.index(flag) + 1] == value
    assert words[-3:-1] == ["train", str(REPO / "configs/sd35_medium/grpo_ocr.yaml")] and words[-1] == "train.epochs=5"

    slurm = _dry_run({"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3", "SLURM_GPUS_ON_NODE": "4",
                      "MASTER_ADDR": "node0"}, "configs/sd35_medium/grpo_ocr.yaml")
    words = slurm.stdout.split()
    assert slurm.returncode == 0, slurm.stderr
    assert words[words.index("--num_processes") + 1] == "16" and words[words.index("--machine_rank") + 1] == "3"

    assert _dry_run({"NNODES": "2", "NODE_RANK": "0", "GPUS_PER_NODE": "8"},
                    "configs/sd35_medium/grpo_ocr.yaml").returncode == 2  # no MASTER_ADDR for two nodes
    assert _dry_run({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "x", "GPUS_PER_NODE": "8"},
                    "configs/sd35_medium/grpo_ocr.yaml").returncode == 2


@pytest.mark.slow
def test_multi_cpu_file_starts_two_cpu_processes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(  # each rank writes its own file: the two processes' stdout interleave
        "import sys\n"
        "from pathlib import Path\n"
        "from accelerate import Accelerator\n"
        "a = Accelerator(cpu=True)\n"  # as flowrl builds it for device: cpu
        "Path(sys.argv[1], f'rank{a.process_index}').write_text("
        "f'{a.num_processes} {a.distributed_type.value} {a.device.type}')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*launch_with("--config_file", str(REPO / "configs/accelerate/multi_cpu_2proc.yaml")),
                             str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, launch_failure(result.stderr)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "2 MULTI_CPU cpu"
