"""scripts/reference_figures.py still runs and its figures still point the way the reference ports moved them, so
the printed tables cannot silently rot. The bounds are loose on purpose: they check the shape of each figure, not
its digits."""

import importlib.util
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests import REPO


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("reference_figures", REPO / "scripts" / "reference_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_prints_one_markdown_section_per_algorithm(script, capsys):
    script.main()
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in headings] == ["## GRPO-Guard", "## BranchGRPO", "## TMPO", "## DiffusionNFT",
                                                   "## AWM"]
    assert not re.search(r"\b(nan|inf)\b", out)


def test_guard_evens_the_log_ratio_spread_differently_from_the_earlier_variant(script):
    figures = script.guard_figures()
    assert [f["step"] for f in figures] == list(range(9))  # every step but the last, as Flow-GRPO trains
    spread = [f["spread_ratio"] for f in figures]
    # grpo_guard's log-ratio grows with |dt| while the earlier one is flat across steps: the ratio falls with k.
    assert all(a > b for a, b in zip(spread, spread[1:]))
    assert max(spread) / min(spread) > 4
    # Both variants give every step but the first (sigma = 1) the same gradient size, so their ratio is flat there.
    gradient = [f["gradient_ratio"] for f in figures[1:]]
    assert max(gradient) / min(gradient) == pytest.approx(1, abs=1e-3)
    assert figures[0]["gradient_ratio"] > gradient[0]


def test_branch_depth_standardised_advantages_outgrow_the_leaf_mean_on_shared_edges(script):
    figures = script.branch_figures()
    for reward, depths in figures.items():
        ratios = [f["ratio"] for f in depths]
        assert [f["leaves_below"] for f in depths] == [8, 4, 2, 1]
        assert ratios[0] > 2.5 and ratios[1] > 1.5 and ratios[2] > 1.2, reward  # edges shared by 8, 4, 2 leaves
        assert ratios[3] == pytest.approx(1, abs=0.05), reward  # the leaves: both standardise the same rewards
        assert all(a > b for a, b in zip(ratios, ratios[1:])), reward
    uniform = figures["U(0, 1)"]
    assert uniform[0]["depth_standardised"] == pytest.approx(1 / math.sqrt(2), rel=1e-6)  # two nodes: -+1/sqrt(2)


def test_tmpo_residual_is_not_centred_and_the_gradient_target_is(script):
    figures = script.tmpo_figures()
    residual, gradient = figures["residual"], figures["gradient"]
    assert residual == sorted(residual) and gradient == sorted(gradient) and len(residual) == 8
    assert abs(sum(gradient)) < 1e-4 and sum(residual) < -10
    assert min(residual) < min(gradient) < 0 < max(gradient)


def test_nft_type_two_waits_75_steps_and_the_loss_scale_is_clip_over_strength(script):
    figures = script.nft_figures()
    decays = {row[0]: row[1:] for row in figures["decays"]}
    type0, type1, type2, slow, fast = zip(*(decays[s] for s in script.DECAY_STEPS))
    assert set(type0) == {0.0} and type1 == slow
    assert decays[75][2] == 0.0 and decays[75][4] == pytest.approx(0.5625)
    assert decays[208][2] == pytest.approx(0.9975) and decays[300][2] == pytest.approx(0.999)
    assert figures["loss_scales"] == [[1.0, 5.0, 1.0], [0.1, pytest.approx(50.0), 1.0]]


def test_awm_ghuber_weight_is_t_times_l_to_the_minus_three_quarters(script):
    figures = script.awm_figures()
    for mse, t, ghuber, expected, uniform in figures["grid"]:
        assert ghuber == pytest.approx(expected, rel=1e-6) and uniform == pytest.approx(1.0)
    assert figures["ghuber_spread"] > 20 and figures["uniform_spread"] == pytest.approx(1.0)
