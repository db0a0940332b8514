"""Evaluation: diversity and distribution metrics, benchmark suites, the eval command and its HTML report,
and the end-of-run report of ``flowrl train`` (``run_report``).

The package imports nothing on purpose: each module (``metrics``, ``features``, ``suites``, ...) is imported
by name, so using one does not pull in the heavy dependencies of another."""
