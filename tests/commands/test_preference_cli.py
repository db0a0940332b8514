"""ParetoSlider on the command line: ``flowrl sample --preference`` and ``flowrl eval --preference`` move the slider
of a run trained with ``model.preference``, ``export-lora`` carries its embedding, and each bad input is one line
that leaves nothing behind (a vector of the wrong length, a negative entry, entries not summing to 1, a model
trained without it)."""

import pytest
from PIL import Image
import numpy as np

from flowrl.cli import main
from flowrl.models.preference import PREFERENCE_WEIGHT_NAME
from tests.fault_helpers import TINY_TRAIN

SLIDER = ["rewards=[{name: brightness}, {name: color_target, kwargs: {target: [0, 0, 0]}}]",
          "model.preference.rewards=[brightness, color_target]", "model.preference.hidden=8",
          "model.preference.per_prompt=1",  # TINY_TRAIN's groups of 2: one w per group
          "train.combine=preference", "train.learning_rate=3e-2", "train.clip_range=0.5"]
CONFIG = "configs/smoke/sd3_tiny.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-epoch slider run and a 1-epoch plain run of the tiny SD3 model."""
    root = tmp_path_factory.mktemp("slider_cli")
    assert main(["train", *TINY_TRAIN, f"run_dir={root / 'slider'}", "train.epochs=2", *SLIDER]) == 0
    assert main(["train", *TINY_TRAIN, f"run_dir={root / 'plain'}", "train.epochs=1"]) == 0
    return root


def run_cli(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


def test_sample_moves_the_slider_of_a_slider_run(runs, tmp_path, capsys):
    grids = {}
    for w in ("1,0", "0,1"):
        out = tmp_path / f"w{w.replace(',', '_')}.png"
        code, err = run_cli(["sample", CONFIG, "--prompt", "a red circle", "--num-per-prompt", "1", "--out", str(out),
                             "--lora", str(runs / "slider" / "lora"), f"--preference={w}"], capsys)
        assert code == 0, err
        grids[w] = np.asarray(Image.open(out), dtype=np.int16)
    assert (grids["1,0"] != grids["0,1"]).any()  # the trained embedding moves the images


def test_export_lora_writes_the_embedding_beside_the_lora(runs, tmp_path, capsys):
    code, err = run_cli(["export-lora", str(runs / "slider"), str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / PREFERENCE_WEIGHT_NAME).is_file()
    assert "preference_embedding.safetensors" in (tmp_path / "out" / "README.md").read_text()


BAD = [
    ("sample", "0.3,0.3,0.4", "slider", ["3 entries", "2 rewards"]),
    ("sample", "-0.2,1.2", "slider", ["negative entry"]),
    ("sample", "0.3,0.6", "slider", ["sum to 0.9, not 1"]),
    ("sample", "0.5,0.5", "plain", ["no preference embedding"]),
    ("sample", "0.5,0.5", None, ["needs a model trained with model.preference"]),
    ("eval", "0.3,0.3,0.4", "slider", ["3 entries"]),
    ("eval", "0.3,0.6", "slider", ["sum to 0.9"]),
    ("eval", "0.5,0.5", "plain", ["no preference embedding"]),
]


@pytest.mark.parametrize("command, w, run, words", BAD, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in BAD])
def test_a_bad_preference_is_one_line_and_leaves_nothing(command, w, run, words, runs, tmp_path, capsys):
    out = tmp_path / "out"
    if command == "sample":
        argv = ["sample", CONFIG, "--prompt", "a cat", "--out", str(out / "grid.png"), f"--preference={w}"]
        argv += ["--lora", str(runs / run / "lora")] if run else []
    else:
        argv = ["eval", CONFIG, "--checkpoint", str(runs / run), "--out", str(out), f"--preference={w}"]
    code, err = run_cli(argv, capsys)
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"flowrl {command}: error: "), err[-2000:]
    assert all(word in errors[0] for word in words), errors[0]
    assert not out.exists()


def test_eval_renders_a_slider_checkpoint_at_the_given_weights(runs, tmp_path, capsys):
    suite = tmp_path / "suite.txt"
    suite.write_text("a red circle\n")
    common = [f"eval.suite={suite}", "eval.images_per_prompt=2", "eval.features=pixels", "sampling.num_steps=2"]
    images = {}
    for w in ("1,0", "0,1"):
        out = tmp_path / f"eval_{w.replace(',', '_')}"
        code, err = run_cli(["eval", CONFIG, *common, "--checkpoint", f"s={runs / 'slider'}", "--out", str(out),
                             f"--preference={w}"], capsys)
        assert code == 0, err[-2000:]
        images[w] = np.asarray(Image.open(out / "images" / "s" / "p0000_00.png"), dtype=np.int16)
    assert (images["1,0"] != images["0,1"]).any()
