"""Rewards that report, in their scores, how the reward service called them (tests/rewards/test_reward_service.py).

They run inside Ray Serve replicas, which import them by dotted path (``tests.rewards.service_probes:GroupProbe``),
so what they saw comes back over HTTP rather than through shared state."""

import torch


class GroupProbe:
    """A group-wise reward: every row of a call scores the call's row count, and ``group_probe/prompts`` the number
    of distinct prompts the call held."""

    name = "group_probe"
    scores_groups = True

    def __call__(self, images, prompts, metadata):
        n = images.shape[0]
        return {self.name: torch.full((n,), float(n)), f"{self.name}/prompts": torch.full((n,), float(len(set(prompts))))}
