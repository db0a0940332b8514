"""Checkpoints: exact round trip (LoRA, optimizer, EMA, RNG), atomic saves, pruning, resume errors."""

import errno
import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from peft.utils import set_peft_model_state_dict
from safetensors import SafetensorError

from flowrl.config import Config, GRPOConfig, load_config
from flowrl.models import build_policy
from flowrl.models.lora_io import lora_config_dict, lora_state_dict
from flowrl.core.safe_io import check_checkpoint
from flowrl.training import checkpoint as ckpt
from flowrl.training.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from flowrl.training.ema import LoraEMA
from flowrl.training.faults import TrainingAborted


def _trainer(init_seed):
    policy = build_policy("sd3", "tiny")
    policy.add_lora(rank=4, alpha=8, init_seed=init_seed)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    ema = LoraEMA(policy.named_trainable_parameters(), decay=0.5)
    return policy, optimizer, ema


def _train_step(policy, optimizer, ema):
    loss = sum(((p - 0.1) ** 2).sum() * (i + 1) for i, p in enumerate(policy.trainable_parameters()))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ema.step()


def _draws():
    return torch.rand(4), random.random(), np.random.rand(3)


def _save(policy, optimizer, ema, run_dir, step, **kwargs):
    return save_checkpoint(run_dir, step, lora_state=lora_state_dict(policy.transformer),
                           lora_config=lora_config_dict(policy.transformer), optimizer=optimizer, ema=ema,
                           trainer_state={"epoch": step}, config=GRPOConfig(), **kwargs)


def test_round_trip_restores_lora_optimizer_ema_and_rng(tmp_path):
    policy, optimizer, ema = _trainer(init_seed=0)
    for _ in range(3):
        _train_step(policy, optimizer, ema)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    path = _save(policy, optimizer, ema, tmp_path, 3)
    expected_draws = _draws()

    assert path == tmp_path / "checkpoints" / "step_000003"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"
    for name in ("lora.safetensors", "ema.safetensors", "optimizer.pt", "rng_rank0.pt", "trainer_state.json",
                 "config.yaml"):
        assert (path / name).is_file(), name
    torch.load(path / "rng_rank0.pt", weights_only=True)  # no pickled objects
    assert load_config(Config, path / "config.yaml") == GRPOConfig()  # recipe grpo: the default

    fresh, fresh_optimizer, fresh_ema = _trainer(init_seed=1)
    _draws()  # move the RNG on, so equality below proves the restore
    lora_state, trainer_state = load_checkpoint(tmp_path, resume="latest", optimizer=fresh_optimizer, ema=fresh_ema)
    restored_draws = _draws()
    set_peft_model_state_dict(fresh.transformer, lora_state)

    assert trainer_state["epoch"] == 3 and trainer_state["step"] == 3
    for got, want in zip(restored_draws, expected_draws):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    want_lora, got_lora = lora_state_dict(policy.transformer), lora_state_dict(fresh.transformer)
    assert want_lora.keys() == got_lora.keys() and all(torch.equal(want_lora[k], got_lora[k]) for k in want_lora)
    assert ema.state_tensors().keys() == want_lora.keys()
    assert all(torch.equal(ema.state_tensors()[k], fresh_ema.state_tensors()[k]) for k in want_lora)
    assert fresh_ema.state_dict() == ema.state_dict() and fresh_ema.optimization_step == 3
    want_opt, got_opt = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want_opt["param_groups"] == got_opt["param_groups"]
    for index, state in want_opt["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], got_opt["state"][index][key]), key

    # Continuing from the checkpoint matches continuing the original run bit for bit.
    _train_step(policy, optimizer, ema)
    _train_step(fresh, fresh_optimizer, fresh_ema)
    for a, b in zip(policy.trainable_parameters(), fresh.trainable_parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(ema.state_tensors()[k], fresh_ema.state_tensors()[k]) for k in want_lora)


def test_ema_decay_and_swap():
    weight = torch.nn.Parameter(torch.zeros(2))
    ema = LoraEMA([("m.lora_A.default.weight", weight)], decay=0.5)
    values = []
    for value in (1.0, 2.0, 3.0):
        weight.data.fill_(value)
        ema.step()
        values.append(float(ema.state_tensors()["m.lora_A.weight"][0]))
    assert values == [1.0, 1.5, 2.25]  # the first update copies (diffusers), then constant decay 0.5
    with ema.swapped_in():
        assert torch.equal(weight.data, torch.full((2,), 2.25))
    assert torch.equal(weight.data, torch.full((2,), 3.0))


def _small(run_dir, step, **kwargs):
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    state = {"m.lora_A.weight": torch.full((2, 2), float(step)), "m.lora_B.weight": torch.zeros(2, 2)}
    return save_checkpoint(run_dir, step, lora_state=state, lora_config={"r": 2, "lora_alpha": 2},
                           optimizer=optimizer, trainer_state={"epoch": step}, config={"seed": 0}, **kwargs)


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 320 vs 258"  # torch's zip writer


def _failing(monkeypatch, kind):
    """Make writing step 2's optimizer.pt (torch) or lora.safetensors (safetensors) fail as a full disk does."""
    real_torch_save, real_save_file = torch.save, ckpt.save_file

    def torch_save(obj, f, *args, **kwargs):
        if "step_000002" in str(f) and str(f).endswith("optimizer.pt"):
            raise {"torch": RuntimeError(TORCH_FULL_DISK), "interrupt": KeyboardInterrupt()}[kind]
        return real_torch_save(obj, f, *args, **kwargs)

    def save_file(tensors, filename, *args, **kwargs):
        if "step_000002" in filename and filename.endswith("lora.safetensors"):
            Path(filename).write_bytes(b"half a file")
            raise {"safetensors": SafetensorError("Error while serializing: I/O error: No space left on device "
                                                  "(os error 28)"),
                   "oserror": OSError(errno.ENOSPC, "No space left on device", filename)}[kind]
        return real_save_file(tensors, filename, *args, **kwargs)

    if kind in ("torch", "interrupt"):
        monkeypatch.setattr(ckpt.torch, "save", torch_save)
    else:
        monkeypatch.setattr(ckpt, "save_file", save_file)


@pytest.mark.parametrize("kind, reason", [("torch", f"RuntimeError: {TORCH_FULL_DISK}"),
                                          ("safetensors", "SafetensorError: Error while serializing"),
                                          ("oserror", "No space left on device (")])
def test_any_failed_write_stops_in_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch, kind, reason):
    _small(tmp_path, 1)
    root = tmp_path / "checkpoints"
    size = sum(f.stat().st_size for f in (root / "step_000001").iterdir())
    _failing(monkeypatch, kind)
    with pytest.raises(TrainingAborted) as stop:
        _small(tmp_path, 2)
    monkeypatch.undo()
    message = str(stop.value)
    assert "\n" not in message and reason in message, message
    assert f"a checkpoint needs about {size / 1024:.1f} KiB free and " in message and " is free now" in message
    assert f"the last checkpoint, {root / 'step_000001'}, is intact" in message and "train.resume=latest" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no .tmp_step_000002 left
    assert (root / "latest").read_text().strip() == "step_000001"
    assert resolve_checkpoint(tmp_path) == root / "step_000001"
    check_checkpoint(root / "step_000001")


