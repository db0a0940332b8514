"""One module per table kind, named by an experiment file's ``table:`` key; each has ``make(experiment)``,
which trains the experiment's runs (or lists them, for a dry run), reads their directories and writes the
table into the results file, returning its text.
"""

from flowrl.experiments.tables import algorithms, collapse, front, guard, metrics, multi_reward

TABLES = {"algorithms": algorithms.make, "multi_reward": multi_reward.make, "collapse": collapse.make,
          "guard": guard.make, "metrics": metrics.make, "front": front.make}
