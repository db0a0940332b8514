"""The diversity guard (flowrl/recipes/guard.py): its drop rule and policies on hand-made diversity
sequences, the best-weights criterion by hand, and real runs: a tiny toy GRPO run that the guard stops,
raise_beta turning the KL on in both recipes, resume keeping the guard's state, and the config errors."""

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from flowrl.commands.train import recipe_train
from flowrl.config import Config, ConfigError, load_config
from flowrl.models.lora_io import lora_state_dict, read_lora
from flowrl.recipes.guard import DiversityGuard, guard_score, in_group_diversity, raised_beta, relative_drop
from flowrl.training.ema import AdapterSnapshot
from flowrl.training.metrics import read_metrics
from tools.toy_runs import train_on_prompts

SMOKE = "configs/smoke/sd3_tiny.yaml"


def make_guard(**overrides) -> tuple[DiversityGuard, list[str]]:
    lines: list[str] = []
    kwargs = dict(every=1, warmup=2, max_drop=0.3, policy="warn", beta=0.0, beta_factor=2.0, beta_floor=0.04,
                  cooldown=3, diversity_weight=1.0, write=lines.append,
                  best=AdapterSnapshot([("w", torch.nn.Parameter(torch.zeros(1)))], taken=False))
    return DiversityGuard(**{**kwargs, **overrides}), lines


def feed(guard: DiversityGuard, diversities, rewards=None) -> list[dict]:
    rewards = rewards or [0.0] * len(diversities)
    return [guard.observe(epoch, d, reward=r, weights=lambda e=epoch: {"w": torch.tensor([float(e)])})
            for epoch, (d, r) in enumerate(zip(diversities, rewards))]


def fired_epochs(metrics: list[dict]) -> list[int]:
    return [epoch for epoch, m in enumerate(metrics) if m["diversity/guard_fired"] == 1.0]


def test_pure_rules_by_hand():
    assert relative_drop(0.9, 0.63) == pytest.approx(0.3)
    assert relative_drop(0.5, 0.6) == pytest.approx(-0.2)  # diversity rose
    assert relative_drop(0.0, 0.1) == 0.0 and relative_drop(math.nan, 0.1) == 0.0
    assert raised_beta(0.04, 2.0, 0.04) == pytest.approx(0.08) and raised_beta(0.0, 2.0, 0.04) == 0.04
    assert guard_score(0.5, 0.2, 2.0) == pytest.approx(0.9)
    # Group 0: orthogonal rows (distance 1); group 1: parallel rows (0); the zero row has no direction.
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]])
    assert in_group_diversity(features, torch.tensor([0, 0, 1, 1, 1])) == pytest.approx(0.5)
    assert math.isnan(in_group_diversity(features[:2], torch.tensor([0, 1])))  # groups of one: no pairs


def test_fires_at_the_first_epoch_past_the_threshold_then_waits_the_cooldown():
    guard, lines = make_guard()
    # start = mean(1.0, 0.8) = 0.9; it fires below 0.63: epoch 3 first, then not before epoch 3 + cooldown 3.
    metrics = feed(guard, [1.0, 0.8, 0.7, 0.62, 0.5, 0.5, 0.5, 0.64, 0.5])
    assert fired_epochs(metrics) == [3, 6]
    assert metrics[3]["diversity/start"] == pytest.approx(0.9)
    assert metrics[3]["diversity/drop"] == pytest.approx((0.9 - 0.62) / 0.9)
    assert len(lines) == 2 and "epoch 3" in lines[0] and "0.9000" in lines[0] and "0.6200" in lines[0]
    assert "raise train.beta" in lines[0] and "\n" not in lines[0]
    assert not guard.stopped and guard.beta == 0.0  # warn only writes


def test_the_start_is_the_warmup_mean_and_the_warmup_never_fires():
    # Against the first measurement alone 0.66 is 34% down; against the mean of two (0.9) only 27%.
    assert fired_epochs(feed(make_guard(warmup=1)[0], [1.0, 0.8, 0.66])) == [2]
    assert fired_epochs(feed(make_guard(warmup=2)[0], [1.0, 0.8, 0.66])) == []
    assert fired_epochs(feed(make_guard(warmup=2)[0], [1.0, 0.1, 0.95])) == []  # a fall inside the warmup
    guard, _ = make_guard(warmup=2, every=5)
    due = []
    for epoch in range(12):
        if guard.due(epoch):
            due.append(epoch)
            guard.observe(epoch, 1.0, reward=0.0)
    assert due == [0, 1, 5, 10]  # the warmup epochs, then every 5th


