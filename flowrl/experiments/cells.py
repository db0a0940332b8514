"""A table cell over seeds: the mean, its standard error and the number of seeds behind it.

Why one module: every table of ``docs/results.md`` must read the same way, so a reader learns once what
``0.412 ± 0.018 (3)`` or ``120 (2/3)`` means.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

CELL_NOTE = ("Each cell: mean over seeds ± standard error (sample std / sqrt(n)) (n); a change is taken from the "
             "same seed's base point.")
"""How a table of per-seed runs reads, said once for every table."""


def budget_words(p: dict, per: str = "") -> str:
    """How a table's runs were trained and scored, from its parameters: ``budget_s`` seconds of training time, or
    else ``epochs`` epochs (``per``: e.g. " per combiner")."""
    budget = f"{p['budget_s']:.0f} s of training time" if p.get("budget_s") else f"{p['epochs']} epochs"
    return (f"{budget}{per} (2 CPU cores, {p['parallel']} runs at a time, one thread each), once per seed (column "
            f"`seeds`); held-out task means on {p['test_prompts']} prompts x {p['images']} ODE images")


def mean_se(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, standard error = sample std / sqrt(n), n) of the values that are numbers (None and NaN are
    left out); the error is NaN below two values, the mean NaN with none."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return math.nan, math.nan, 0
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return statistics.fmean(xs), se, len(xs)


def fmt_mean_se(values: Iterable[float | None], spec: str = ".3f", *, missing: str = "n/a") -> str:
    """A table cell over seeds: ``"0.412 ± 0.018 (3)"``, ``"0.412 (1)"`` with one seed. Values that are None or
    NaN (a threshold never reached) are left out of the mean and the count reads ``(2/3)``; with none, ``missing``.
    ``spec`` is a format spec such as ``".3f"``, ``"+.3f"`` or ``".0f"``."""
    values = list(values)
    mean, se, n = mean_se(values)
    if n == 0:
        return missing
    count = f"({n})" if n == len(values) else f"({n}/{len(values)})"
    if n == 1:
        return f"{mean:{spec}} {count}"
    return f"{mean:{spec}} ± {se:{spec.replace('+', '')}} {count}"
