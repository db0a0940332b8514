"""The diversity guard: notice preference mode collapse while a run trains, and act before it is complete.

Why: RL on a reward that prefers one look (the toy proxy's black background) narrows what each
prompt's samples look like while the reward still rises, and held-out diversity is measured only at the
end. Every epoch already holds groups of rollouts of one prompt each, so their in-group mean pairwise
cosine distance (GARDO's diversity, :func:`flowrl.eval.metrics.pairwise_cosine_distance`, in a
``flowrl.algorithms.gardo`` feature space) is a collapse signal that costs no extra sampling.

Choices:
- measured at the run's first ``warmup`` epochs, whose mean is the start value (one epoch's batch is a
  noisy estimate and the first updates barely move the policy), then every ``every``-th epoch; every
  process measures its own groups and the mean over all groups is reduced across processes;
- ``drop = (start - now) / start``; past ``max_drop`` (never during the warmup) the guard fires, at most
  once per ``cooldown`` epochs: ``warn`` writes one line, ``raise_beta`` multiplies the live KL beta by
  ``beta_factor`` (a beta of 0 becomes ``beta_floor``), ``stop`` ends the run after the epoch;
- under ``stop`` each measurement scores ``reward + diversity_weight * diversity`` and the best one's
  exported weights (EMA when kept, as the export) are kept as the ``guard_best`` checkpoint snapshot (an
  :class:`~flowrl.training.ema.AdapterSnapshot`); a stopped run exports and reports those instead of its last weights.

The state (start measurements, last firing, live beta, best score and epoch) is JSON and rides in the
checkpoint's trainer state. Run: ``flowrl train configs/toy/grpo_proxy.yaml guard.enabled=true
guard.policy=stop``; ``python -m flowrl.experiments experiments/guard.yaml`` measures it against an unguarded run.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from flowrl.eval.metrics import pairwise_cosine_distance
from flowrl.training.ema import AdapterSnapshot, ema_weights


def in_group_diversity(features: torch.Tensor, group_ids: torch.Tensor, accelerator=None) -> float:
    """Mean over groups of the in-group mean pairwise cosine distance of ``features`` [N, D] (groups
    ``group_ids`` [N]); with ``accelerator``, over every process's groups. NaN when no group has two rows."""
    features, group_ids = features.float().flatten(1).cpu(), group_ids.cpu()  # [N, D], [N]
    directed = features.norm(dim=1) > 0  # a zero vector (a black image's pixels) has no cosine: left out
    per_group = pairwise_cosine_distance(features[directed], group_ids[directed])  # [G]
    finite = per_group[torch.isfinite(per_group)].double()
    totals = torch.stack([finite.sum(), torch.tensor(float(finite.numel()), dtype=torch.float64)])  # [2]
    if accelerator is not None:
        totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu()
    return float(totals[0] / totals[1]) if totals[1] > 0 else math.nan


def finite_mean(values: torch.Tensor) -> float:
    """Mean of the finite entries (``reward/combined_mean``'s rule); NaN when there are none."""
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if finite.numel() else math.nan


def relative_drop(start: float, current: float) -> float:
    """Fractional fall of ``current`` below ``start`` (negative when above; 0 for a start of 0 or NaN)."""
    return (start - current) / start if start > 0 else 0.0


def raised_beta(beta: float, factor: float, floor: float) -> float:
    """The KL beta after one firing of ``raise_beta``: ``beta * factor``, or ``floor`` for a beta of 0."""
    return beta * factor if beta > 0 else floor


def guard_score(reward: float, diversity: float, weight: float) -> float:
    """The best-weights criterion: mean trained reward of the epoch plus ``weight`` times its diversity."""
    return reward + weight * diversity


def exported_weights(policy, ema) -> dict[str, torch.Tensor]:
    """CPU float32 copies of what the final export writes now: the EMA weights when kept, else the live ones."""
    with ema_weights(ema):  # trained_state copies, so the EMA weights outlive the swap
        return policy.trained_state()


