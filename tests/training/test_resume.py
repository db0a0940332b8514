"""A run killed with SIGKILL and resumed from its last checkpoint matches an uninterrupted run, even when the kill
tore the last line of metrics.jsonl."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.training.metrics import read_metrics
from tests import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flowrl", "train", "configs/smoke/sd3_tiny.yaml", f"run_dir={run_dir}",
            "train.epochs=5", "train.checkpoint_every=1", "log.progress=false", "log.eval_every=0",
            "train.learning_rate=1e-2", "train.clip_range=0.2", *extra]


def _without_timings(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_run_despite_a_torn_metrics_line(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_command(full), cwd=REPO, env=ENV, check=True, capture_output=True, timeout=600)

    process = subprocess.Popen(_command(killed), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    pointer = killed / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (pointer.is_file() and pointer.read_text().strip() >= "step_000001"):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert pointer.is_file(), "the run never wrote a checkpoint"
    assert not (killed / "lora").exists(), "the run finished before it could be killed"
    with (killed / "metrics.jsonl").open("a") as metrics:  # what a kill in the middle of an append leaves
        metrics.write('{"step": 4, "epoch": 4, "reward/bright')

    resumed = subprocess.run(_command(killed, "train.resume=latest"), cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ends in a partial line" in resumed.stderr and "dropped it" in resumed.stderr
    assert _without_timings(read_metrics(killed)) == _without_timings(read_metrics(full))
    final_full = load_file(full / "lora" / "pytorch_lora_weights.safetensors")
    final_killed = load_file(killed / "lora" / "pytorch_lora_weights.safetensors")
    assert final_full.keys() == final_killed.keys()
    assert all((final_full[k] == final_killed[k]).all() for k in final_full)
