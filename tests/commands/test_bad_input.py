"""The bad-input suite (issue 18): inputs a user gets wrong, across the CLI, configs, overrides, model paths,
prompt files, reward specs, checkpoints/resume, export and the remote reward server.

Each case: exit code 2, exactly one stderr line ``flowrl CMD: error: ...`` naming the problem (the asserted
words), no traceback, and, where the input is checked before the run starts, no run directory left behind.
Cases run in-process through ``flowrl.cli.main`` (one tiny trained checkpoint, module fixture); one subprocess
case checks the real exit code and ``--debug``.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowrl.cli import main
from tests import REPO
from tests.fault_helpers import TINY_TRAIN, free_port, remote_spec, reward_server


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A trained 1-epoch run, a saved tiny SD3 pipeline, broken prompt files and a LoRA of other shapes."""
    root = tmp_path_factory.mktemp("bad_input")
    run = root / "trained"
    assert main(["train", *TINY_TRAIN, f"run_dir={run}", "train.epochs=1"]) == 0
    from flowrl.models.tiny import tiny_sd3_pipeline

    tiny_sd3_pipeline(0).save_pretrained(root / "sd3_pipeline")
    (root / "empty.txt").write_text("\n\n")
    (root / "latin1.txt").write_bytes("a cat\nun caf\xe9 au lait\n".encode("latin-1"))
    (root / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog",\n')
    (root / "meta_list.jsonl").write_text('{"prompt": "a cat", "metadata": ["red"]}\n')
    (root / "no_prompt.jsonl").write_text('{"text": "a cat"}\n')
    (root / "prompts.csv").write_text("a cat\n")
    (root / "a_file").write_text("not a directory\n")
    (root / "not_yaml.yaml").write_text("train: [unclosed\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    lora = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    other = {k: torch.zeros(v.shape[0] + 1, v.shape[1] + 3) for k, v in lora.items()}  # another model's sizes
    save_file(other, str(root / "other_model_lora.safetensors"))
    return root


def broken_run(files, tmp_path, name: str, content: bytes | None = None) -> Path:
    """A copy of the trained run whose checkpoint file ``name`` is truncated to half (or set to ``content``)."""
    run = tmp_path / "broken"
    shutil.copytree(files / "trained", run)
    target = run / "checkpoints" / "step_000000" / name
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2] if content is None else content)
    return run


def rerun_copy(files, tmp_path) -> Path:
    """A copy of the trained run, in which a second run is started."""
    copy = tmp_path / "rerun"
    if not copy.exists():
        shutil.copytree(files / "trained", copy)
    return copy


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


