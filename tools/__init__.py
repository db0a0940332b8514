"""Maintained entry points run from the repository root as ``python -m tools.NAME``: checks, table generators and
data makers that need the checkout, not only the installed package (the configs, the experiments, the assets), so
they are neither part of flowrl nor loose scripts that would need a ``sys.path`` insert to find each other.
One-off measurements and benchmarks live in ``scripts/`` instead.

- ``tools.d2align_fit``: fit D²-Align's shared reward direction (``experiments/collapse.yaml`` runs it first).
- ``tools.toy_artifacts``: the toy world's clean and corrupted renders for ``flowrl fit-reward``.
- ``tools.check_lora_compat``: does each exported LoRA file load at the trained scale in each loader.
- ``tools.family_parity``: the largest difference between flowrl's ODE rollout and each family's own pipeline.
- ``tools.render_report``: render a ``flowrl eval`` report.html in headless Chromium and check what it shows.
- ``tools.provenance_table``: the provenance tables of ``configs/README.md``.
- ``tools.toy_short_rl``: train on the eight counting prompts of ``tests/toy/test_toy_rl.py`` (or another set), count fixed and broken images.
- ``tools.behaviour_fingerprint``: a fingerprint of what flowrl computes, to compare before and after a refactor.

Shared by these tools and by the tests, so kept here (tools never import ``tests``; tests import these):
``tools.comfyui_reference`` (ComfyUI's and kohya's LoRA loading, re-implemented), ``tools.policy_capture`` (keep
the policy a recipe builds) and ``tools.toy_runs`` (short toy-world training on a few prompts).
"""
