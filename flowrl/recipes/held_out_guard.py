"""The held-out guard: notice reward hacking on the held-out curve, and warn, stop or roll back.

Why: a run's trained reward can keep rising while what it stands for falls (the toy proxy's black backgrounds,
Flow-GRPO's grid artefacts), and "which step do I keep?" is then answered by hand after the run. The held-out
points of ``log.test_every`` already score fixed prompts and seeds with every reward, a gold one (weight 0, never
trained on) included, so comparing that curve with the training reward costs no extra sampling.

Choices:
- the watched score is the reward ``guard.held_out.reward`` on the held-out points, each prompt's mean over its
  images, then (GenEval's convention) the mean over tasks when the prompts have a ``task``;
- the best point is the highest score so far, the base model's (epoch -1) included;
- noise: every point renders the same prompts with the same seeds, so the fall from the best point is a
  paired difference; its standard error comes from the per-prompt differences
  (:func:`flowrl.data.tasks.paired_task_mean_gain` on prompt means: prompts, not images, are the unit, as the
  images of one prompt are correlated); a point *falls* when ``best - now > margin + z * se``;
- the training reward (the weighted sum of the trained rewards' epoch means) must *keep rising* over the same
  window: its least-squares slope over the epochs since the best point (since the last rollback, when later) is
  positive. A held-out fall while the training reward falls too is a bad run, not a hacked reward;
- it fires after ``patience`` such points in a row: ``warn`` writes one line, ``stop`` ends the run after the
  epoch, ``rollback`` puts the best point's LoRA, EMA(s) and AdamW moments back, multiplies the learning rate
  (the scheduler's base, so every later step) by ``lr_factor`` and the KL beta by ``kl_factor`` and goes on;
  after ``max_rollbacks`` the next firing stops the run;
- ``stop`` and ``rollback`` export and report the best held-out snapshot at the end (the adapter kept).

The state (best point and its per-prompt scores, the training-reward window, counters, the LR and beta scales)
is JSON in the trainer state; the best point's weights are checkpoint snapshots (``held_out_best*``), so a
resumed run is the uninterrupted one. Run: ``flowrl train configs/toy/grpo_proxy_heldout_guard.yaml``;
``python -m flowrl.experiments experiments/held_out_guard.yaml`` compares it with an unguarded run and the
diversity guard.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from flowrl.config import ConfigError
from flowrl.core.sharded import write_weights
from flowrl.data.tasks import paired_task_mean_gain, row_tasks
from flowrl.training.ema import AdapterSnapshot, LoraEMA

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def prompt_means(scores: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """Each prompt's NaN-aware mean of its images' scores: ``[P * n]`` (prompt-major) -> ``[P]``."""
    return torch.nanmean(scores.detach().float().cpu().view(num_prompts, -1), dim=1)  # [P]


def prompt_tasks(metadata: Sequence[dict | None]) -> list[str]:
    """Each prompt's task, or one task for all when the prompts have none."""
    tasks = row_tasks(metadata)
    return ["all"] * len(metadata) if tasks is None else [t if t is not None else "none" for t in tasks]


def task_mean(per_prompt: torch.Tensor, tasks: Sequence[str]) -> float:
    """The mean over tasks of each task's mean over its prompts' finite scores (NaN when none is finite)."""
    means = []
    for task in dict.fromkeys(tasks):
        values = per_prompt[torch.tensor([t == task for t in tasks])]
        values = values[torch.isfinite(values)]
        if values.numel():
            means.append(float(values.mean()))
    return sum(means) / len(means) if means else math.nan


def fall_from_best(best: torch.Tensor, now: torch.Tensor, tasks: Sequence[str]) -> tuple[float, float]:
    """``(best score - score now, its standard error)`` from the paired per-prompt differences ``now - best``
    ([P] each, same prompts and seeds)."""
    paired = paired_task_mean_gain(best, now, tasks)
    return -paired["gain"], paired["standard_error"]


