"""A run killed with SIGKILL and resumed from its last checkpoint matches an uninterrupted run, even when the kill
tore the last line of metrics.jsonl."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.training.metrics import read_metrics
from tests import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _arguments(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "configs/smoke/sd3_tiny.yaml", f"run_dir={run_dir}", "train.epochs=5", "train.checkpoint_every=1",
            "log.progress=false", "log.eval_every=0", "train.learning_rate=1e-2", "train.clip_range=0.2", *extra]


def _without_timings(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_run_despite_a_torn_metrics_line(tmp_path, caplog):
    """Only the killed run is a process of its own; the uninterrupted run and the resume run in this one."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(_arguments(full)) == 0

    process = subprocess.Popen([sys.executable, "-m", "flowrl", *_arguments(killed)], cwd=REPO, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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

    with caplog.at_level(logging.WARNING):
        assert main(_arguments(killed, "train.resume=latest")) == 0
    assert "ends in a partial line" in caplog.text and "dropped it" in caplog.text, caplog.text[-2000:]
    assert _without_timings(read_metrics(killed)) == _without_timings(read_metrics(full))
    final_full = load_file(full / "lora" / "pytorch_lora_weights.safetensors")
    final_killed = load_file(killed / "lora" / "pytorch_lora_weights.safetensors")
    assert final_full.keys() == final_killed.keys()
    assert all((final_full[k] == final_killed[k]).all() for k in final_full)
