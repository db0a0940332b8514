"""Training-loop support that is not an algorithm: the LoRA EMA, atomic checkpoints, run metrics.

Recipes (``flowrl.recipes``) call into these modules; nothing here knows about rewards or losses.
"""
