"""One module per table kind, named by an experiment file's ``table:`` key; each has ``make(experiment)``,
which trains the experiment's runs (or lists them, for a dry run), reads their directories and writes the
table into the results file, returning its text.
"""

from flowrl.experiments.tables import algorithms, collapse, front, guard, metrics, multi_reward

import difflib
import re

from flowrl.experiments.spec import DEFAULTS, ExperimentError

TABLES = {"algorithms": algorithms.make, "multi_reward": multi_reward.make, "collapse": collapse.make,
          "guard": guard.make, "metrics": metrics.make, "front": front.make}
TABLE_KEYS = {"algorithms": algorithms.FILE_KEYS, "multi_reward": multi_reward.FILE_KEYS,
              "collapse": collapse.FILE_KEYS, "guard": guard.FILE_KEYS, "metrics": metrics.FILE_KEYS,
              "front": front.FILE_KEYS}
# What every table reads: the runner's keys and the budgeted cells' (flowrl.experiments.cells).
COMMON_KEYS = frozenset({*DEFAULTS, "out", "budget_s", "epochs", "images", "test_prompts"})


def check_keys(experiment) -> None:
    """Every key of the experiment file is one its table reads, or one its runs or settings name as ``${key}``; an
    unknown key (a typo) is one line naming it and the closest known one, not silently ignored."""
    texts = [run.config for run in experiment.runs.values()] + [o for run in experiment.runs.values()
                                                                 for o in run.overrides]
    texts += [str(s) for s in experiment.params.get("settings") or []]
    referenced = {name for text in texts for name in re.findall(r"\$\{([A-Za-z_]+)\}", text)}
    known = COMMON_KEYS | TABLE_KEYS[experiment.table] | referenced
    for key in experiment.params:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ExperimentError(f"{experiment.path}: unknown key {key!r} for a {experiment.table} table"
                                  + (f"; did you mean {close[0]!r}?" if close else f" (keys: {', '.join(sorted(known))})"))
