"""Online DPO against Diffusion-DPO's loss (SalesforceAIResearch/DiffusionDPO train.py at 8d3ee5c) in flow-matching
form: the loss and its gradient by hand on a 2-pair batch, the pairs of a hand-made group (best/worst, all, ties,
unscored rows), the shared (t, noise) of a pair, and the recipe: a tiny 2-epoch run (finite loss, the LoRA moves,
the first step measured against the base model, exact resume) and the bad inputs."""

import math

import pytest
import torch
from safetensors.torch import load_file

from flowrl.algorithms.dpo import all_pairs, best_worst_pairs, dpo_loss, matching_error
from flowrl.cli import main
from flowrl.config import Config, ConfigError, load_config
from flowrl.algorithms.forward_losses import FORWARD_LOSSES, DpoLoss, noised_sample
from flowrl.recipes.nft import train
from flowrl.training.metrics import read_metrics

SMOKE = "configs/smoke/sd3_tiny.yaml"


# ---- the loss ------------------------------------------------------------------------------------------------

def two_pairs():
    """Velocities [4 rows = (w1, l1, w2, l2), 4 elements], the reference's, and target u = 0.

    Pair 1: v_w = 0.5 -> e_w = 0.25; ref_w = 1 -> e_ref_w = 1; v_l = 1 -> e_l = 1; ref_l = 0.5 -> e_ref_l = 0.25.
    Pair 2: v_w = 1 -> e_w = 1; ref_w = 0 -> 0; v_l = 0 -> e_l = 0; ref_l = 0 -> 0."""
    velocity = torch.tensor([[0.5] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([[1.0] * 4, [0.5] * 4, [0.0] * 4, [0.0] * 4], dtype=torch.float64)
    return velocity, reference, torch.zeros(4, 4, dtype=torch.float64)


def test_dpo_loss_and_gradient_on_two_pairs_match_a_hand_computation():
    # beta = 2, so -beta / 2 = -1:
    # Pair 1: diff = (0.25 - 1) - (1 - 0.25) = -1.5 -> x = 1.5 -> loss = log(1 + e^-1.5) = log(1.22313016) = 0.20141328
    # Pair 2: diff = (1 - 0) - (0 - 0) = 1 -> x = -1 -> loss = log(1 + e) = log(3.71828183) = 1.31326169
    velocity, reference, target = two_pairs()
    errors, ref_errors = matching_error(velocity, target), matching_error(reference, target)
    assert errors.tolist() == [0.25, 1.0, 1.0, 0.0] and ref_errors.tolist() == [1.0, 0.25, 0.0, 0.0]
    loss = dpo_loss(errors[0::2], errors[1::2], ref_errors[0::2], ref_errors[1::2], beta=2.0)
    assert loss.tolist() == pytest.approx([0.20141328, 1.31326169], abs=1e-8)
    # d loss / d e_w = beta / 2 sigmoid(-x) = sigmoid(-x), d loss / d e_l = -sigmoid(-x); d e / d v = 2 (v - u) / 4.
    # Pair 1: sigmoid(-1.5) = 0.18242552: winner 0.18242552 * 0.25 = 0.04560638, loser -0.18242552 * 0.5 = -0.09121276.
    # Pair 2: sigmoid(1) = 0.73105858: winner 0.73105858 * 0.5 = 0.36552929, loser (v_l - u = 0) 0.
    loss.sum().backward()
    expected = [0.04560638, -0.09121276, 0.36552929, 0.0]
    for row, value in enumerate(expected):
        assert velocity.grad[row].tolist() == pytest.approx([value] * 4, abs=1e-8), row


def test_the_recipe_loss_reads_rows_as_winner_loser_units():
    # The recipe's DpoLoss: rows (w1, l1, w2, l2) -> [2] per pair, the same numbers; the old velocity is not needed.
    velocity, reference, target = two_pairs()
    loss = FORWARD_LOSSES["dpo"](beta=2.0)
    value = loss(velocity, None, target, torch.zeros(2), torch.full((4,), 0.5), ref_velocity=reference)
    assert value.tolist() == pytest.approx([0.20141328, 1.31326169], abs=1e-8)
    assert (loss.needs_old, loss.needs_reference) == (False, True)
    # The reference's errors carry no gradient: a model equal to the reference sits at log 2, whatever the pair.
    same = loss(reference.clone().requires_grad_(), None, target, torch.zeros(2), torch.zeros(4),
                ref_velocity=reference)
    assert same.tolist() == pytest.approx([math.log(2)] * 2)


# ---- pairs ---------------------------------------------------------------------------------------------------

# Group 0 (rows 0-3): 0.1, 0.9, -0.5, 0.9 (a tie at the top); group 1 (rows 4-6): all 0.3; group 2 (rows 7-8): one
# unscored row and one scored; group 3 (rows 9-11): 0, 1 and an unscored row.
SCORES = torch.tensor([0.1, 0.9, -0.5, 0.9, 0.3, 0.3, 0.3, float("nan"), 1.0, 0.0, 1.0, float("nan")])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3])


def test_best_worst_pairs_skip_ties_and_unscored_rows():
    # Group 0: the first best (row 1) against the worst (row 2); groups 1 and 2 give none; group 3: 10 over 9.
    assert best_worst_pairs(SCORES, GROUPS).tolist() == [[1, 2], [10, 9]]


def test_all_pairs_are_every_strict_winner_loser_pair_of_a_group():
    # Group 0: 0.1 > -0.5, 0.9 > 0.1 and -0.5 (twice, rows 1 and 3), and not 1 vs 3 (tied): 5 pairs; group 3: 1.
    assert all_pairs(SCORES, GROUPS).tolist() == [[0, 2], [1, 0], [1, 2], [3, 0], [3, 2], [10, 9]]


