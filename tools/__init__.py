"""Entry points run from the repository root as ``python -m tools.NAME``: they need the checkout, not only the
installed package (the test oracles and helpers under ``tests/``, the configs), so they are neither part of
flowrl nor loose scripts that would need a ``sys.path`` insert to find those.

- ``tools.d2align_fit``: fit D²-Align's shared reward direction (``experiments/collapse.yaml`` runs it first).
- ``tools.check_lora_compat``: does each exported LoRA file load at the trained scale in each loader.
- ``tools.toy_four_prompts``: train on the four prompts of ``tests/toy/test_toy_rl.py``, count fixed and broken images.
"""
