"""The ``flowrl[rewards]`` extra: without it, flowrl still trains on its built-in rewards, and a reward (or a
tiny pipeline) that needs one of its packages stops in one line naming the extra.

A missing package is simulated with ``sys.modules[name] = None``, which makes ``import name`` raise
ModuleNotFoundError (and ``importlib.util.find_spec(name)`` return None) as an uninstalled package does."""

import os
import subprocess
import sys

import pytest

from flowrl.rewards_api import REWARDS_EXTRA, build_reward
from tests import REPO

INSTALL = "pip install 'flowrl[rewards]'"


def _uninstall(monkeypatch, name: str) -> None:
    """Make ``name`` (and its submodules) unimportable for this test; monkeypatch restores them."""
    for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("reward, kwargs, module, leaf", [
    ("ocr", {}, "rapidocr_onnxruntime", "rewards.ocr"),  # imported when the reward module loads
    ("ocr", {}, "rapidfuzz", "rewards.ocr"),
    ("hpsv2", {"checkpoint": "HPS_v2.1_compressed.pt", "device": "cpu"}, "open_clip", None),  # imported when built
])
def test_a_reward_without_its_package_is_one_line_naming_the_extra(monkeypatch, reward, kwargs, module, leaf):
    _uninstall(monkeypatch, module)
    if leaf:
        monkeypatch.delitem(sys.modules, leaf, raising=False)  # import the reward module again, under the block
    with pytest.raises(ValueError) as info:
        build_reward(reward, **kwargs)
    message = str(info.value)
    assert message == f"reward '{reward}': {REWARDS_EXTRA[module]} is not installed: {INSTALL}"
    assert "\n" not in message


def test_the_tiny_pipelines_without_open_clip_name_the_extra(monkeypatch):
    from flowrl.models import build_policy
    from flowrl.models.tiny import _clip_bpe

    _uninstall(monkeypatch, "open_clip")
    _clip_bpe.cache_clear()  # read the BPE file again, under the block
    with pytest.raises(ModuleNotFoundError, match=r"open_clip_torch.*pip install 'flowrl\[rewards\]'"):
        build_policy("sd3", "tiny")
    _clip_bpe.cache_clear()  # the next test reads it with open_clip back


def _without_extra(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where no package of the rewards extra can be imported."""
    block = "import sys\nfor name in %r: sys.modules[name] = None\n" % sorted(REWARDS_EXTRA)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", block + code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_builtin_rewards_need_no_extra():
    names = ["brightness", "jpeg_compressibility", "jpeg_incompressibility", "color_target", "toyeval",
             "toy_proxy", "toy_clip", "edit_preservation", "motion_direction", "temporal_consistency"]
    result = _without_extra("from flowrl.rewards_api import build_reward\n"
                            f"print(sorted(build_reward(n).name for n in {names!r}))")
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_cli_names_the_extra_in_one_line():
    result = _without_extra("from flowrl.cli import main\n"
                            "sys.exit(main(['sample', 'configs/smoke/sd3_tiny.yaml', '--prompt', 'x']))")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("flowrl sample: error: ") and INSTALL in result.stderr
