"""Run logging: metrics.jsonl always, tensorboard or wandb when chosen, rank 0 only.

Metric names are namespaced (``reward/*``, ``loss/*``, ``policy/*``, ``perf/*``, ``optim/*``) and
values are plain floats, one JSON object per epoch, so a run can be plotted with a few lines of
pandas or matplotlib and compared across tools.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)


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
        """Drop records past ``step`` (a resumed run rewrites the epochs it is about to redo), and a partial last
        line that a kill during an append left (with a warning: that epoch is redone anyway)."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [line for line, record in _records(self.path, warn=True) if record.get("step", -1) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``; a partial last line (a run killed mid-append) is skipped."""
    return [record for _, record in _records(Path(run_dir) / "metrics.jsonl")]


def _records(path: Path, *, warn: bool = False) -> list[tuple[str, dict]]:
    """(line, record) per line. Only the last line may be torn; a bad line before it is a ValueError naming it."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            if number == len(lines):
                if warn:
                    logger.warning("flowrl train: warning: %s ends in a partial line (a run killed while logging); dropped it: %s",
                                   path, line[:80])
                break
            raise ValueError(f"{path}:{number} is not a metrics record ({error}); the file was edited or damaged: "
                             "delete that line, or start a new run_dir") from None
        records.append((line, record))
    return records


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value
