"""The reward seam: building by name, batch validation, error policy, async scoring, simple rewards."""

import logging
import math
import subprocess
import sys

import pytest
import torch

from flowrl.rewards_api import (REWARD_REGISTRY, AsyncScorer, Reward, RewardError, build_reward,
                                nan_summary, score)
from tests import REPO


def const(rgb, n=2, size=16):
    """n constant images of colour rgb -> [n, 3, size, size]."""
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(n, 3, size, size).clone()


def batch(n=3, seed=0, size=16):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g), [f"prompt {seed}-{i}" for i in range(n)], [{}] * n


class Raising:
    name = "boom"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("model exploded\nsecond line")


class NanHalf:
    """Scores every other image NaN, as a reward that cannot judge some images would."""
    name = "nanhalf"

    def __call__(self, images, prompts, metadata):
        v = torch.arange(len(prompts), dtype=torch.float32)
        v[::2] = math.nan
        return {self.name: v, f"{self.name}/sub": torch.zeros(len(prompts))}


# ------------------------------------------------------------------------------ building

@pytest.mark.parametrize("name", ["brightness", "jpeg_compressibility", "jpeg_incompressibility",
                                  "color_target"])
def test_short_names_build(name):
    reward = build_reward(name)
    assert isinstance(reward, Reward) and reward.name == name


@pytest.mark.parametrize("path", ["rewards.simple:ColorTarget", "rewards.simple.ColorTarget"])
def test_dotted_paths_build_with_kwargs(path):
    reward = build_reward(path, target=[0.0, 1.0, 0.0])
    assert reward.name == "color_target" and reward.target == (0.0, 1.0, 0.0)


def test_registry_holds_strings_only():
    assert all(isinstance(v, str) and ":" in v for v in REWARD_REGISTRY.values())
    assert {"toyeval", "toy_proxy"} <= set(REWARD_REGISTRY)


def test_unknown_name_is_one_line_and_suggests():
    with pytest.raises(ValueError) as e:
        build_reward("brigthness")
    msg = str(e.value)
    assert "\n" not in msg and "unknown reward 'brigthness'" in msg
    assert "did you mean 'brightness'" in msg and "color_target" in msg and "package.module:Class" in msg


def test_missing_module_names_the_module():
    with pytest.raises(ValueError) as e:
        build_reward("no_such_pkg.scorers:Thing")
    assert "\n" not in str(e.value) and "'no_such_pkg.scorers'" in str(e.value)


def test_missing_class_names_the_attribute():
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        build_reward("rewards.simple:Nope")


def test_bad_kwarg_names_reward_and_kwarg():
    with pytest.raises(ValueError) as e:
        build_reward("color_target", targte=(0, 0, 1))
    msg = str(e.value)
    assert "\n" not in msg and "'color_target'" in msg and "'targte'" in msg and "did you mean 'target'" in msg


def test_bad_kwarg_value_names_reward():
    with pytest.raises(ValueError, match="reward 'color_target'.*target must be"):
        build_reward("color_target", target=(2, 0, 0))


# ---------------------------------------------------------------------------- validation

@pytest.mark.parametrize("images, fragment", [
    (torch.full((2, 3, 8, 8), 1.5), "[0,1]"),
    (torch.full((2, 3, 8, 8), -0.1), "[0,1]"),
    (torch.rand(2, 4, 8, 8), "[N,3,H,W]"),
    (torch.rand(3, 8, 8), "[N,3,H,W]"),
    (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), "float tensor"),
    (torch.rand(3, 3, 8, 8), "3 images but 2 prompts"),
])
def test_bad_images_are_one_line_value_errors(images, fragment):
    with pytest.raises(ValueError) as e:
        score([build_reward("brightness")], images, ["a", "b"], [{}, {}])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_tiny_overshoot_is_tolerated():
    out = score([build_reward("brightness")], torch.full((2, 3, 8, 8), 1 + 1e-6), ["a", "b"], [{}, {}])
    assert out["brightness"].shape == (2,)


# ------------------------------------------------------------------------------- errors

def test_raising_reward_raise_mode_is_one_line_naming_reward_and_prompt():
    images, prompts, meta = batch()
    with pytest.raises(RewardError) as e:
        score([build_reward("brightness"), Raising()], images, prompts, meta)
    msg = str(e.value)
    assert "\n" not in msg and "'boom'" in msg and repr(prompts[0]) in msg and "model exploded" in msg


def test_raising_reward_nan_mode_logs_and_fills_nan(caplog):
    images, prompts, meta = batch()
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards"):
        out = score([build_reward("brightness"), Raising()], images, prompts, meta, on_error="nan")
    assert torch.isnan(out["boom"]).all() and out["boom"].shape == (3,)
    assert torch.isfinite(out["brightness"]).all()
    assert any("'boom'" in r.getMessage() for r in caplog.records)
    assert nan_summary(out) == {"reward/brightness_nan": 0.0, "reward/boom_nan": 3.0}


