"""Online DPO's moving reference as a run extra of recipe nft (``nft.dpo_ref_update_every``).

DPO scores each pair against a reference model. By default it is the base model (the adapter off) for the whole
run, as in Flow-GRPO's and Flow-Factory's DPO. Flow-GRPO's online variant copies the trained adapter into its
reference every ``ref_update_step`` optimizer steps (yifan123/flow_grpo ``scripts/train_sd3_dpo.py`` at ac4c86e:
``copy_learner_to_ref`` L134-139, called at L614-615 before each epoch's sampling; ``config/dpo.py`` L47-48 calls
a small value "OnlineDPO"): the loss then measures each update against the policy of a few epochs ago, not the
base model, so the preference margin does not keep growing against a fixed point. Here the count is in epochs: at
the end of every ``N``-th epoch the reference becomes the adapter as it ends that epoch.

The reference reaches the loss through the extras' ``kl_weights`` hook (:attr:`flowrl.recipes.run.Run.kl_reference`),
which the recipe hands to :func:`flowrl.algorithms.forward_losses.forward_process_loss`; its snapshot is saved beside
the EMA (``dpo_reference.safetensors``) and its refresh count in the trainer state, so a resumed run measures
against the same reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.recipes.extras import snapshot
from flowrl.recipes.snapshots import MovingReference
from flowrl.training.ema import AdapterSnapshot

if TYPE_CHECKING:
    from flowrl.recipes.run import Run
    from flowrl.training.stats import StatsAccumulator


class DpoReference(MovingReference):
    """DPO's reference, moved to the adapter at the end of every ``every``-th epoch (``dpo_reference.safetensors``;
    the trainer state is the refresh count)."""

    def __init__(self, snapshot: AdapterSnapshot, *, every: int):
        super().__init__(snapshot, file="dpo_reference")
        self.every = every

    def after_update(self, run: Run, epoch: int, traj, stats: StatsAccumulator) -> dict[str, float]:
        """After epoch ``epoch``'s update, at the end of every ``every``-th epoch: the reference becomes the adapter.
        Returns the refresh count, to log."""
        if (epoch + 1) % self.every == 0:
            self.move()
        return {"dpo/reference_refreshes": float(self.moves)}


def dpo_reference(run: Run) -> DpoReference | None:
    """nft.dpo_ref_update_every: DPO's reference, refreshed to the adapter every that many epochs."""
    every = run.cfg.nft.dpo_ref_update_every
    return None if every is None else DpoReference(snapshot(run), every=every)