def slope(epochs: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` over ``epochs`` (NaN for fewer than two points)."""
    if len(values) < 2:
        return math.nan
    x, y = torch.tensor(epochs, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def falls(drop: float, se: float, *, margin: float, z: float) -> bool:
    """Whether the held-out score fell more than ``margin`` beyond ``z`` standard errors of its noise."""
    return math.isfinite(drop) and drop > margin + z * (se if math.isfinite(se) else 0.0)


def trained_reward(metrics: dict, weights: dict[str, float]) -> float:
    """The weighted sum of the trained rewards' epoch means (``reward/<key>_mean``); NaN when one is missing."""
    values = [w * metrics.get(f"reward/{key}_mean", math.nan) for key, w in weights.items() if w != 0]
    return float(sum(values)) if values else math.nan


def _nan_to_none(values: torch.Tensor) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


def _none_to_nan(values: list) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


class HeldOutWeights:
    """The best held-out point's training state as checkpoint snapshots: the live LoRA, every adapter copy of the
    run (``copies()``: :meth:`flowrl.recipes.run.Run.adapter_copies`, the EMAs, recipe nft's old adapter, CRD's
    sampler, GARDO's reference, ...), and (``moments``) AdamW's two moments with their step counts. Built empty
    (``taken=False``); :meth:`take` fills them, :meth:`restore` puts them back.

    The run's copies are read on first use, not at build: the guard is built before a recipe's own extras (CRD's
    sampler), and by the first checkpoint or held-out point every extra exists."""

    def __init__(self, named_parameters, params: list[torch.nn.Parameter],
                 copies: Callable[[], dict[str, LoraEMA]], *, moments: bool):
        self.named = list(named_parameters)
        self.params, self.copies_of_run = params, copies
        self.live = AdapterSnapshot(self.named, taken=False)
        self.moments = {k: AdapterSnapshot(self.named, taken=False) for k in ADAM_MOMENTS} if moments else {}
        self.steps: list[float | None] | None = None  # AdamW's step per parameter at the best point (None: no state)
        self._pairs: dict[str, tuple[LoraEMA, AdapterSnapshot]] | None = None

    @property
    def pairs(self) -> dict[str, tuple[LoraEMA, AdapterSnapshot]]:
        """``{name: (the run's adapter copy, its copy at the best point)}``."""
        if self._pairs is None:
            self._pairs = {name: (copy, AdapterSnapshot(self.named, taken=False))
                           for name, copy in self.copies_of_run().items()}
        return self._pairs

    def snapshots(self) -> dict[str, AdapterSnapshot]:
        """By checkpoint file name: held_out_best (the live LoRA), held_out_best_<copy> (held_out_best_ema, _old,
        _sampler, ...), held_out_best_exp_avg / _exp_avg_sq."""
        return {"held_out_best": self.live, **{f"held_out_best_{n}": best for n, (_, best) in self.pairs.items()},
                **{f"held_out_best_{k}": c for k, c in self.moments.items()}}

    @torch.no_grad()
    def take(self, optimizer) -> None:
        """Copy the live weights, every adapter copy and (if kept) AdamW's moments now."""
        self.live.take()
        for copy, best in self.pairs.values():
            copy_shadows(copy, best)
        if self.moments:
            states = [optimizer.state.get(p, {}) for p in self.params]
            self.steps = [float(s["step"]) if "step" in s else None for s in states]
            for key, copy in self.moments.items():
                for shadow, state in zip(copy.model.shadow_params, states):
                    if key in state:
                        shadow.copy_(state[key])
                    else:  # no step yet: restore() drops the state (steps None) and never reads this
                        shadow.zero_()
                copy.taken = True

    @torch.no_grad()
    def restore(self, optimizer=None) -> None:
        """Put the taken weights (and with ``optimizer`` its moments) back into the live run."""
        write_weights(self.live.parameters, self.live.model.shadow_params, exchange=False)  # a load, not a swap
        for copy, best in self.pairs.values():
            copy_shadows(best, copy)
        if optimizer is None or not self.moments:
            return
        for i, param in enumerate(self.params):
            step = None if self.steps is None else self.steps[i]
            if step is None:  # no update had been taken at the best point: AdamW starts afresh
                optimizer.state.pop(param, None)
                continue
            state = optimizer.state[param]
            old = state.get("step")
            state["step"] = torch.tensor(step, dtype=old.dtype if old is not None else torch.float32,
                                         device=old.device if old is not None else "cpu")
            for key, copy in self.moments.items():
                state[key] = copy.model.shadow_params[i].detach().clone()


@torch.no_grad()
def copy_shadows(source: LoraEMA, target: LoraEMA) -> None:
    """``target``'s shadow weights become ``source``'s (the same parameters, the same order)."""
    for t, s in zip(target.model.shadow_params, source.model.shadow_params):
        t.copy_(s)
    if isinstance(target, AdapterSnapshot):
        target.taken = True


class HeldOutGuard:
    """The held-out guard's decisions and state; a run extra (:class:`flowrl.recipes.run.Run`) whose
    :meth:`end_epoch` sees every epoch's metrics and, at held-out points, the per-image scores.

    ``train_weights``: the run's reward weights (the training reward is their weighted sum); ``weights``: the best
    point's :class:`HeldOutWeights` (None: policy warn keeps none); ``write``: where the firing line goes."""

    def __init__(self, *, reward: str, margin: float, z: float, patience: int, policy: str, lr_factor: float,
                 kl_factor: float, max_rollbacks: int, train_weights: dict[str, float],
                 weights: HeldOutWeights | None = None, write: Callable[[str], None] | None = None):
        self.reward, self.margin, self.z, self.patience, self.policy = reward, margin, z, patience, policy
        self.lr_factor, self.kl_factor, self.max_rollbacks = lr_factor, kl_factor, max_rollbacks
        self.train_weights = train_weights
        self.weights = weights
        self.write = write or (lambda line: None)
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self.best_prompts: list[float | None] = []  # the best point's per-prompt scores [P]
        self.window: list[tuple[int, float]] = []  # (epoch, training reward) since the best point / last rollback
        self.strikes = 0  # held-out points in a row that fell while the training reward rose
        self.rollbacks = 0
        self.fired_epoch: int | None = None
        self.stopped = False
        self.lr_scale = 1.0
        self.beta_scale = 1.0  # the KL beta in force is train.beta (or the diversity guard's) times this
        self.action: str | None = None  # what the last held-out point did (observe)

    # --- the rule ---------------------------------------------------------------------------------------------
    def observe(self, epoch: int, per_prompt: torch.Tensor, tasks: Sequence[str]) -> dict[str, float]:
        """Take held-out point ``epoch`` (``per_prompt`` [P] scores of the watched reward); returns its metrics and
        sets :attr:`action` to None, ``"new_best"``, ``"warn"``, ``"stop"`` or ``"rollback"``."""
        score = task_mean(per_prompt, tasks)
        self.action = None
        metrics = {"guard/held_out_score": score}
        if math.isfinite(score) and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_epoch, self.best_prompts = score, epoch, _nan_to_none(per_prompt)
            self.window = [(e, r) for e, r in self.window if e > epoch]
            self.strikes, self.action = 0, "new_best"
            drop, se, rise = 0.0, 0.0, math.nan
        else:
            drop, se = fall_from_best(_none_to_nan(self.best_prompts), per_prompt.float(), tasks)
            rise = slope(*zip(*self.window)) if len(self.window) >= 2 else math.nan
            hacked = falls(drop, se, margin=self.margin, z=self.z) and rise > 0
            self.strikes = self.strikes + 1 if hacked else 0
            if self.strikes >= self.patience and not self.stopped:
                self.strikes, self.fired_epoch = 0, epoch
                rollback = self.policy == "rollback" and self.rollbacks < self.max_rollbacks
                self.action = "rollback" if rollback else "warn" if self.policy == "warn" else "stop"
                self.write(self.message(epoch, score, drop, se, rise))
        if self.action == "stop":
            self.stopped = True
        if self.action == "rollback":
            self.rollbacks += 1
            self.lr_scale *= self.lr_factor
            self.beta_scale *= self.kl_factor
            self.window = []  # the rolled-back branch's rewards no longer describe the weights
        metrics.update({"guard/held_out_best": self.best_score if self.best_score is not None else math.nan,
                        "guard/held_out_best_epoch": float(self.best_epoch if self.best_epoch is not None
                                                           else -2),  # -1 is the base model; -2: no point yet
                        "guard/held_out_drop": drop, "guard/held_out_se": se, "guard/held_out_train_slope": rise,
                        "guard/held_out_strikes": float(self.strikes),
                        "guard/held_out_fired": float(self.action in ("warn", "stop", "rollback")),
                        "guard/held_out_rollbacks": float(self.rollbacks), "guard/held_out_lr_scale": self.lr_scale,
                        "guard/held_out_beta_scale": self.beta_scale})
        return metrics

    def message(self, epoch: int, score: float, drop: float, se: float, rise: float) -> str:
        """The one line written when the guard fires (before it acts)."""
        head = (f"held-out guard: epoch {epoch}: held-out {self.reward} {score:.4f} is {drop:.4f} below its best "
                f"{self.best_score:.4f} (epoch {self.best_epoch}; s.e. {se:.4f}, guard.held_out.margin={self.margin:g}"
                f", z={self.z:g}) for {self.patience} point(s) while the training reward rose ({rise:+.4g}/epoch)")
        if self.action == "rollback":
            return (f"{head}: rolling back to epoch {self.best_epoch}'s weights (rollback {self.rollbacks + 1} of "
                    f"{self.max_rollbacks}), learning rate x{self.lr_factor:g}, KL beta x{self.kl_factor:g}")
        if self.action == "stop":
            spent = f" (guard.held_out.max_rollbacks={self.max_rollbacks} spent)" if self.policy == "rollback" else ""
            return (f"{head}: stopping after this epoch{spent}; RUN_DIR/lora and the report get epoch "
                    f"{self.best_epoch}'s weights")
        return (f"{head}: the trained reward is being hacked; keep an earlier checkpoint, raise train.beta, or rerun "
                "with guard.held_out.policy=rollback or stop")

    # --- the run extra ----------------------------------------------------------------------------------------
    def end_epoch(self, run, epoch: int, metrics: dict, held_out: dict[str, torch.Tensor] | None) -> dict:
        """Every epoch (and the base model's point, epoch -1): note the training reward; at a held-out point
        (``held_out``: per-image scores ``{key: [P * n]}``) apply the rule and act before the checkpoint."""
        reward = trained_reward(metrics, self.train_weights)
        if epoch >= 0 and math.isfinite(reward):
            self.window.append((epoch, reward))
        if held_out is None:
            return {}
        if self.reward not in held_out:
            raise ConfigError(f"config key 'guard.held_out.reward': the held-out points score no {self.reward!r} "
                              f"(they score {', '.join(held_out)})", key="guard.held_out.reward")
        metadata = run.test_set.metadata  # one entry per held-out prompt
        out = self.observe(epoch, prompt_means(held_out[self.reward], len(metadata)), prompt_tasks(metadata))
        if self.action == "new_best" and self.weights is not None:
            self.weights.take(run.optimizer)
        if self.action == "rollback":
            self.roll_back(run)
        return out

    def roll_back(self, run) -> None:
        """The best point's weights, EMA and AdamW moments back; the LR scaled from the next step on."""
        self.weights.restore(run.optimizer)
        scheduler = run.extras["lr_scheduler"]
        scheduler.base_lrs = [lr * self.lr_factor for lr in scheduler.base_lrs]
        for group in run.optimizer.param_groups:
            group["lr"] *= self.lr_factor

    @property
    def kl_scale(self) -> float:
        """What the KL beta in force is multiplied by (rollback's kl_factor per rollback)."""
        return self.beta_scale

    keeps_records = True  # its snapshots record the best point: the rollback restores from them, not into them

    def snapshots(self) -> dict[str, AdapterSnapshot]:
        return {} if self.weights is None else self.weights.snapshots()

    def finish(self, run) -> None:
        """stop and rollback: the export and the report get the best held-out point's weights."""
        if self.weights is not None and self.weights.live.taken:
            self.weights.restore()  # the live weights and every EMA; the optimizer is done with

    def state_dict(self) -> dict:
        """JSON-safe state for the checkpoint (the best point's weights are its ``held_out_best*`` snapshots)."""
        return {"best_score": self.best_score, "best_epoch": self.best_epoch, "best_prompts": self.best_prompts,
                "window": [list(p) for p in self.window], "strikes": self.strikes, "rollbacks": self.rollbacks,
                "fired_epoch": self.fired_epoch, "stopped": self.stopped, "lr_scale": self.lr_scale,
                "beta_scale": self.beta_scale, "adam_steps": None if self.weights is None else self.weights.steps}

    def load_state_dict(self, state: dict) -> None:
        self.best_score, self.best_epoch, self.best_prompts = state["best_score"], state["best_epoch"], list(
            state["best_prompts"])
        self.window = [(int(e), float(r)) for e, r in state["window"]]
        self.strikes, self.rollbacks, self.fired_epoch = int(state["strikes"]), int(state["rollbacks"]), state[
            "fired_epoch"]
        self.stopped, self.lr_scale, self.beta_scale = bool(state["stopped"]), float(state["lr_scale"]), float(
            state["beta_scale"])
        if self.weights is not None:
            self.weights.steps = state["adam_steps"]
