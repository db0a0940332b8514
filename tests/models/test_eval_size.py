"""Train small, evaluate large: ``policy.sized`` samples at another size and restores the training size; a size the
model cannot sample is refused in one line, before a training run claims its directory; the held-out curve and the
end-of-run report of a run render at ``eval.height`` / ``eval.width``."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from flowrl.models import build_policy
from flowrl.sampling.rollout import rollout
from flowrl.sampling.settings import RolloutSettings


def test_sized_renders_at_the_eval_size_and_restores_the_training_size():
    policy = build_policy("sd3", "tiny", seed=0)
    train_size = (policy.height, policy.width)
    with policy.sized(2 * policy.height, policy.width):
        traj = rollout(policy, ["a red circle"], RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.0),
                       group_size=2, seeds=[1, 2])
    assert traj.images.shape[-2:] == (2 * train_size[0], train_size[1])
    assert (policy.height, policy.width) == train_size
    with pytest.raises(ValueError, match="multiples of"), policy.sized(train_size[0] + 4):
        pass
    assert (policy.height, policy.width) == train_size


def test_video_eval_frames_and_image_family_frames():
    wan = build_policy("wan", "tiny", seed=0)
    with wan.sized(num_frames=9):
        assert wan.num_frames == 9
    assert wan.num_frames == 5
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        wan.check_size(32, 32, 6)
    with pytest.raises(ValueError, match="num_frames is for video families"):
        build_policy("sd3", "tiny", seed=0).check_size(64, 64, 5)


def test_a_run_evaluates_at_eval_size_and_a_bad_one_leaves_no_run_directory(tmp_path):
    from PIL import Image

    from flowrl.commands.train import run_train
    from flowrl.config import ConfigError

    common = ["configs/smoke/sd3_tiny.yaml", "train.epochs=1", "log.progress=false", "log.eval_every=1",
              "log.report_prompts=0"]
    with pytest.raises(ConfigError, match="multiples of") as error:
        run_train(common[0], [*common[1:], f"run_dir={tmp_path / 'bad'}", "eval.height=40"])
    assert "\n" not in str(error.value) and not (tmp_path / "bad").exists()
    run_train(common[0], [*common[1:], f"run_dir={tmp_path / 'run'}", "eval.height=96", "eval.width=64"])
    grids = sorted((tmp_path / "run" / "grids").glob("*.png"))
    assert grids
    width, height = Image.open(grids[-1]).size  # torchvision's grid: 2 px padding around every image
    assert (height - 2) % (96 + 2) == 0 and (width - 2) % (64 + 2) == 0, (width, height)