def test_a_failed_first_write_estimates_the_space_from_the_state(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise RuntimeError(TORCH_FULL_DISK)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(TrainingAborted, match="needs about 32 B free .*; no earlier checkpoint exists"):
        _small(tmp_path, 2)  # 2 float32 tensors of 2x2: 32 bytes, the optimizer has no state yet
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


def test_an_interrupted_save_is_not_a_write_failure_and_the_next_save_cleans_it(tmp_path, monkeypatch):
    _small(tmp_path, 1)
    _failing(monkeypatch, "interrupt")
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C mid-save propagates as it is
        _small(tmp_path, 2)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert not (root / "step_000002").exists()
    assert (root / ".tmp_step_000002" / "lora.safetensors").is_file()  # the half-written save, hidden
    assert (root / "latest").read_text().strip() == "step_000001"
    assert resolve_checkpoint(tmp_path) == root / "step_000001"

    _small(tmp_path, 3)
    assert not list(root.glob(".tmp_*"))
    assert resolve_checkpoint(tmp_path) == root / "step_000003"


def test_keep_last_prunes_oldest(tmp_path):
    for step in range(1, 6):
        _small(tmp_path, step, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    for step in range(6, 9):
        _small(tmp_path, step, keep_last=None)
    assert len(ckpt.list_checkpoints(tmp_path)) == 5
    state, trainer_state = load_checkpoint(tmp_path, resume=str(tmp_path / "checkpoints" / "step_000006"))
    assert trainer_state["epoch"] == 6 and float(state["m.lora_A.weight"][0, 0]) == 6.0
    assert json.loads((tmp_path / "checkpoints" / "step_000008" / "trainer_state.json").read_text())["step"] == 8


def test_every_rank_writes_its_rng(tmp_path):
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def rank(r):
        try:
            results[r] = _small(tmp_path, 7, rank=r, world_size=2, barrier=barrier.wait)
        except Exception as error:  # pragma: no cover - surfaced below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert not errors and results[0] == results[1]
    assert {p.name for p in results[0].glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert load_checkpoint(tmp_path, rank=1)[1]["world_size"] == 2


def test_resume_without_checkpoint_is_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_checkpoint(tmp_path, resume="latest")
    message = str(error.value)
    assert message == f"no checkpoint to resume in {tmp_path / 'checkpoints'} (start without resume=...)"
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        resolve_checkpoint(tmp_path, tmp_path / "nope")