def restore_weights(policy, ema, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` (``lora_state_dict`` keys) into the live LoRA and the EMA, so export and report use them."""
    policy.load_trained_state(tensors)
    if ema is not None:
        ema.load_state_tensors(tensors)


class DiversityGuard:
    """The guard's decisions and state; the recipe measures, calls :meth:`observe` and reads :attr:`beta`
    and :attr:`stopped`. A run carries it as one of its extras (:class:`flowrl.recipes.run.Run`): its state rides
    in the trainer state, ``best`` is the ``guard_best`` snapshot, :attr:`kl_beta` is the run's live KL beta and
    :meth:`finish` puts the best weights back when the guard stopped the run.

    ``best``: the :class:`~flowrl.training.ema.AdapterSnapshot` that keeps the best-scoring exported weights
    (policy stop); None keeps none."""

    def __init__(self, *, every: int, warmup: int, max_drop: float, policy: str, beta: float, beta_factor: float,
                 beta_floor: float, cooldown: int, diversity_weight: float,
                 write: Callable[[str], None] | None = None, best: AdapterSnapshot | None = None,
                 features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.every, self.warmup, self.max_drop, self.policy = every, warmup, max_drop, policy
        self.beta_factor, self.beta_floor, self.cooldown = beta_factor, beta_floor, cooldown
        self.diversity_weight = diversity_weight
        self.write = write or (lambda line: None)
        self.beta = beta  # the KL beta in force (raise_beta moves it)
        self.starts: list[float] = []  # the warmup measurements
        self.fired_epoch: int | None = None  # the last epoch the guard fired
        self.stopped = False
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self.best = best  # policy stop: the exported weights of the best-scoring measurement
        self.features = features  # (images, latents) -> [N, D], what the run's hook measures diversity on

    @property
    def start(self) -> float:
        return sum(self.starts) / len(self.starts) if self.starts else math.nan

    def due(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` is measured: every epoch until the warmup is full, then every ``every``-th."""
        return len(self.starts) < self.warmup or epoch % self.every == 0

    def after_scoring(self, run, epoch: int, traj, combined: torch.Tensor) -> dict[str, float]:
        """The run's hook once epoch ``epoch``'s rollouts are scored: where due, their in-group diversity on
        :attr:`features` and the mean trained reward of ``combined`` [N_all] go to :meth:`observe`, which may raise
        the KL beta of this epoch's update or stop the run after it."""
        if self.features is None or not self.due(epoch):
            return {}
        diversity = in_group_diversity(self.features(traj.images, traj.final_latents), traj.group_ids,
                                       run.shards)
        return self.observe(epoch, diversity, reward=finite_mean(combined),
                            weights=lambda: exported_weights(run.policy, run.exported_ema))

    def observe(self, epoch: int, diversity: float, *, reward: float,
                weights: Callable[[], dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """Take epoch ``epoch``'s measurement (``diversity``, the mean trained ``reward``), act on it, and return
        the ``diversity/*`` metrics to log; ``weights()`` gives the exported weights when they score best."""
        warming = len(self.starts) < self.warmup
        if warming and math.isfinite(diversity):
            self.starts.append(diversity)
        drop = relative_drop(self.start, diversity)
        cooled = self.fired_epoch is None or epoch - self.fired_epoch >= self.cooldown
        fired = not warming and math.isfinite(diversity) and drop > self.max_drop and cooled and not self.stopped
        metrics = {"diversity/cosine": diversity, "diversity/start": self.start, "diversity/drop": drop,
                   "diversity/guard_fired": float(fired)}
        if self.policy == "stop":
            score = guard_score(reward, diversity, self.diversity_weight)
            if math.isfinite(score) and (self.best_score is None or score > self.best_score):
                self.best_score, self.best_epoch = score, epoch
                if weights is not None and self.best is not None:
                    self.best.load_state_tensors(weights())
            metrics["diversity/score"] = score
            metrics["diversity/best_epoch"] = float(self.best_epoch if self.best_epoch is not None else -1)
        if fired:
            self.fired_epoch = epoch
            self.write(self.message(epoch, diversity, drop))
        if fired and self.policy == "raise_beta":
            self.beta = raised_beta(self.beta, self.beta_factor, self.beta_floor)
        if fired and self.policy == "stop":
            self.stopped = True
        if self.policy == "raise_beta":
            metrics["diversity/beta"] = self.beta  # in force for this epoch's update
        return metrics

    def message(self, epoch: int, diversity: float, drop: float) -> str:
        """The one line written when the guard fires (before it acts)."""
        head = (f"diversity guard: epoch {epoch}: in-group diversity {diversity:.4f} is {drop:.0%} below its start "
                f"{self.start:.4f} (guard.max_drop={self.max_drop})")
        if self.policy == "raise_beta":
            raised = raised_beta(self.beta, self.beta_factor, self.beta_floor)
            return f"{head}: raising the KL beta {self.beta:g} -> {raised:g}"
        if self.policy == "stop":
            return (f"{head}: stopping after this epoch; RUN_DIR/lora and the report get epoch {self.best_epoch}'s "
                    f"weights (best reward + {self.diversity_weight:g} x diversity)")
        return (f"{head}: the samples of each prompt are collapsing onto one mode; raise train.beta, turn on "
                "gardo.diversity, or rerun with guard.policy=raise_beta or stop")

    @property
    def kl_beta(self) -> float:
        """The KL beta in force: train.beta, or what ``raise_beta`` raised it to."""
        return self.beta

    keeps_records = True  # guard_best records the best point: a rollback leaves it as it is

    def snapshots(self) -> dict[str, AdapterSnapshot]:
        return {} if self.best is None else {"guard_best": self.best}

    def finish(self, run) -> None:
        """A stopped run exports and reports the best reward-diversity weights, not its last ones."""
        if self.stopped and self.best is not None and self.best.taken:
            restore_weights(run.policy, run.exported_ema, self.best.state_tensors())

    def state_dict(self) -> dict:
        """JSON-safe state for the checkpoint (the best weights are saved as the ``guard_best`` snapshot)."""
        return {"starts": list(self.starts), "fired_epoch": self.fired_epoch, "beta": self.beta,
                "stopped": self.stopped, "best_score": self.best_score, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.starts = [float(v) for v in state["starts"]]
        self.fired_epoch, self.beta, self.stopped = state["fired_epoch"], float(state["beta"]), bool(state["stopped"])
        self.best_score, self.best_epoch = state["best_score"], state["best_epoch"]