T = "train"
# (id, argv after the subcommand, words the error line must hold, whether no run directory may be left)
# {files}, {run}, {tmp} are filled in; train cases get TINY_TRAIN and run_dir={run} prepended.
CASES = [
    # numbers that were accepted silently
    ("lr_inf", T, ["train.learning_rate=inf"], ["train.learning_rate", "finite"], True),
    ("lr_nan", T, ["train.learning_rate=nan"], ["train.learning_rate", "finite"], True),
    ("lr_zero", T, ["train.learning_rate=0"], ["train.learning_rate", "> 0"], True),
    ("lr_negative", T, ["train.learning_rate=-1e-4"], ["train.learning_rate", "> 0"], True),
    ("advantage_clip_zero", T, ["train.advantage_clip=0"], ["train.advantage_clip", "> 0"], True),
    ("clip_range_negative", T, ["train.clip_range=-0.1"], ["train.clip_range", "> 0"], True),
    ("clip_range_high_negative", T, ["train.clip_range_high=-1"], ["train.clip_range_high"], True),
    ("max_grad_norm_inf", T, ["train.max_grad_norm=.inf"], ["train.max_grad_norm", "finite"], True),
    ("adam_beta_one", T, ["train.adam_betas=[0.9, 1.0]"], ["train.adam_betas"], True),
    ("noise_level_nan", T, ["sampling.noise_level=.nan"], ["sampling.noise_level", "finite"], True),
    ("reward_weight_nan", T, ["rewards=[{name: brightness, weight: .nan}]"], ["rewards[0].weight", "finite"], True),
    ("keep_checkpoints_zero", T, ["train.keep_checkpoints=0"], ["train.keep_checkpoints"], True),
    ("max_skipped_steps_zero", T, ["train.max_skipped_steps=0"], ["train.max_skipped_steps"], True),
    ("max_nan_epochs_zero", T, ["train.max_nan_epochs=0"], ["train.max_nan_epochs"], True),
    ("prompts_per_batch_zero", T, ["sampling.prompts_per_batch=0"], ["sampling.prompts_per_batch", ">= 1"], True),
    ("num_steps_zero", T, ["sampling.num_steps=0"], ["sampling.num_steps"], True),
    ("test_fraction_one", T, ["data.test_fraction=1.5"], ["data.test_fraction"], True),
    ("device_cuda_missing", T, ["device=cuda"], ["device", "not available"], True),
    ("device_cuda_3_missing", T, ["device=cuda:3"], ["device", "cuda:3"], True),
    ("device_gibberish", T, ["device=tpu"], ["device"], True),
    ("wandb_not_installed", T, ["log.backend=wandb"], ["log.backend", "wandb is not installed"], True),
    # names and shapes
    ("unknown_loss", T, ["train.loss=ppo"], ["train.loss", "unknown policy loss"], True),
    ("unknown_combine", T, ["train.combine=sum"], ["train.combine", "unknown reward combiner"], True),
    ("unknown_key", T, ["train.learning_rat=1e-4"], ["train.learning_rat", "did you mean"], True),
    ("wrong_type", T, ["train.epochs=many"], ["train.epochs", "expected int"], True),
    ("override_without_equals", T, ["train.epochs"], ["train.epochs"], True),
    ("empty_rewards", T, ["rewards=[]"], ["rewards", "empty"], True),
    ("missing_config", "train", None, ["missing file"], True),
    ("invalid_yaml", "train", None, ["invalid YAML"], True),
    ("config_not_a_mapping", "train", None, ["top level must be a mapping"], True),
    # model paths
    ("model_path_missing", T, ["model.path={tmp}/no_such_model"], ["no_such_model"], True),
    ("model_path_a_file", T, ["model.path={files}/a_file"], ["a_file"], True),
    ("flux_family_sd3_path", T, ["model.family=flux", "model.path={files}/sd3_pipeline"],
     ["StableDiffusion3Pipeline", "model.family=sd3"], True),
    # prompt files
    ("prompt_file_missing", T, ["data.prompts={tmp}/nope.txt"], ["prompt file not found"], True),
    ("prompt_file_empty", T, ["data.prompts={files}/empty.txt"], ["holds no prompts"], True),
    ("prompt_file_not_utf8", T, ["data.prompts={files}/latin1.txt"], ["latin1.txt:2", "UTF-8"], True),
    ("jsonl_invalid", T, ["data.prompts={files}/bad.jsonl"], ["bad.jsonl:2", "invalid JSON"], True),
    ("jsonl_metadata_not_object", T, ["data.prompts={files}/meta_list.jsonl"], ["meta_list.jsonl:1", "'metadata'"],
     True),
    ("jsonl_without_prompt", T, ["data.prompts={files}/no_prompt.jsonl"], ["'prompt'"], True),
    ("prompt_file_csv", T, ["data.prompts={files}/prompts.csv"], ["use .txt or .jsonl"], True),
    ("test_prompts_missing", T, ["data.test_prompts={tmp}/held_out.txt"], ["held_out.txt"], True),
    # reward specs
    ("reward_unknown", T, ["rewards=[{name: brightnes}]"], ["unknown reward", "did you mean 'brightness'"], True),
    ("reward_bad_kwarg", T, ["rewards=[{name: brightness, kwargs: {gamma: 2}}]"], ["unexpected keyword", "gamma"],
     True),
    ("reward_module_missing", T, ["rewards=[{name: 'nosuch.module:Reward'}]"], ["cannot import module"], True),
    ("reward_key_unknown", T, ["rewards=[{name: brightness, key: contrast}]"], ["key 'contrast'"], True),
    ("remote_url_bad", T, ["rewards=[{name: remote, kwargs: {url: 'ftp://judge'}}]"], ["http://host:port"], True),
    ("remote_deadline_bad", T, ["rewards=[{name: remote, kwargs: {url: 'http://judge:1', deadline: 0}}]"],
     ["reward 'remote'", "deadline must be finite and > 0"], True),
    ("groupwise_reward_pilot", T, ["rewards=[{name: 'tests.reward_fixtures:GroupBrightness'}]", "sampling.group_size=4",
                                   "sampling.pilot.candidates=2", "sampling.pilot.group_size=2"],
     ["sampling.pilot.candidates", "scores each group whole", "Pilot-Commit"], True),
    ("groupwise_reward_sdpo", T, ["rewards=[{name: pickscore_rank}]", "train.credit=sdpo"],
     ["train.credit", "reward 'pickscore_rank' scores each group whole", "sdpo"], True),
    ("reward_raises", T, ["rewards=[{name: 'tests.fault_helpers:Raising'}]"], ["reward 'raising' failed",
                                                                               "judge model crashed"], False),
    ("reward_wrong_shape", T, ["rewards=[{name: 'tests.fault_helpers:WrongShape'}]"], ["has shape (3,)",
                                                                                      "expected (2,)"], False),
    ("reward_hub_offline", T, ["rewards=[{name: pickscore_rank}]"], ["reward 'pickscore_rank'", "cannot load",
                                                                    "huggingface-cli download"], True),
    ("reward_not_a_dict", T, ["rewards=[{name: 'tests.fault_helpers:NotADict'}]"], ["returned list"], False),
    # checkpoints and resume
    ("resume_missing_path", T, ["train.resume={tmp}/no_checkpoint"], ["checkpoint not found"], True),
    ("resume_latest_nothing", T, ["train.resume=latest"], ["no checkpoint to resume"], True),
    ("resume_truncated_lora", "resume", "lora.safetensors", ["lora.safetensors", "truncated or corrupt"], False),
    ("resume_garbage_ema", "resume", ("ema.safetensors", b"garbage"), ["ema.safetensors", "not a readable"], False),
    ("resume_truncated_optimizer", "resume", "optimizer.pt", ["optimizer.pt", "truncated or corrupt"], False),
    ("resume_truncated_rng", "resume", "rng_rank0.pt", ["rng_rank0.pt", "truncated or corrupt"], False),
    ("resume_empty_trainer_state", "resume", ("trainer_state.json", b""), ["trainer_state.json", "empty"], False),
    ("resume_trainer_state_list", "resume", ("trainer_state.json", b"[1]"), ["integer 'epoch'"], False),
    ("resume_other_lora_rank", "resume-with", ["lora.rank=4"], ["belongs to another run", "LoRA rank 2 there, 4 here"],
     False),
    ("resume_other_family", "resume-with", ["model.family=flux"], ["belongs to another run", "model family 'sd3'"],
     False),
    ("resume_other_optimizer", "resume-with", ["train.optimizer=adamw8bit"],
     ["holds the state of optimizer 'adamw'", "train.optimizer=adamw"], False),
    ("resume_other_shapes", "resume-relabelled", ["lora.rank=4"], ["does not fit this run's model", "[2, 32] there"],
     False),
    # the run directory
    ("run_dir_holds_a_run", "rerun", [], ["already holds a run", "train.resume=latest", "train.overwrite=true"],
     False),
    ("run_dir_is_a_file", T, ["run_dir={files}/a_file"], ["a_file", "is a file, not a directory"], True),
    ("run_dir_parent_is_a_file", T, ["run_dir={files}/a_file/run"], ["its parent", "is a file"], True),
    ("overwrite_and_resume", T, ["train.overwrite=true", "train.resume=latest"], ["train.overwrite", "set one"],
     True),
    # export
    ("export_missing_checkpoint", "export-lora", ["{tmp}/nothing", "{tmp}/out"], ["holds no adapter"], False),
    ("export_out_not_writable", "export-lora", ["{files}/trained", "{files}/a_file/out"], ["cannot write the export",
                                                                                         "writable"], False),
    ("export_exists_without_force", "export-lora", ["{files}/trained", "{files}/trained/lora"], ["--force"], False),
    ("export_truncated_checkpoint", "export-broken", "lora.safetensors", ["truncated or corrupt"], False),
    ("export_merge_kohya", "export-lora", ["{files}/trained", "{tmp}/out", "--merge", "--format", "kohya"],
     ["--merge"], False),
    # sample
    ("sample_num_per_prompt_zero", "sample", ["--num-per-prompt", "0"], ["--num-per-prompt", ">= 1"], False),
    ("sample_num_per_prompt_negative", "sample", ["--num-per-prompt", "-3"], ["--num-per-prompt", ">= 1"], False),
    ("sample_out_is_directory", "sample", ["--out", "{tmp}"], ["is a directory"], False),
    ("sample_out_no_suffix", "sample", ["--out", "{tmp}/grid"], ["image file name"], False),
    ("sample_lora_other_model", "sample", ["--lora", "{files}/other_model_lora.safetensors"],
     ["does not fit this model", "size mismatch"], False),
    ("sample_lora_missing", "sample", ["--lora", "{tmp}/none.safetensors"], ["LoRA file not found"], False),
    ("sample_lora_truncated", "sample-truncated-lora", None, ["LoRA file", "not a readable"], False),
    ("sample_no_prompts", "sample-bare", [], ["no prompts"], False),
    ("sample_prompts_file_missing", "sample-bare", ["--prompts-file", "{tmp}/p.txt"], ["prompt file not found"],
     False),
    ("sample_without_config", "sample-none", [], ["needs a config", "configs/smoke/", "configs/toy/"], False),
    ("eval_without_config", "eval-none", [], ["needs a config", "configs/smoke/"], False),
    # the remote reward server
    ("remote_down", "remote", "down", ["/health unreachable after 2 attempts", "is the service running",
                                        "flowrl serve-rewards"], True),  # its health check at start: no run dir
    ("remote_slow", "remote", "slow", ["timed out after 2 attempts"], False),
    ("remote_bad_json", "remote", "bad_json", ["invalid JSON"], False),
    ("remote_wrong_length", "remote", "short", ["has 1 values for 2 images"], False),
    ("remote_strings", "remote", "strings", ["other than numbers or null"], False),
    ("remote_nan_scores", "remote", "nan", ["NaN or Infinity", "send null"], False),
    ("remote_huge_reply", "remote", "huge", ["max_response_bytes"], False),
    ("remote_not_an_object", "remote", "list", ["expected a JSON object"], False),
]


