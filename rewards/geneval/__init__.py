"""GenEval's object-focused judge (Ghosh et al. 2023) in process: detector rules, models and the reward."""

from rewards.geneval.reward import GenEval

__all__ = ["GenEval"]
