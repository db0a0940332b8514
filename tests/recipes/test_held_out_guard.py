"""The held-out guard (flowrl/recipes/held_out_guard.py): its firing rule on hand-made held-out curves and
training rewards, rollback putting the best point's tensors back exactly (LoRA, EMA, AdamW moments) with the LR
and KL beta changed, and real tiny runs: rollback in both recipes, stop exporting the best snapshot, exact resume,
and the bad-input lines."""

import json
import math
import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.commands.train import recipe_train
from flowrl.config import Config, load_config
from flowrl.models.lora_io import read_lora
from flowrl.recipes.held_out_guard import (HeldOutGuard, HeldOutWeights, fall_from_best, falls, slope, task_mean,
                                           trained_reward)
from flowrl.training.ema import LoraEMA
from flowrl.training.lr import build_lr_scheduler
from flowrl.training.metrics import read_metrics
from tests.fault_helpers import TINY_TRAIN

SMOKE = "configs/smoke/sd3_tiny.yaml"
TASKS = ["a", "a", "b", "b"]


def make_guard(**overrides) -> tuple[HeldOutGuard, list[str]]:
    lines: list[str] = []
    kwargs = dict(reward="gold", margin=0.05, z=2.0, patience=2, policy="warn", lr_factor=0.5, kl_factor=1.0,
                  max_rollbacks=1, train_weights={"proxy": 1.0}, write=lines.append)
    return HeldOutGuard(**{**kwargs, **overrides}), lines


def feed(guard: HeldOutGuard, train: list[float], held_out: dict[int, list[float]]) -> list[dict]:
    """Epochs 0.. with training rewards ``train``; ``held_out``: {epoch: per-prompt scores} (epoch -1: the base)."""
    run = SimpleNamespace(test_set=SimpleNamespace(metadata=[{"task": t} for t in TASKS]), optimizer=None)
    scores = lambda e: None if e not in held_out else {"gold": torch.tensor(held_out[e])}  # noqa: E731  [P], n = 1
    out = [guard.end_epoch(run, -1, {}, scores(-1))]
    for epoch, reward in enumerate(train):
        out.append(guard.end_epoch(run, epoch, {"reward/proxy_mean": reward}, scores(epoch)))
    return out


def fired(metrics: list[dict]) -> list[int]:
    return [i - 1 for i, m in enumerate(metrics) if m.get("guard/held_out_fired") == 1.0]


def test_rule_pieces_by_hand():
    # Tasks a, b: (0.6 + 0.8) / 2 = 0.7 and 0.2 -> mean over tasks 0.45.
    assert task_mean(torch.tensor([0.6, 0.8, 0.2, math.nan]), TASKS) == pytest.approx(0.45)
    # Paired differences now - best: task a (-0.1, -0.3), task b (0, -0.2): means -0.2, -0.1 -> fall 0.15; variances
    # 0.02 and 0.02 over 2 prompts each: s.e. sqrt(0.01 + 0.01) / 2.
    drop, se = fall_from_best(torch.tensor([0.5, 0.5, 0.5, 0.5]), torch.tensor([0.4, 0.2, 0.5, 0.3]), TASKS)
    assert drop == pytest.approx(0.15) and se == pytest.approx(math.sqrt(0.02) / 2)
    assert slope([0, 1, 2], [0.1, 0.3, 0.5]) == pytest.approx(0.2) and math.isnan(slope([0], [1.0]))
    assert falls(0.15, 0.05, margin=0.02, z=2.0) and not falls(0.11, 0.05, margin=0.02, z=2.0)
    assert trained_reward({"reward/a_mean": 0.5, "reward/b_mean": 2.0}, {"a": 2.0, "b": 0.5, "gold": 0.0}) == 2.0