def _fill(args, **where):
    out = []
    for arg in args:
        for key, value in where.items():
            arg = arg.replace("{" + key + "}", str(value))
        out.append(arg)
    return out


def build_argv(kind, spec, files, tmp_path, run):
    where = dict(files=files, tmp=tmp_path, run=run)
    train = ["train", *TINY_TRAIN, f"run_dir={run}", "train.epochs=1"]
    sample = ["sample", "configs/smoke/sd3_tiny.yaml", "sampling.num_steps=1", "--prompt", "a cat",
              "--num-per-prompt", "1", "--out", str(tmp_path / "grid.png")]
    if kind == "train":
        return [*train, *_fill(spec, **where)]
    if kind == "resume":
        name, content = (spec, None) if isinstance(spec, str) else spec
        broken = broken_run(files, tmp_path, name, content)
        return ["train", *TINY_TRAIN, f"run_dir={broken}", "train.epochs=2", "train.resume=latest"]
    if kind in ("resume-with", "resume-relabelled"):  # the trained run resumed with another model or LoRA
        copy = tmp_path / "trained_copy"
        shutil.copytree(files / "trained", copy)
        if kind == "resume-relabelled":  # its saved config says rank 4, its tensors are rank 2: the header decides
            saved = copy / "checkpoints" / "step_000000" / "config.yaml"
            saved.write_text(saved.read_text().replace("rank: 2", "rank: 4"))
        return ["train", *TINY_TRAIN, f"run_dir={copy}", "train.epochs=2", "train.resume=latest", *spec]
    if kind == "rerun":  # a second run into the trained run's directory, without resume
        return ["train", *TINY_TRAIN, f"run_dir={rerun_copy(files, tmp_path)}", "train.epochs=1"]
    if kind in ("sample-none", "eval-none"):
        return [kind.split("-")[0]]
    if kind == "export-lora":
        return ["export-lora", *_fill(spec, **where)]
    if kind == "export-broken":
        return ["export-lora", str(broken_run(files, tmp_path, spec)), str(tmp_path / "out")]
    if kind == "sample":
        return [*sample, *_fill(spec, **where)]
    if kind == "sample-bare":
        return ["sample", "configs/smoke/sd3_tiny.yaml", *_fill(spec, **where)]
    if kind == "sample-truncated-lora":
        bad = tmp_path / "truncated.safetensors"
        data = (files / "trained" / "lora" / "pytorch_lora_weights.safetensors").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
        return [*sample, "--lora", str(bad)]
    raise AssertionError(kind)


