"""The command line: help lists the subcommands, sample writes a grid, errors are one line."""

import os
import subprocess
import sys

import pytest
from PIL import Image

from flowrl.cli import main
from tests import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _flowrl(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "flowrl", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300)


def test_help_lists_the_planned_subcommands():
    out = _flowrl("--help")
    assert out.returncode == 0
    for command in ("train", "sample", "eval", "export-lora", "fit-reward", "data"):
        assert command in out.stdout


def test_sample_writes_a_grid(tmp_path):
    """In this process: the command's own lines are tested through subprocesses below."""
    out_file = tmp_path / "grid.png"
    assert main(["sample", "configs/smoke/sd3_tiny.yaml", "sampling.num_steps=2", "--prompt", "a cat", "--prompt",
                 "a dog", "--num-per-prompt", "3", "--out", str(out_file)]) == 0
    labelled = Image.open(out_file)  # rows labelled with their prompt, 64 px images enlarged to 128
    assert labelled.width > 3 * 128 and labelled.height > 2 * 128
    assert (tmp_path / "grid.txt").read_text() == "a cat\na dog\n"
    assert main(["sample", "configs/smoke/sd3_tiny.yaml", "sampling.num_steps=2", "--prompt", "a cat", "--prompt",
                 "a dog", "--num-per-prompt", "3", "--out", str(out_file), "--raw"]) == 0
    # --raw: 2 rows x 3 columns of 64 px images with 2 px padding
    assert Image.open(out_file).size == (3 * 64 + 4 * 2, 2 * 64 + 3 * 2)


def test_bad_override_is_a_one_line_error():
    result = _flowrl("sample", "configs/smoke/sd3_tiny.yaml", "sampling.num_stepz=2", "--prompt", "x")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "sampling.num_stepz" in result.stderr and "Traceback" not in result.stderr


LOADING_BARS = ("Loading pipeline components", "Loading weights")  # diffusers' and transformers' per-component bars


@pytest.mark.slow  # a whole command in subprocesses, 10-20 s
def test_train_without_a_config_runs_the_toy_world_with_its_own_bar_and_no_loading_bars(tmp_path):
    result = _flowrl("train", f"run_dir={tmp_path}", "train.epochs=1", "sampling.prompts_per_batch=2",
                     "sampling.group_size=4", "log.eval_every=0", "log.report_prompts=2", "log.progress=true",
                     "log.test_every=0", "log.eval_images_per_prompt=4")  # no held-out curve; a small report
    assert result.returncode == 0, result.stderr[-2000:]
    saved = (tmp_path / "config.yaml").read_text()
    assert "path: assets/toy" in saved and "toyeval" in saved
    report = (tmp_path / "report.json").read_text()
    assert "diversity/gt_mean" in report and (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert "nft: 100%" in result.stderr  # log.progress: flowrl's own bar
    assert not [bar for bar in LOADING_BARS if bar in result.stderr], result.stderr[-2000:]
    assert "FutureWarning" not in result.stderr


def test_debug_keeps_the_loading_bars(tmp_path):
    result = _flowrl("--debug", "sample", "configs/toy/nft.yaml", "--prompt", "a red circle", "--num-per-prompt", "1",
                     "--out", str(tmp_path / "grid.png"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert LOADING_BARS[0] in result.stderr


@pytest.mark.parametrize("argv", [["data", "prepare", "geneval", "{tmp}/out", "--seed", "-1"],
                                  ["data", "prepare", "geneval", "{tmp}/out", "--seed", "one"]])
def test_a_bad_seed_names_the_option(tmp_path, capsys, argv):
    """numpy's "expected non-negative integer" named nothing; argparse names --seed, and nothing is written."""
    from flowrl.cli import main

    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed: must be" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