def test_raise_beta_sets_the_floor_then_multiplies():
    guard, lines = make_guard(policy="raise_beta", cooldown=2)
    metrics = feed(guard, [1.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    assert fired_epochs(metrics) == [2, 4]
    assert [m["diversity/beta"] for m in metrics] == pytest.approx([0.0, 0.0, 0.04, 0.04, 0.08, 0.08])
    assert "0 -> 0.04" in lines[0] and "0.04 -> 0.08" in lines[1]


def test_stop_keeps_the_best_reward_diversity_measurement():
    diversities, rewards = [1.0, 0.9, 0.6, 0.3], [0.1, 0.3, 0.5, 0.6]
    # weight 1: scores 1.1, 1.2, 1.1, 0.9 -> epoch 1; weight 0: the highest reward, epoch 3.
    for weight, best in ((1.0, 1), (0.0, 3)):
        guard, _ = make_guard(policy="stop", warmup=1, max_drop=0.5, diversity_weight=weight)
        metrics = feed(guard, diversities, rewards)
        assert fired_epochs(metrics) == [3] and guard.stopped
        assert guard.best_epoch == best and metrics[-1]["diversity/best_epoch"] == best
        assert guard.best.taken and torch.equal(guard.best.state_tensors()["w"], torch.tensor([float(best)]))  # that epoch's weights


def test_state_round_trips_through_json():
    guard, _ = make_guard(policy="raise_beta")
    feed(guard, [1.0, 0.8, 0.5])
    restored, _ = make_guard(policy="raise_beta")
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.state_dict() == guard.state_dict() and restored.beta == 0.04
    assert restored.observe(3, 0.5, reward=0.0) == guard.observe(3, 0.5, reward=0.0)  # still cooling down


def smoke_run(run_dir, *overrides) -> list[dict]:
    clip = [] if "recipe=nft" in overrides else ["train.clip_range=0.2"]  # recipe grpo's key
    cfg = load_config(Config, SMOKE, [f"run_dir={run_dir}", "log.progress=false", "log.eval_every=0",
                                      "log.report_prompts=0", "train.learning_rate=1e-2", *clip,
                                      "guard.enabled=true", "guard.warmup=1", *overrides])
    recipe_train(cfg.recipe)(cfg)
    return read_metrics(run_dir)


def test_toy_grpo_run_stops_early_and_exports_the_best_snapshot(tmp_path, monkeypatch):
    # Groups of 4 on two prompts: latent diversity 0.993, 0.974, 0.925 in the first epochs (measured).
    policy, cfg, _ = train_on_prompts("configs/toy/grpo_proxy.yaml", ("a red square", "a blue circle"), tmp_path,
                                      monkeypatch, epochs=6,
                                      overrides=["sampling.group_size=4", "train.micro_batch_size=8",
                                                 "guard.enabled=true", "guard.policy=stop", "guard.warmup=1",
                                                 "guard.max_drop=0.05"])
    records = read_metrics(tmp_path / "run")
    assert len(records) < 6, "the guard did not stop the run"
    assert [r["diversity/guard_fired"] for r in records] == [0.0] * (len(records) - 1) + [1.0]
    assert all(0 < r["diversity/cosine"] <= 2 and "diversity/start" in r and "diversity/drop" in r for r in records)
    last = records[-1]
    assert last["diversity/drop"] > 0.05 and last["diversity/best_epoch"] < len(records)
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{len(records) - 1:06d}"
    best = load_file(checkpoint / "guard_best.safetensors")
    exported, _ = read_lora(tmp_path / "run" / "lora")  # unfolds the export's alpha / r scale again
    assert exported.keys() == best.keys()
    assert all(torch.allclose(exported[k], best[k], rtol=1e-6, atol=0) for k in best)
    final_ema = load_file(checkpoint / "ema.safetensors")  # what an unguarded run would have exported
    assert any(not torch.equal(final_ema[k], best[k]) for k in best)
    live = lora_state_dict(policy.transformer)  # the report renders these (and the EMA, loaded alike)
    assert all(torch.equal(live[k], best[k]) for k in best)
    state = json.loads((checkpoint / "trainer_state.json").read_text())["guard"]
    assert state["stopped"] and state["best_epoch"] == last["diversity/best_epoch"]


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_raise_beta_turns_the_kl_on(tmp_path, recipe):
    # Without KL (beta 0) the first firing sets beta to the floor; from that epoch's update on the KL is computed.
    records = smoke_run(tmp_path, f"recipe={recipe}", "train.epochs=4", "train.beta=0", "guard.policy=raise_beta",
                        "guard.max_drop=0.001", "guard.beta_floor=0.1", "train.checkpoint_every=0")
    fired = next(i for i, r in enumerate(records) if r["diversity/guard_fired"] == 1.0)
    assert fired >= 1
    assert all(r["diversity/beta"] == 0.0 and r["loss/kl"] == 0.0 for r in records[:fired])
    assert all(r["diversity/beta"] >= 0.1 and r["loss/kl"] > 0 for r in records[fired:])


@pytest.mark.parametrize("policy", ["raise_beta", "stop"])
def test_resume_keeps_the_guard_state(tmp_path, policy):
    # The smoke run's diversity: 0.849, 0.841, 0.847, 0.828 (-2.5%), ... : with max_drop 0.02 the guard fires at
    # epoch 3, after the resume point (raise_beta fires at 1 too, before it); under stop, diversity weight 100
    # makes epoch 0 the best, so the resumed run must export the snapshot its checkpoint brought back.
    drop = "0.005" if policy == "raise_beta" else "0.02"
    common = [f"guard.policy={policy}", f"guard.max_drop={drop}", "guard.cooldown=2", "guard.diversity_weight=100",
              "train.checkpoint_every=1"]
    full = smoke_run(tmp_path / "full", "train.epochs=6", *common)
    smoke_run(tmp_path / "split", "train.epochs=3", *common)
    split = smoke_run(tmp_path / "split", "train.epochs=6", "train.resume=latest", *common)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]  # noqa: E731
    assert strip(split) == strip(full)
    assert fired_epochs(full)[-1] >= 3
    if policy == "raise_beta":
        assert full[-1]["diversity/beta"] > full[0]["diversity/beta"]
    else:
        assert len(full) == 4 and full[-1]["diversity/best_epoch"] == 0
    a, b = (load_file(tmp_path / run / "lora" / "pytorch_lora_weights.safetensors") for run in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if policy == "stop":  # resuming a run the guard stopped trains nothing and exports the same best weights
        (tmp_path / "full" / "lora" / "pytorch_lora_weights.safetensors").unlink()
        assert smoke_run(tmp_path / "full", "train.epochs=6", "train.resume=latest", *common) == full
        c = load_file(tmp_path / "full" / "lora" / "pytorch_lora_weights.safetensors")
        assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("override, key", [
    ("guard.every=0", "guard.every"), ("guard.warmup=0", "guard.warmup"), ("guard.max_drop=1.5", "guard.max_drop"),
    ("guard.max_drop=0", "guard.max_drop"), ("guard.policy=halt", "guard.policy"),
    ("guard.features=fourier", "guard.features"), ("guard.beta_factor=1", "guard.beta_factor"),
    ("guard.beta_floor=0", "guard.beta_floor"), ("guard.cooldown=0", "guard.cooldown"),
    ("guard.diversity_weight=-1", "guard.diversity_weight"), ("guard.threshold=0.3", "guard"),
])
def test_bad_guard_config_is_a_one_line_error(tmp_path, override, key):
    from flowrl.recipes.names import check_names

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:  # range checks, then registry names
        check_names(load_config(Config, SMOKE, [f"run_dir={tmp_path}", "guard.enabled=true", override]))
    assert "\n" not in str(error.value)


def test_guard_needs_groups():
    with pytest.raises(ConfigError, match="guard.enabled"):
        load_config(Config, SMOKE, ["guard.enabled=true", "sampling.group_size=1", "train.advantage=mean"])
