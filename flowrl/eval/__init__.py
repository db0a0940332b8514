"""Evaluation: diversity and distribution metrics, benchmark suites, the eval command, held-out samples and
scores (``held_out``), and the reports of both ``flowrl eval`` and ``flowrl train`` (``report``).

The package imports nothing on purpose: each module (``metrics``, ``features``, ``suites``, ...) is imported
by name, so using one does not pull in the heavy dependencies of another."""