CONFIG_FILES = {"missing_config": "{tmp}/nope.yaml", "invalid_yaml": "{files}/not_yaml.yaml",
                "config_not_a_mapping": "{files}/list.yaml"}


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_leaves_nothing(case, files, tmp_path, capsys):
    name, kind, spec, words, no_run_dir = case
    run = tmp_path / "run"
    if name in CONFIG_FILES:
        argv = ["train", *_fill([CONFIG_FILES[name]], files=files, tmp=tmp_path), f"run_dir={run}"]
    elif kind == "remote":
        mode = spec
        if mode == "down":
            argv = ["train", *TINY_TRAIN, f"run_dir={run}", "train.epochs=1",
                    remote_spec(f"http://127.0.0.1:{free_port()}")]
            code, err = run_cli(argv, capsys)
        else:
            with reward_server(mode, delay=1.0) as url:
                argv = ["train", *TINY_TRAIN, f"run_dir={run}", "train.epochs=1", remote_spec(url)]
                code, err = run_cli(argv, capsys)
        return check(code, err, words, run, no_run_dir, "train")
    else:
        argv = build_argv(kind, spec, files, tmp_path, run)
    code, err = run_cli(argv, capsys)
    check(code, err, words, run, no_run_dir, argv[0])


def check(code, err, words, run, no_run_dir, command):
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"flowrl {command}: error: "), err[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    if no_run_dir:
        assert not run.exists(), f"{run} was created before validation failed"


def test_a_second_run_into_a_run_directory_leaves_the_first_byte_identical(files, tmp_path, capsys):
    first = rerun_copy(files, tmp_path)
    before = tree_bytes(first)
    code, err = run_cli(["train", *TINY_TRAIN, f"run_dir={first}", "train.epochs=1"], capsys)
    check(code, err, ["already holds a run"], first, False, "train")
    assert tree_bytes(first) == before


def test_overwrite_moves_the_old_run_aside_whole(files, tmp_path, capsys):
    first = rerun_copy(files, tmp_path)
    before = tree_bytes(first)
    code, out = main(["train", *TINY_TRAIN, f"run_dir={first}", "train.epochs=1", "train.overwrite=true"]), \
        capsys.readouterr().out
    assert code == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("rerun.old-")]
    assert len(moved) == 1 and tree_bytes(moved[0]) == before, "the old run must move aside whole, unchanged"
    assert f"is now {moved[0]}" in out
    assert (first / "metrics.jsonl").read_text().count("\n") == 1, "the new run starts its own metrics"