def test_fires_when_held_out_falls_beyond_noise_while_training_reward_rises():
    # Held-out every 2 epochs; best at epoch 1 (0.7); then 0.55 twice (fall 0.15 > 0.05 + 2 s.e. of 0.0): fires at
    # the second fallen point (patience 2), epoch 5; the training reward rose throughout.
    guard, lines = make_guard()
    curve = {-1: [0.5] * 4, 1: [0.7] * 4, 3: [0.55] * 4, 5: [0.55] * 4}
    metrics = feed(guard, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], curve)
    assert fired(metrics) == [5] and len(lines) == 1 and "\n" not in lines[0]
    assert "epoch 5" in lines[0] and "best 0.7000" in lines[0] and "policy=rollback" in lines[0]
    assert metrics[4]["guard/held_out_strikes"] == 1.0 and metrics[6]["guard/held_out_drop"] == pytest.approx(0.15)
    assert metrics[6]["guard/held_out_train_slope"] == pytest.approx(0.1)  # epochs 2..5, after the best point
    assert guard.best_epoch == 1 and not guard.stopped


def test_does_not_fire_within_noise():
    # The same mean fall of 0.15, but the per-prompt differences spread: (+0.15, -0.45, +0.15, -0.45) -> s.e.
    # sqrt(0.18 / 2 + 0.18 / 2) / 2 = 0.212, so 0.15 < 0.05 + 2 * 0.212.
    guard, _ = make_guard()
    curve = {-1: [0.7] * 4, 1: [0.85, 0.25, 0.85, 0.25], 3: [0.85, 0.25, 0.85, 0.25]}
    metrics = feed(guard, [0.1, 0.2, 0.3, 0.4], curve)
    assert metrics[2]["guard/held_out_drop"] == pytest.approx(0.15)
    assert metrics[2]["guard/held_out_se"] == pytest.approx(math.sqrt(0.18) / 2)
    assert fired(metrics) == [] and guard.strikes == 0
    guard, _ = make_guard(z=0.0)  # no noise allowance: the same curve fires
    assert fired(feed(guard, [0.1, 0.2, 0.3, 0.4], curve)) == [3]


def test_does_not_fire_while_the_training_reward_falls_too():
    guard, _ = make_guard()
    curve = {-1: [0.7] * 4, 1: [0.5] * 4, 3: [0.4] * 4, 5: [0.3] * 4}
    metrics = feed(guard, [0.6, 0.5, 0.4, 0.3, 0.2, 0.1], curve)
    assert fired(metrics) == [] and all(m.get("guard/held_out_train_slope", -1) < 0 for m in metrics[2::2])
    guard, _ = make_guard()  # the same held-out curve with a rising training reward fires
    assert fired(feed(guard, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], curve)) == [3]


def test_policies_stop_and_bounded_rollbacks():
    curve = {-1: [0.7] * 4, 1: [0.5] * 4, 3: [0.5] * 4, 5: [0.5] * 4, 7: [0.5] * 4}
    guard, lines = make_guard(policy="stop", patience=1)
    metrics = feed(guard, [0.1 * i for i in range(8)], curve)
    assert fired(metrics) == [1] and guard.stopped and "stopping" in lines[0]
    guard, lines = make_guard(policy="rollback", patience=1, max_rollbacks=1)
    guard.roll_back = lambda run: None  # the weights part is tested below
    metrics = feed(guard, [0.1 * i for i in range(8)], curve)
    # Rollback at 1 (the window restarts), then the next firing (the window of 3 holds 2, 3) stops: max_rollbacks 1.
    assert fired(metrics) == [1, 3] and guard.rollbacks == 1 and guard.stopped
    assert "rolling back to epoch -1" in lines[0] and "stopping" in lines[1]
    assert metrics[2]["guard/held_out_lr_scale"] == 0.5 and guard.kl_scale == 1.0


def test_state_round_trips_through_json():
    curve = {-1: [0.7] * 4, 1: [0.5] * 4}
    guard, _ = make_guard()
    feed(guard, [0.1, 0.2, 0.3], curve)
    restored, _ = make_guard()
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.state_dict() == guard.state_dict() and restored.strikes == 1
    run = SimpleNamespace(test_set=SimpleNamespace(metadata=[{"task": t} for t in TASKS]), optimizer=None)
    point = {"gold": torch.tensor([0.5] * 4)}
    assert (restored.end_epoch(run, 3, {"reward/proxy_mean": 0.4}, point)
            == guard.end_epoch(run, 3, {"reward/proxy_mean": 0.4}, point))
    assert guard.action == restored.action == "warn"


