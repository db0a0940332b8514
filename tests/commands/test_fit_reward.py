"""``flowrl fit-reward``: the round trip from two folders to a reward that ranks clean above artifact images, the
accuracy it prints against the one its file stores, and each bad input as one line with no file left."""

import re

import pytest
import torch
from safetensors import safe_open

from flowrl.cli import main
from flowrl.core.media import image_files, read_rgb
from flowrl.rewards_api import build_reward
from tools.toy_artifacts import KINDS, make_toy_artifacts


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """24 clean and 24 artifact toy renders, an empty folder and a folder of one image."""
    root = tmp_path_factory.mktemp("fit_reward")
    kinds = make_toy_artifacts(root, 24, seed=0)
    assert kinds == {kind: 8 for kind in KINDS}  # one corruption per image, equal shares
    (root / "empty").mkdir()
    (root / "one").mkdir()
    (root / "one" / "a.png").write_bytes((root / "clean" / "00000.png").read_bytes())
    return root


def fit(folders, out, *extra) -> int:
    return main(["fit-reward", str(folders / "clean"), str(folders / "artifact"), "--out", str(out),
                 "--device", "cpu", *extra])


def test_fit_reward_round_trip(folders, tmp_path, capsys):
    out = tmp_path / "fitted.safetensors"
    assert fit(folders, out) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[1] == f"wrote {out}"
    printed = re.match(r"held-out accuracy (\d\.\d{4}) \((\d+) of (\d+): 5 clean, 5 artifact\); fitted on "
                       r"19 clean \+ 19 artifact images", lines[0])
    assert printed, lines[0]
    with safe_open(str(out), framework="pt") as handle:
        meta = handle.metadata()
    assert (int(printed[2]), int(printed[3])) == (int(meta["held_out_correct"]), int(meta["held_out_total"]))
    assert printed[1] == f"{float(meta['held_out_accuracy']):.4f}"

    reward = build_reward("fitted", path=str(out), device="cpu")
    scores = {}
    for label in ("clean", "artifact"):
        images = torch.stack([read_rgb(f) for f in image_files(folders / label)])  # [24, 3, 32, 32]
        scores[label] = reward(images, [""] * len(images), [{}] * len(images))["fitted"]
    assert scores["clean"].mean() > scores["artifact"].mean()

    assert fit(folders, out) == 2  # the file exists now: refused without --force, rewritten with it
    assert "already exists" in capsys.readouterr().err
    assert fit(folders, out, "--force") == 0


def test_fit_reward_is_deterministic(folders, tmp_path):
    assert fit(folders, tmp_path / "a.safetensors", "--seed", "3") == 0
    assert fit(folders, tmp_path / "b.safetensors", "--seed", "3") == 0
    files = []
    for name in ("a", "b"):  # the header's key order is not fixed by safetensors, so compare what it holds
        with safe_open(str(tmp_path / f"{name}.safetensors"), framework="pt") as handle:
            files.append(({k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()))
    assert files[0][1] == files[1][1]
    for key, tensor in files[0][0].items():
        assert torch.equal(tensor, files[1][0][key]), key


@pytest.mark.parametrize("case, argv, words", [
    ("empty_folder", ["{root}/empty", "{root}/artifact"], ["clean folder", "holds 0 images", "at least 2"]),
    ("missing_folder", ["{root}/clean", "{root}/nowhere"], ["artifact folder", "not a directory"]),
    ("one_image", ["{root}/clean", "{root}/one"], ["artifact folder", "holds 1 images"]),
    ("unknown_features", ["{root}/clean", "{root}/artifact", "--features", "resnet"], ["--features 'resnet'", "toy"]),
    ("bad_feature_kwargs", ["{root}/clean", "{root}/artifact", "--feature-kwargs", "[width: 3"], ["JSON object"]),
    ("held_out_one", ["{root}/clean", "{root}/artifact", "--held-out", "1"], ["--held-out", "(0, 1)"]),
    ("not_safetensors", ["{root}/clean", "{root}/artifact", "--out", "{tmp}/fitted.pt"], [".safetensors"]),
    ("bad_image", ["{root}/clean", "{tmp}/broken"], ["broken/x.png", "cannot be read as an image"]),
])
def test_bad_input_is_one_line_and_leaves_no_file(folders, tmp_path, capsys, case, argv, words):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"not a png")
    (tmp_path / "broken" / "y.png").write_bytes((folders / "clean" / "00000.png").read_bytes())
    argv = [a.format(root=folders, tmp=tmp_path) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "fitted.safetensors")]
    assert main(["fit-reward", *argv, *out, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl fit-reward: error: ") and "Traceback" not in err, err
    assert all(word in err for word in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no reward file, no temporary file


def test_non_finite_features_and_a_missing_gpu_are_one_line_and_leave_no_file(folders, tmp_path, capsys,
                                                                             monkeypatch):
    """Features a network gives as NaN or inf would fit a head of non-finite weights that scores every image NaN;
    --device cuda where no GPU is visible would be torch's traceback. Each is one line, and no file is written."""
    import rewards.fitted as fitted

    real = fitted.file_features

    def some_nan(network, files, device):
        x = real(network, files, device)
        x[1] = float("nan")
        return x

    monkeypatch.setattr(fitted, "file_features", some_nan)
    assert fit(folders, tmp_path / "fitted.safetensors") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite features for 1 of the 24 clean images" in err, err
    monkeypatch.setattr(fitted, "file_features", real)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["fit-reward", str(folders / "clean"), str(folders / "artifact"), "--out",
                 str(tmp_path / "fitted.safetensors"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU is visible" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