def test_a_run_that_failed_before_its_first_checkpoint_is_retried_by_the_same_command(tmp_path, capsys):
    """A reward that raises stops the run in one line before any checkpoint. The same command, run again once the
    reward is fixed, starts afresh; the failed attempt's config and log move aside, kept for diagnosis."""
    run = tmp_path / "run"
    command = ["train", *TINY_TRAIN, f"run_dir={run}", "train.epochs=1"]
    code, err = run_cli([*command, "rewards=[{name: 'tests.fault_helpers:Raising'}]"], capsys)
    check(code, err, ["raising"], run, False, "train")
    failed_config = (run / "config.yaml").read_text()
    assert not (run / "checkpoints" / "latest").exists()
    code, out = main(command), capsys.readouterr().out
    assert code == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.failed-")]
    assert len(moved) == 1 and (moved[0] / "config.yaml").read_text() == failed_config
    assert f"an attempt that stopped before its first checkpoint; its log is now {moved[0]}" in out
    assert (run / "checkpoints" / "latest").is_file()


def test_a_read_only_run_directory_is_one_line(tmp_path, capsys):
    """A real read-only file system where the machine allows mounting one (root), else a directory without write
    permission."""
    place = tmp_path / "ro"
    place.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(place)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root without the right to mount a tmpfs: a chmod does not stop root")
        place.chmod(0o500)
    try:
        code, err = run_cli(["train", *TINY_TRAIN, f"run_dir={place}/run", "train.epochs=1"], capsys)
    finally:
        if mounted:
            subprocess.run(["umount", str(place)], check=True)
        else:
            place.chmod(0o700)
    check(code, err, [f"{place}/run", "cannot be written", "read-only file system" if mounted else "ermission"],
          place / "run", True, "train")


def test_the_suite_covers_enough_cases():
    assert len(CASES) >= 40
    areas = {c[1] for c in CASES}
    assert {"train", "resume", "export-lora", "sample", "remote"} <= areas


def test_debug_flag_shows_the_traceback_in_a_subprocess(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("FLOWRL_DEBUG", None)
    argv = [sys.executable, "-m", "flowrl", "train", "configs/smoke/sd3_tiny.yaml", f"run_dir={tmp_path / 'run'}",
            "train.learning_rate=inf"]
    plain = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr
    debug = subprocess.run([*argv, "--debug"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr
    assert not (tmp_path / "run").exists()