def test_rollback_restores_the_best_tensors_exactly_and_lowers_the_lr():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    named = [(f"w{i}", p) for i, p in enumerate(params)]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    scheduler = build_lr_scheduler(optimizer, "constant", warmup_steps=0, total_steps=10)
    ema = LoraEMA(named, decay=0.5)

    def step():
        (sum((p ** 3).sum() for p in params)).backward()
        optimizer.step(), optimizer.zero_grad(), scheduler.step(), ema.step()

    weights = HeldOutWeights(named, params, lambda: {"ema": ema}, moments=True)
    guard, _ = make_guard(policy="rollback", weights=weights, kl_factor=2.0)
    run = SimpleNamespace(optimizer=optimizer, extras={"lr_scheduler": scheduler}, ema=ema)
    step(), step()
    weights.take(optimizer)  # the best point
    best = {"live": [p.detach().clone() for p in params], "ema": [s.clone() for s in ema.model.shadow_params],
            **{k: [optimizer.state[p][k].clone() for p in params] for k in ("exp_avg", "exp_avg_sq")}}
    best_step = [float(optimizer.state[p]["step"]) for p in params]
    step(), step(), step()
    assert not torch.equal(params[0], best["live"][0])
    guard.lr_scale, guard.beta_scale = 0.5, 2.0  # as observe sets them before acting
    guard.roll_back(run)
    assert all(torch.equal(p, b) for p, b in zip(params, best["live"]))
    assert all(torch.equal(s, b) for s, b in zip(ema.model.shadow_params, best["ema"]))
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(optimizer.state[p][key], b) for p, b in zip(params, best[key]))
    assert [float(optimizer.state[p]["step"]) for p in params] == best_step == [2.0, 2.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler's base moved too
    assert guard.kl_scale == 2.0
    # The KL beta in force: train.beta (or the diversity guard's) times every extra's kl_scale.
    from flowrl.recipes.run import Run

    cfg = SimpleNamespace(train=SimpleNamespace(beta=0.01))
    assert Run.beta.fget(SimpleNamespace(cfg=cfg, extras={"held_out_guard": guard})) == pytest.approx(0.02)
    diversity = SimpleNamespace(kl_beta=0.08)
    assert Run.beta.fget(SimpleNamespace(cfg=cfg, extras={"guard": diversity, "held_out_guard": guard})) == 0.16
    # A best point taken before any optimizer step (the base model): rollback gives AdamW a fresh start.
    fresh = HeldOutWeights(named, params, dict, moments=True)
    fresh.take(torch.optim.AdamW(params, lr=0.1))
    fresh.restore(optimizer)
    assert all(p not in optimizer.state for p in params)


def smoke_run(run_dir, *overrides) -> list[dict]:
    """Tiny SD3 on brightness, with a gold reward that prefers black (weight 0): it falls as brightness rises."""
    clip = [] if "recipe=nft" in overrides else ["train.clip_range=0.2"]  # recipe grpo's key
    cfg = load_config(Config, SMOKE, [
        f"run_dir={run_dir}", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
        "train.learning_rate=1e-2", *clip, "log.test_every=1", "log.test_prompts=4",
        "rewards=[{name: brightness}, {name: color_target, weight: 0, kwargs: {target: [0, 0, 0]}}]",
        "guard.held_out.reward=color_target", "guard.held_out.margin=0", "guard.held_out.z=0",
        "guard.held_out.patience=1", *overrides])
    recipe_train(cfg.recipe)(cfg)
    return read_metrics(run_dir)


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_rollback_in_a_real_run_restores_the_best_snapshot(tmp_path, recipe):
    records = smoke_run(tmp_path, f"recipe={recipe}", "train.epochs=3", "guard.held_out.policy=rollback",
                        "train.checkpoint_every=1", "train.beta=0.01", "guard.held_out.kl_factor=4")
    first = next(r for r in records if r.get("guard/held_out_fired") == 1.0)
    epoch = first["epoch"]
    assert first["guard/held_out_rollbacks"] == 1.0 and first["guard/held_out_lr_scale"] == 0.5
    assert first["guard/held_out_beta_scale"] == 4.0
    checkpoint = tmp_path / "checkpoints" / f"step_{epoch:06d}"  # saved after the rollback
    for saved, best in (("lora", "held_out_best"), ("ema", "held_out_best_ema")):
        a, b = load_file(checkpoint / f"{saved}.safetensors"), load_file(checkpoint / f"{best}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), saved
    if recipe == "nft":  # the old adapter it trains against went back too
        assert (checkpoint / "held_out_best_old.safetensors").is_file()
    state = json.loads((checkpoint / "trainer_state.json").read_text())["held_out_guard"]
    assert state["rollbacks"] == 1 and state["lr_scale"] == 0.5 and state["beta_scale"] == 4.0
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(0.005)
    after = [r for r in records if r["epoch"] > epoch]
    assert all(r["optim/lr"] == pytest.approx(0.005) for r in after)


def test_rollback_under_crd_restores_its_sampler_adapter(tmp_path):
    """CRD samples from its own adapter copy ("sampler"), blended toward the trained weights on its schedule: a
    rollback puts it back to the best point too, or the rolled-back run would sample from the weights it left."""
    records = smoke_run(tmp_path, "recipe=nft", "nft.loss=crd", "train.beta=0.1", "train.epochs=3",
                        "guard.held_out.policy=rollback", "train.checkpoint_every=1")
    first = next(r for r in records if r.get("guard/held_out_fired") == 1.0)
    checkpoint = tmp_path / "checkpoints" / f"step_{first['epoch']:06d}"  # saved right after the rollback
    best_epoch = int(first["guard/held_out_best_epoch"])
    for saved in ("lora", "ema", "sampler"):
        live, best = (load_file(checkpoint / f"{name}.safetensors")
                      for name in (saved, "held_out_best" if saved == "lora" else f"held_out_best_{saved}"))
        assert live.keys() == best.keys() and all(torch.equal(live[k], best[k]) for k in live), saved
    if best_epoch >= 0:  # the sampler the run went back to is the one it had then, not the initial weights
        then = load_file(tmp_path / "checkpoints" / f"step_{best_epoch:06d}" / "sampler.safetensors")
        now = load_file(checkpoint / "sampler.safetensors")
        assert all(torch.equal(then[k], now[k]) for k in then)


def test_adapter_copies_are_every_training_copy_once_and_no_record():
    from flowrl.recipes.run import AdapterCopies, Run

    params = [torch.nn.Parameter(torch.zeros(2))]
    ema, old, sampler, best = (LoraEMA([("w", params[0])], decay=0.5) for _ in range(4))
    guard = SimpleNamespace(keeps_records=True, snapshots=lambda: {"guard_best": best})
    run = SimpleNamespace(exported_ema=ema, ema=old, extras={
        "adapters": AdapterCopies({"old": old, "sampler": sampler}), "guard": guard})
    copies = Run.adapter_copies(run)
    assert list(copies) == ["ema", "old", "sampler"]
    assert copies["ema"] is ema and copies["old"] is old and copies["sampler"] is sampler


def test_stop_exports_the_best_snapshot(tmp_path):
    records = smoke_run(tmp_path, "train.epochs=5", "guard.held_out.policy=stop", "train.checkpoint_every=0")
    train = [r for r in records if r["epoch"] >= 0]
    assert len(train) < 5 and train[-1]["guard/held_out_fired"] == 1.0, "the guard did not stop the run"
    best_epoch = int(train[-1]["guard/held_out_best_epoch"])
    assert best_epoch < train[-1]["epoch"]
    checkpoint = tmp_path / "checkpoints" / f"step_{train[-1]['epoch']:06d}"
    best = load_file(checkpoint / "held_out_best_ema.safetensors")  # the weights the best point scored
    exported, _ = read_lora(tmp_path / "lora")  # unfolds the export's alpha / r scale again
    assert exported.keys() == best.keys()
    assert all(torch.allclose(exported[k], best[k], rtol=1e-6, atol=0) for k in best)
    final = load_file(checkpoint / "ema.safetensors")  # what an unguarded run would have exported
    assert best_epoch == -1 or any(not torch.equal(final[k], best[k]) for k in best)


def test_resume_is_exact_across_a_rollback(tmp_path):
    common = ["guard.held_out.policy=rollback", "guard.held_out.max_rollbacks=3", "train.checkpoint_every=1"]
    full = smoke_run(tmp_path / "full", "train.epochs=5", *common)
    smoke_run(tmp_path / "split", "train.epochs=2", *common)
    split = smoke_run(tmp_path / "split", "train.epochs=5", "train.resume=latest", *common)
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]  # noqa: E731
    assert strip(split) == strip(full)
    # The split run resumed from the checkpoint written right after the rollback (epoch 1): restored weights, the
    # lowered LR in the optimizer and the scheduler, the AdamW moments and the guard's window all came back.
    assert [r["epoch"] for r in full if r.get("guard/held_out_fired") == 1.0] == [1]
    assert all(r["optim/lr"] == pytest.approx(0.005) for r in full if r["epoch"] >= 2)
    a, b = (load_file(tmp_path / run / "lora" / "pytorch_lora_weights.safetensors") for run in ("full", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


GOLD = "rewards=[{name: brightness}, {name: color_target, weight: 0}]"


@pytest.mark.parametrize("overrides, words", [
    (["guard.held_out.policy=rollback"], ["guard.held_out.policy", "guard.held_out.reward"]),
    (["guard.held_out.policy=stop"], ["guard.held_out.policy", "guard.held_out.reward"]),
    ([GOLD, "guard.held_out.reward=color_target", "guard.held_out.policy=rollback"], ["log.test_every"]),
    ([GOLD, "guard.held_out.reward=color_target", "guard.held_out.policy=stop", "log.test_every=0"],
     ["log.test_every"]),
    ([GOLD, "log.test_every=2", "guard.held_out.reward=pickscore"], ["guard.held_out.reward", "pickscore",
                                                                    "color_target"]),
    ([GOLD, "log.test_every=2", "guard.held_out.reward=color_target", "guard.held_out.policy=rollback",
      "guard.held_out.lr_factor=1"], ["guard.held_out.policy", "lr_factor"]),
    ([GOLD, "log.test_every=2", "guard.held_out.reward=color_target", "guard.held_out.policy=rollback",
      "train.beta=0", "guard.held_out.kl_factor=2"], ["guard.held_out.kl_factor", "train.beta"]),
    (["guard.held_out.margin=-1"], ["guard.held_out.margin"]),
    (["guard.held_out.patience=0"], ["guard.held_out.patience"]),
    (["guard.held_out.policy=halt"], ["guard.held_out.policy"]),
])
def test_bad_input_is_one_line_and_leaves_no_run_directory(tmp_path, capsys, overrides, words):
    run = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, f"run_dir={run}", *overrides]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("flowrl train: error: "), errors
    assert all(word in errors[0] for word in words), errors[0]
    assert not run.exists()


def test_the_metrics_table_reads_the_exported_adapters_report(tmp_path):
    # experiments/held_out_guard.yaml's columns: the kept adapter's figures come from report.json.
    from flowrl.experiments.tables.metrics import values

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "guard/held_out_rollbacks": 1.0}) + "\n")
    (tmp_path / "report.json").write_text(json.dumps({"before": {"eval/toyeval/task_mean": 0.2},
                                                      "after": {"eval/toyeval/task_mean": 0.25}, "prompts": 64}))
    found = values(tmp_path)
    assert found["report/after/eval/toyeval/task_mean"] == (0.25, 0.25)
    assert found["report/before/eval/toyeval/task_mean"] == (0.2, 0.2) and found["guard/held_out_rollbacks"] == (1, 1)
