"""A table read straight from each run's metrics log: one row per run, one column per entry of ``columns``
(``{header, key, at: first | last | change, format}``), each cell the mean ± s.e. over seeds. The end-of-run
report's figures are columns too: ``report/before/<key>`` and ``report/after/<key>`` read ``report.json``
(``after``: the adapter the run exported, e.g. a guard's kept snapshot).

Why: the simplest comparison (train some configs, read one metric before and after) needs no Python of its
own; its columns are data in the experiment file.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.experiments.cells import CELL_NOTE, fmt_mean_se
from flowrl.experiments.markdown import replace_section, table_head
from flowrl.experiments.spec import Experiment, ExperimentError
from flowrl.training.metrics import read_metrics

AT = ("first", "last", "change")


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS = frozenset({"columns", "title"})


def values(run_dir: Path) -> dict[str, tuple[float, float]]:
    """{metric: (first value, last value)} over the run's metrics log, plus ``report/<before|after>/<key>`` from
    its ``report.json`` (one value: first = last)."""
    found: dict[str, tuple[float, float]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if isinstance(value, (int, float)):
                found[key] = (found[key][0] if key in found else value, value)
    report = Path(run_dir) / "report.json"
    if report.is_file():
        results = json.loads(report.read_text())
        for side in ("before", "after"):
            found.update({f"report/{side}/{key}": (value, value) for key, value in results.get(side, {}).items()
                          if isinstance(value, (int, float))})
    return found


def cell(per_seed: dict[int, dict], column: dict) -> str:
    first_last = [run.get(column["key"]) for run in per_seed.values()]
    pick = {"first": lambda fl: fl[0], "last": lambda fl: fl[1], "change": lambda fl: fl[1] - fl[0]}[column["at"]]
    spec = column.get("format", "+.3f" if column["at"] == "change" else ".3f")
    return fmt_mean_se((None if fl is None else pick(fl) for fl in first_last), spec)


def make(exp: Experiment) -> str | None:
    p = exp.params
    columns = p.get("columns") or []
    for column in columns:
        if not isinstance(column, dict) or "key" not in column or column.get("at", "last") not in AT:
            raise ExperimentError(f"{exp.path}: each column must be {{header, key, at: first | last | change}}")
        column.setdefault("at", "last")
        column.setdefault("header", column["key"])
    found = exp.results(values)
    if found is None:
        return None
    title = f"## {p['section'] or p.get('title', exp.path.stem)}"
    header = ["run", "seeds", *(c["header"] for c in columns)]
    lines = table_head(title, exp.command, CELL_NOTE, header)
    for name, per_seed in found.items():
        lines.append(f"| {name} | {','.join(map(str, per_seed))} | " + " | ".join(cell(per_seed, c) for c in columns)
                     + " |")
    text = "\n".join(lines + [""])
    replace_section(Path(p["results"]), text, title)
    return text
