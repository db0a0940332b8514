"""Run logging: metrics.jsonl always, tensorboard or wandb when chosen, rank 0 only.

Metric names are namespaced (``reward/*``, ``loss/*``, ``policy/*``, ``perf/*``, ``optim/*``) and
values are plain floats, one JSON object per epoch, so a run can be plotted with a few lines of
pandas or matplotlib and compared across tools.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tracker=None):
        """``tracker``: an object with ``log(dict, step=int)`` (e.g. an ``accelerate.Accelerator``
        after ``init_trackers``), or None for JSONL only."""
        self.enabled = enabled
        self.tracker = tracker
        self.path = Path(run_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites the epochs it is about to redo)."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value
