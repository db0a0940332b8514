"""The run extra that trains the run's trainable rewards (:class:`flowrl.rewards_api.TrainableReward`, e.g.
Adv-GRPO's discriminator) on the policy's rollouts, says on which epochs the policy itself trains, and carries
the rewards' state through checkpoints.

Why an extra: a reward that learns is state of the run like MARBLE's weights or the guard's baseline. Updating
it at the end of the epoch (after the policy's update, before the checkpoint) means the epoch's advantages come
from one fixed reward, the rollouts it just scored train it for the next epoch, and the checkpoint holds the
updated reward, so resuming at epoch e + 1 scores exactly as the uninterrupted run. Under several processes
every process updates on the images of all of them, so their copies of the reward stay identical.

Adv-GRPO alternates (showlab/Adv-GRPO @ 8287f90, ``scripts/train_sd3_fast_dino_patch.py``: the discriminator's
step and ``continue`` past the generator's update when ``(epoch + 1) % d_times != 0``): on an epoch a trainable
reward keeps for itself (:meth:`RewardUpdates.updates_policy` is False), the recipe still samples, scores and logs
the rollouts, then skips the policy's update: no optimizer step, no EMA step (recipe nft: the old adapter does not
follow), and the LR schedule moves past the epoch's planned ``inner_epochs * optimizer_steps_per_epoch`` steps
as past any skipped step (:func:`flowrl.training.lr.skip_scheduled_step`), so it stays a function of the epoch, as
the EMA's step index already is, and reaches its end at the run's last epoch. ``policy/updated`` (1 or 0) is logged
each epoch. The reference keeps no LR schedule; its EMA also skips those epochs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.rewards_api import TrainableReward
from flowrl.training.lr import skip_scheduled_step

if TYPE_CHECKING:
    from flowrl.recipes.run import Run


class RewardUpdates:
    """``updates_policy`` hook: whether every trainable reward lets the policy train this epoch; ``after_update``
    hook: each trainable reward's ``update`` on the epoch's rollouts where its ``updates_on(epoch)`` holds, logged
    as ``reward/<name>/<metric>``; ``state_dict`` holds every trainable reward's state by name."""

    def __init__(self, rewards: dict[str, TrainableReward]):
        self.rewards = rewards

    def updates_policy(self, epoch: int) -> bool:
        """Whether the policy trains on epoch ``epoch``: only where every trainable reward's schedule says so."""
        return all(reward.policy_updates_on(epoch) for reward in self.rewards.values())

    def after_update(self, run: Run, epoch: int, traj, stats=None) -> dict[str, float]:
        metrics = {"policy/updated": float(self.updates_policy(epoch))}
        if not self.updates_policy(epoch):  # the schedule's steps this epoch would have taken
            t = run.cfg.train
            for _ in range(t.inner_epochs * t.optimizer_steps_per_epoch):
                skip_scheduled_step(run.extras["lr_scheduler"])
        due = {name: r for name, r in self.rewards.items() if r.updates_on(epoch)}
        if not due or traj.images is None:
            return metrics
        shards = run.shards  # every row once: a context group's processes hold the same rows
        images, prompts, metadata = traj.images, list(traj.row_prompts), list(traj.row_metadata)
        if run.accelerator.num_processes > 1:
            images = shards.gather(images.to(shards.device)).cpu()  # [N_all, 3, H, W]
            prompts, metadata = shards.gather_object(prompts), shards.gather_object(metadata)
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
