"""Online DPO against Diffusion-DPO's loss (SalesforceAIResearch/DiffusionDPO train.py at 8d3ee5c) in flow-matching
form: the loss and its gradient by hand on a 2-pair batch, the pairs of a hand-made group (best/worst, all, ties,
unscored rows), the shared (t, noise) of a pair, Flow-GRPO's logit-normal timesteps (its formula and their law), and
the recipe: a tiny 2-epoch run (finite loss, the LoRA moves, the first step measured against the base model, exact
resume), the reference refreshed to the adapter every N epochs (nft.dpo_ref_update_every) and resumed exactly, and
the bad inputs."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import flowrl.recipes.nft as nft_recipe
from flowrl.algorithms.dpo import all_pairs, best_worst_pairs, dpo_loss, matching_error
from flowrl.algorithms.timesteps import TIMESTEP_SCHEDULES, logit_normal_timesteps
from flowrl.cli import main
from flowrl.config import Config, ConfigError, load_config
from flowrl.config.nft import NFTSection
from flowrl.algorithms.forward_losses import FORWARD_LOSSES, DpoLoss, noised_sample
from flowrl.models import build_policy
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


# ---- timesteps -------------------------------------------------------------------------------------------------

def flow_grpo_grid(shift: float) -> torch.Tensor:
    """[1000] the sigmas of a 1000-step flow-matching training scheduler at ``shift``, from 1 down (diffusers'
    FlowMatchEulerDiscreteScheduler at init: t = (1000 - i) / 1000, sigma = shift t / (1 + (shift - 1) t))."""
    t = torch.arange(1000, 0, -1, dtype=torch.float64) / 1000
    return shift * t / (1 + (shift - 1) * t)


def test_logit_normal_timesteps_follow_flow_grpos_formula():
    # Flow-GRPO (scripts/train_sd3_dpo.py L890-898): u = sigmoid(mean + std z), index = long(u * 1000), sigma =
    # the shifted scheduler's sigma at that index. Written here with torch on the same normal draws.
    grid = flow_grpo_grid(3.0)
    for mean, std, seed in ((0.0, 1.0, [0, 1]), (0.5, 2.0, [3, 4, 5])):
        drawn = logit_normal_timesteps(grid, 6, 3, mean=mean, std=std, seed=seed)  # [6, 3]
        z = torch.as_tensor(np.random.default_rng(seed).standard_normal((6, 3)))
        index = (torch.sigmoid(mean + std * z) * 1000).long()
        assert drawn.shape == (6, 3) and torch.equal(drawn, grid[index])


def test_logit_normal_sigmas_have_the_law_of_a_shifted_logit_normal():
    # With shift 3, sigma < 0.3 iff t < 0.3 / (3 - 2 * 0.3) = 0.125, and on the grid t = (1000 - i) / 1000 < 0.125
    # iff i >= 876, i.e. u >= 0.876: P = 1 - Phi(logit 0.876) = Phi(-1.95509) = 0.025287 (Phi(logit 0.125) = 2.58%
    # without the grid; the toy's 10-step sampling grid puts 1 sigma in 10 there).
    sigma = logit_normal_timesteps(flow_grpo_grid(3.0), 400_000, 1, mean=0.0, std=1.0, seed=[7])
    expected = 0.5 * math.erfc(math.log(0.876 / 0.124) / math.sqrt(2))
    assert expected == pytest.approx(0.025287, abs=1e-6)
    assert float((sigma < 0.3).double().mean()) == pytest.approx(expected, abs=0.0012)  # 5 standard errors
    # The median: u = 1/2 -> index 500, t = 0.5 -> sigma = 1.5 / 2 = 0.75.
    assert float(sigma.median()) == pytest.approx(0.75, abs=0.005)


def test_logit_normal_is_dpos_default_on_the_models_own_shift():
    assert NFTSection(loss="dpo").choice("timestep_schedule") == "logit_normal"
    assert NFTSection().choice("timestep_schedule") == "sampling"  # DiffusionNFT's stays
    policy = build_policy("sd3", "tiny", seed=0)  # SD3's static shift 3
    nft = NFTSection(loss="dpo", timesteps_per_sample=2)
    drawn = TIMESTEP_SCHEDULES["logit_normal"](None, 100_000, nft, [0, 1], policy.sigmas)  # [100000, 2]
    assert drawn.shape == (100_000, 2) and drawn.dtype == torch.float32
    assert float((drawn < 0.3).double().mean()) == pytest.approx(0.0253, abs=0.0015)
    # The draw is on the model's own 1000-step schedule: every sigma is one of its values.
    assert torch.isin(drawn, policy.sigmas(1000)[:-1].float()).all()


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


def test_the_dpo_reference_is_the_base_model_until_a_refresh_then_the_adapter_of_that_epoch(tmp_path, monkeypatch):
    # nft.dpo_ref_update_every=2 over 3 epochs: epochs 0 and 1 are measured against the base model (adapter off);
    # at the end of epoch 1 the reference becomes the adapter as it ended epoch 1, which epoch 2 is measured against.
    ends, seen, epoch = {}, [], [0]
    real_loss, real_follow = nft_recipe.forward_process_loss, nft_recipe.follow_trained_adapter

    def follow(run, done):
        ends[done] = {name: p.detach().clone() for name, p in run.policy.named_trainable_parameters()}
        epoch[0] = done + 1
        return real_follow(run, done)

    def loss(policy, old, x0, cond, *args, reference=None, guidance, **kwargs):
        with torch.no_grad():  # a fixed probe: the reference's velocity, and the base model's
            x, sigma = (0.5 * x0).to(policy.device, policy.dtype), torch.full((len(x0),), 0.5, device=policy.device)
            with reference():
                weights = {name: p.detach().clone() for name, p in policy.named_trainable_parameters()}
                v_ref = policy.velocity(x, sigma, cond, guidance)
            with policy.reference():
                v_base = policy.velocity(x, sigma, cond, guidance)
        seen.append((epoch[0], weights, torch.equal(v_ref, v_base)))
        return real_loss(policy, old, x0, cond, *args, reference=reference, guidance=guidance, **kwargs)

    monkeypatch.setattr(nft_recipe, "follow_trained_adapter", follow)
    monkeypatch.setattr(nft_recipe, "forward_process_loss", loss)
    train(dpo_config(tmp_path / "run", "train.epochs=3", "nft.dpo_ref_update_every=2"))
    assert {e for e, _, _ in seen} == {0, 1, 2}
    assert all(is_base for e, _, is_base in seen if e < 2)
    assert any(not torch.equal(ends[1][name], ends[0][name]) for name in ends[1])  # the adapter moved in epoch 1
    for _, weights, is_base in (call for call in seen if call[0] == 2):  # the snapshot's copy, s - (s - p), may
        assert not is_base  # round in the last bit of float32
        for name in ends[1]:
            torch.testing.assert_close(weights[name], ends[1][name], rtol=1e-6, atol=1e-7)
    assert [r["dpo/reference_refreshes"] for r in read_metrics(tmp_path / "run")] == [0.0, 1.0, 1.0]


def test_a_run_whose_reference_refreshes_resumes_exactly(tmp_path):
    # Interrupted right after the first refresh (end of epoch 1), resumed to 4 epochs (a second refresh at the end of
    # epoch 3): the same metrics and LoRA as the uninterrupted run, in this process (same shapes, same threads).
    train(dpo_config(tmp_path / "full", "train.epochs=4", "nft.dpo_ref_update_every=2"))
    train(dpo_config(tmp_path / "resumed", "train.epochs=2", "nft.dpo_ref_update_every=2"))
    checkpoints = tmp_path / "resumed" / "checkpoints"
    checkpoint = checkpoints / (checkpoints / "latest").read_text().strip()
    assert json.loads((checkpoint / "trainer_state.json").read_text())["dpo_reference"] == 1
    saved = load_file(str(checkpoint / "dpo_reference.safetensors"))
    assert saved.keys() and any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # not the base
    train(dpo_config(tmp_path / "resumed", "train.epochs=4", "nft.dpo_ref_update_every=2", "train.resume=latest"))
    full, resumed = lora_weights(tmp_path / "full"), lora_weights(tmp_path / "resumed")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]  # noqa: E731
    assert strip(read_metrics(tmp_path / "full")) == strip(read_metrics(tmp_path / "resumed"))
    assert [r["dpo/reference_refreshes"] for r in read_metrics(tmp_path / "full")] == [0.0, 1.0, 1.0, 2.0]


@pytest.mark.parametrize("overrides, key", [
    (["sampling.group_size=1", "train.advantage=mean"], "sampling.group_size"),
    (["sampling.group_size=1"], "sampling.group_size"),
    (["nft.dpo_beta=0"], "nft.dpo_beta"),
    (["nft.dpo_ref_update_every=0"], "nft.dpo_ref_update_every"),
    (["nft.logit_std=0"], "nft.logit_std"),
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


def test_a_reference_refresh_without_dpo_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"nft\.dpo_ref_update_every.*nft\.loss=dpo"):
        load_config(Config, SMOKE, [f"run_dir={tmp_path}", "recipe=nft", "nft.dpo_ref_update_every=2"])
