"""Experiments as data: each table of ``docs/results.md`` is made by one ``experiments/<table>.yaml`` through
one runner, ``python -m flowrl.experiments experiments/<table>.yaml``.

Why a package layer of its own: the comparisons must agree on what a finished run is, on how seeds name run
directories and on how a cell over seeds reads, and a table is only reproducible when the runs behind it are
written down as data (config, overrides, seeds, budget) rather than spread over scripts. The layer sits beside
the command line: it trains through ``python -m flowrl train`` in subprocesses and reads the run directories,
so it imports only the config (to validate runs) and the metrics log below it.

- :mod:`.spec`: an experiment file -> :class:`~flowrl.experiments.spec.Experiment` (runs, seeds, settings).
- :mod:`.runs`: run directories: finished (``done.json``), resumed or restarted, trained ``--parallel`` at a time.
- :mod:`.cells`: a table cell over seeds, ``mean ± s.e. (n)``.
- :mod:`.markdown`: a section of the results file replaced in place.
- :mod:`.tables`: one module per table kind (the ``table:`` key of an experiment file).
- :mod:`.cli`: the runner's command line.
"""
