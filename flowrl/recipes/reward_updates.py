"""The run extra that trains the run's trainable rewards (:class:`flowrl.rewards_api.TrainableReward`, e.g.
Adv-GRPO's discriminator) on the policy's rollouts, and carries their state through checkpoints.

Why an extra: a reward that learns is state of the run like MARBLE's weights or the guard's baseline. Updating
it at the end of the epoch (after the policy's update, before the checkpoint) means the epoch's advantages come
from one fixed reward, the rollouts it just scored train it for the next epoch, and the checkpoint holds the
updated reward, so resuming at epoch e + 1 scores exactly as the uninterrupted run. Under several processes
every process updates on the images of all of them, so their copies of the reward stay identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelerate.utils import gather_object

from flowrl.rewards_api import TrainableReward

if TYPE_CHECKING:
    from flowrl.recipes.run import Run


class RewardUpdates:
    """``after_update`` hook: each trainable reward's ``update`` on the epoch's rollouts every ``update_every``
    epochs (epochs ``update_every - 1``, ``2 update_every - 1``, ...), logged as ``reward/<name>/<metric>``;
    ``state_dict`` holds every trainable reward's state by name."""

    def __init__(self, rewards: dict[str, TrainableReward]):
        self.rewards = rewards

    def after_update(self, run: Run, epoch: int, traj, stats=None) -> dict[str, float]:
        due = {name: r for name, r in self.rewards.items() if (epoch + 1) % r.update_every == 0}
        if not due or traj.images is None:
            return {}
        accelerator = run.accelerator
        images, prompts, metadata = traj.images, list(traj.row_prompts), list(traj.row_metadata)
        if accelerator.num_processes > 1:
            images = accelerator.gather(images.to(accelerator.device)).cpu()  # [N_all, 3, H, W]
            prompts, metadata = gather_object(prompts), gather_object(metadata)
        metrics: dict[str, float] = {}
        for name, reward in due.items():
            metrics.update({f"reward/{name}/{key}": value for key, value in reward.update(images, prompts,
                                                                                           metadata).items()})
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {name: reward.state_dict() for name, reward in self.rewards.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, reward in self.rewards.items():
            if name in state:
                reward.load_state_dict(state[name])