class TwoProcesses:
    """An accelerator stand-in whose other process has ``other`` pairs."""

    device = torch.device("cpu")

    def __init__(self, other: int):
        self.other = other

    def gather(self, value):
        return torch.cat([value, torch.tensor([self.other])])

    def reduce(self, value, reduction):
        return value + self.other


def test_units_mask_unscored_rows_and_pad_to_the_busiest_process():
    keep = torch.isfinite(SCORES)
    rows, weights = DpoLoss(pairing="best_worst").units(SCORES.nan_to_num(5.0), GROUPS, keep, TwoProcesses(4))
    # The NaN rows (scored 5 here, as an advantage of an unscored row may be) are left out by keep; the other process
    # has 4 pairs, so two weight-0 fillers (copies of the first pair) follow.
    assert rows.tolist() == [[1, 2], [10, 9], [1, 2], [1, 2]] and weights.tolist() == [1, 1, 0, 0]
    loss = DpoLoss(pairing="all")
    rows, weights = loss.units(torch.zeros(12), GROUPS, keep, TwoProcesses(0))  # every group tied: one filler
    assert rows.shape == (1, 2) and weights.tolist() == [0.0] and loss.metrics(torch.zeros(12)) == {"dpo/pairs": 0.0}


def test_a_pair_shares_its_t_and_noise():
    class Policy:
        device, dtype = torch.device("cpu"), torch.float32

    x0 = torch.stack([torch.full((1, 2, 2), v) for v in (1.0, -1.0, 2.0, 3.0)])  # [4, 1, 2, 2]: (w1, l1, w2, l2)
    noised, target, sigma = noised_sample(x0, [0, 1], None, Policy(), rows_per_unit=2)
    noise = target + x0  # target = eps - x0 (float32: equal up to rounding)
    assert torch.equal(sigma[0], sigma[1]) and torch.equal(sigma[2], sigma[3]) and sigma[0] != sigma[2]
    assert torch.allclose(noise[0], noise[1], atol=1e-6) and torch.allclose(noise[2], noise[3], atol=1e-6)
    assert not torch.allclose(noise[0], noise[2], atol=1e-2)
    column = sigma.reshape(-1, 1, 1, 1)
    assert torch.allclose(noised, (1 - column) * x0 + column * noise, atol=1e-6)
    # One row per unit: every row its own t and noise.
    _, single_target, single_sigma = noised_sample(x0, [0, 1], None, Policy())
    assert single_sigma[0] != single_sigma[1]
    assert not torch.allclose(single_target[0] + x0[0], single_target[1] + x0[1], atol=1e-2)


# ---- the recipe ----------------------------------------------------------------------------------------------

def dpo_config(path, *overrides):
    base = [f"run_dir={path}", "recipe=nft", "nft.loss=dpo", "log.progress=false", "log.eval_every=0",
            "log.report_prompts=0", "train.learning_rate=1e-2", "nft.timesteps_per_sample=2", "nft.dpo_beta=50",
            "train.checkpoint_every=1", "train.beta=0"]
    return load_config(Config, SMOKE, base + list(overrides))


def lora_weights(run_dir):
    return load_file(str(run_dir / "lora" / "pytorch_lora_weights.safetensors"))


def test_tiny_dpo_run_trains_the_lora_and_resumes_exactly(tmp_path):
    cfg = dpo_config(tmp_path / "full", "train.epochs=2")
    assert cfg.nft.choice("rollout_weights") == "trained"  # online: the policy it trains samples
    train(cfg)
    records = read_metrics(tmp_path / "full")
    assert len(records) == 2 and all(math.isfinite(r["loss/dpo"]) and r["dpo/pairs"] > 0 for r in records)
    # The first optimizer step measures the adapter, still zero, against the base model: exactly log 2.
    assert records[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[1]["loss/dpo"] != pytest.approx(math.log(2), abs=1e-6)
    full = lora_weights(tmp_path / "full")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in full.items())  # the LoRA moved
    train(dpo_config(tmp_path / "resumed", "train.epochs=1"))
    train(dpo_config(tmp_path / "resumed", "train.epochs=2", "train.resume=latest"))
    resumed = lora_weights(tmp_path / "resumed")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    strip = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("perf/")}
                     for r in read_metrics(tmp_path / "resumed")]


@pytest.mark.parametrize("overrides, key", [
    (["sampling.group_size=1", "train.advantage=mean"], "sampling.group_size"),
    (["sampling.group_size=1"], "sampling.group_size"),
    (["nft.dpo_beta=0"], "nft.dpo_beta"),
    (["train.combine=marble", "rewards=[{name: brightness}, {name: jpeg_compressibility}]"], "train.combine"),
])
def test_bad_dpo_input_is_one_line_and_leaves_no_run_dir(overrides, key, tmp_path, capsys):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        dpo_config(tmp_path / "run", *overrides)
    assert "\n" not in str(error.value)
    run = tmp_path / "cli"
    argv = ["train", SMOKE, f"run_dir={run}", "recipe=nft", "nft.loss=dpo", "train.epochs=1", *overrides]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith("flowrl train: error: ") and key in errors[0], errors
    assert not run.exists()


def test_the_dpo_presets_load():
    toy = load_config(Config, "configs/toy/dpo.yaml")
    assert (toy.nft.loss, toy.nft.dpo_pairs, toy.nft.dpo_beta, toy.sampling.group_size) == ("dpo", "best_worst",
                                                                                            20.0, 16)
    real = load_config(Config, "configs/sd35_medium/dpo_pickscore.yaml")
    assert (real.nft.loss, real.nft.dpo_beta, real.sampling.group_size) == ("dpo", 100.0, 24)