def test_nan_from_a_reward_passes_through():
    images, prompts, meta = batch(n=4)
    out = score([NanHalf()], images, prompts, meta)
    assert torch.isnan(out["nanhalf"]).tolist() == [True, False, True, False]
    assert out["nanhalf"].dtype == torch.float32 and list(out) == ["nanhalf", "nanhalf/sub"]
    assert nan_summary(out) == {"reward/nanhalf_nan": 2.0}


def test_output_missing_main_key_is_reward_error():
    class Wrong:
        name = "wrong"

        def __call__(self, images, prompts, metadata):
            return {"other": torch.zeros(len(prompts))}

    with pytest.raises(RewardError, match="no main key 'wrong'"):
        score([Wrong()], *batch(), on_error="nan")


def test_output_wrong_shape_is_reward_error():
    class Wrong:
        name = "wrong"

        def __call__(self, images, prompts, metadata):
            return {"wrong": torch.zeros(len(prompts), 1)}

    with pytest.raises(RewardError, match=r"expected \(3,\)"):
        score([Wrong()], *batch())


# -------------------------------------------------------------------------------- async

def test_async_scorer_matches_sync_and_keeps_order():
    rewards = [build_reward("brightness", saturation=True), build_reward("color_target"),
               build_reward("jpeg_incompressibility")]
    expected = [score(rewards, *batch(n=3, seed=s)) for s in range(4)]
    for asynchronous in (True, False):
        with AsyncScorer(rewards, asynchronous=asynchronous) as scorer:
            futures = []  # submit every batch before collecting any result
            for images, prompts, meta in [batch(n=3, seed=s) for s in range(4)]:
                futures.append(scorer.submit(images, prompts, meta))
                images.fill_(0.0)  # caller reuses its buffer: must not reach the worker
            results = [f.result() for f in futures]
        for got, want in zip(results, expected):
            assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_async_scorer_surfaces_reward_errors_in_result():
    with AsyncScorer([Raising()]) as scorer:
        future = scorer.submit(*batch())
        with pytest.raises(RewardError, match="'boom'"):
            future.result()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(*batch())


# ------------------------------------------------------------------------------ rewards

def test_brightness_on_constant_images():
    out = build_reward("brightness", saturation=True)(
        torch.cat([const((0.5, 0.5, 0.5), 1), const((1.0, 0.0, 0.0), 1)]), ["g", "r"], [{}, {}])
    assert torch.allclose(out["brightness"], torch.tensor([0.5, 0.299]), atol=1e-6)
    assert torch.allclose(out["brightness/saturation"], torch.tensor([0.0, 1.0]))


def test_color_target_is_one_on_target_and_zero_on_opposite_corner():
    reward = build_reward("color_target", target=(1.0, 0.0, 0.0))
    out = reward(torch.cat([const((1.0, 0.0, 0.0), 1), const((0.0, 1.0, 1.0), 1)]), ["a", "b"], [{}, {}])
    assert torch.allclose(out["color_target"], torch.tensor([1.0, 0.0]), atol=1e-6)


def test_jpeg_noise_is_less_compressible_than_flat():
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images = torch.cat([const((0.4, 0.5, 0.6), 1, 64), noise])
    comp = build_reward("jpeg_compressibility")(images, ["flat", "noise"], [{}, {}])["jpeg_compressibility"]
    incomp = build_reward("jpeg_incompressibility")(images, ["flat", "noise"], [{}, {}])["jpeg_incompressibility"]
    assert comp[0] > comp[1] and incomp[1] > incomp[0] and torch.equal(comp, -incomp)


def test_simple_rewards_score_nan_images_nan():
    images = torch.cat([const((0.5, 0.5, 0.5), 1), torch.full((1, 3, 16, 16), math.nan)])
    names = ["brightness", "jpeg_compressibility", "color_target"]
    out = score([build_reward(n) for n in names], images, ["ok", "bad"], [{}, {}])
    for n in names:
        assert not torch.isnan(out[n][0]) and torch.isnan(out[n][1]), n


def test_import_rewards_api_does_not_import_rewards_package():
    code = "import sys, flowrl.rewards_api; print('rewards' in sys.modules or 'rewards.simple' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_recipes_place_model_rewards_on_the_process_device():
    from flowrl.rewards_api import build_rewards
    from flowrl.rewards_api import accepts_keyword
    from flowrl.config.schema import RewardSpec

    assert accepts_keyword("clipscore", "device") and not accepts_keyword("brightness", "device")
    rewards, weights = build_rewards([RewardSpec(name="brightness", weight=2.0)], "cpu")
    assert [r.name for r in rewards] == ["brightness"] and weights == {"brightness": 2.0}
