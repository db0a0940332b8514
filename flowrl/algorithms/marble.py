"""MARBLE: one update direction from several rewards' policy gradients, by a small quadratic program.

A weighted sum of rewards lets one reward's gradient cancel another's: most rollouts are specialist
samples, good for one reward and neutral or bad for the others. MARBLE keeps one advantage per reward,
measures one gradient per reward over the trainable (LoRA) parameters, and steps along the min-norm
point of their convex hull (MGDA), the direction that decreases no reward's loss less than necessary:

    alpha* = argmin_{alpha in simplex} || sum_k alpha_k g_k / ||g_k|| ||^2

The direction ``d = sum_k alpha_k g_k / ||g_k||`` (norm at most 1) is multiplied by the mean per-reward
gradient norm: where the rewards agree the step is as long as one reward's, where they conflict it
shrinks with their common descent direction. alpha is smoothed by an EMA across refreshes against
one batch's noise. With K = 2 the min-norm point of two unit vectors is always alpha = (1/2, 1/2), so
MARBLE's weights are then those that equalise the two gradients' norms. Because the update only
needs ``sum_k w_k g_k``, it is written as per-reward *advantage weights* ``w_k`` (:meth:`MarbleBalancer.update`):
a loss affine in the advantage (DiffusionNFT's, AWM's, the unclipped GRPO surrogate) has
``grad L(sum_k w_k A_k) = grad L(0) + sum_k w_k (grad L(A_k) - grad L(0))``, so between refreshes one
backward pass on the balanced advantage replaces K. ``grad L(0)`` is the advantage-free part of the
gradient (the KL term, NFT's symmetric pull): it is counted once, and never balanced.

K is small (a handful of rewards), so the QP is solved exactly by enumerating the simplex's faces.
"""

from __future__ import annotations

from itertools import combinations

import torch


def min_norm_weights(gram: torch.Tensor) -> torch.Tensor:
    """alpha [K] on the simplex minimising ``alpha^T G alpha`` for a Gram matrix ``gram`` [K, K] (PSD).

    Exact: the minimiser lies in the relative interior of some face S of the simplex, where the KKT
    system ``2 G_S alpha_S + lambda 1 = 0, 1^T alpha_S = 1`` holds; every face is solved (least
    squares covers a singular G_S) and the best feasible point is kept. 2^K - 1 faces: fine for K <= 10.
    """
    gram = gram.double()
    k = gram.shape[0]
    if k > 10:
        raise ValueError(f"the exact MARBLE solver enumerates 2^K faces; K={k} rewards is too many (at most 10)")
    best, best_value = None, float("inf")
    for size in range(1, k + 1):
        for face in combinations(range(k), size):
            index = torch.tensor(face)
            system = torch.zeros(size + 1, size + 1, dtype=torch.float64)
            system[:size, :size] = 2 * gram[index][:, index]
            system[:size, size] = 1.0
            system[size, :size] = 1.0
            rhs = torch.zeros(size + 1, dtype=torch.float64)
            rhs[size] = 1.0
            solution = torch.linalg.lstsq(system, rhs[:, None]).solution[:size, 0]
            if bool((solution < -1e-10).any()) or abs(float(solution.sum()) - 1.0) > 1e-8:
                continue
            alpha = torch.zeros(k, dtype=torch.float64)
            alpha[index] = solution.clamp(min=0)
            alpha /= alpha.sum()
            value = float(alpha @ gram @ alpha)
            if value < best_value - 1e-15:
                best, best_value = alpha, value
    return best


class MarbleBalancer:
    """Per-reward advantage weights from per-reward gradients, refreshed every ``refresh_every``
    optimizer steps, alpha smoothed by ``ema`` (0: no smoothing).

    ``weights`` are the configured reward weights: they stand until the first refresh, and a reward
    whose gradient is zero (all its groups flat) sits out the QP and keeps weight 0 until it has one.
    """

    def __init__(self, weights: dict[str, float], *, refresh_every: int = 1, ema: float = 0.0):
        self.names = list(weights)
        self.configured = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        self.refresh_every, self.ema = refresh_every, ema
        self.alpha: torch.Tensor | None = None  # [K] smoothed
        self.weights = self.configured.clone()  # [K] advantage weights in force

    def due(self, step: int) -> bool:
        return step % self.refresh_every == 0

    def update(self, grads: torch.Tensor) -> dict[str, float]:
        """Refresh from per-reward gradients ``grads`` [K, P] (the advantage-linear parts): new alpha,
        new advantage weights; returns the diagnostics to log (alpha, pairwise cosines, and the worst
        reward's cosine with the update under the configured weighted sum and under MARBLE)."""
        grads = grads.double()
        norms = grads.norm(dim=1)  # [K]
        active = norms > 0
        stats: dict[str, float] = {}
        if not bool(active.any()):
            return stats
        unit = torch.zeros_like(grads)
        unit[active] = grads[active] / norms[active, None]
        solved = torch.zeros(len(self.names), dtype=torch.float64)
        index = torch.nonzero(active).flatten()
        solved[index] = min_norm_weights(unit[index] @ unit[index].T)
        self.alpha = solved if self.alpha is None or self.ema == 0 else self.ema * self.alpha + (1 - self.ema) * solved
        alpha = torch.where(active, self.alpha, torch.zeros_like(self.alpha))
        scale = float(norms[active].mean())
        self.weights = torch.where(active, alpha * scale / norms.clamp(min=1e-12), torch.zeros_like(alpha))
        for name, a in zip(self.names, self.alpha.tolist()):
            stats[f"marble/alpha/{name}"] = a
        cos = unit @ unit.T
        for i, j in combinations(range(len(self.names)), 2):
            if active[i] and active[j]:
                stats[f"marble/cos/{self.names[i]}~{self.names[j]}"] = float(cos[i, j])
        for label, w in (("weighted", self.configured), ("marble", self.weights)):
            update = w @ grads
            worst = float((unit[active] @ update).min() / max(float(update.norm()), 1e-12))
            stats[f"marble/worst_cos_{label}"] = worst
            stats[f"marble/worst_cos_negative_{label}"] = float(worst < 0)
        return stats

    def metrics(self) -> dict[str, float]:
        """The advantage weights in force, to log each epoch."""
        return {f"marble/weight/{name}": float(w) for name, w in zip(self.names, self.weights)}

    def combine(self, advantages: dict[str, torch.Tensor]) -> torch.Tensor:
        """sum_k w_k A_k of per-reward advantages {name: [N, ...]} at the weights in force."""
        return sum(float(w) * advantages[name] for name, w in zip(self.names, self.weights))

    def state_dict(self) -> dict:
        return {"alpha": None if self.alpha is None else self.alpha.tolist(), "weights": self.weights.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = None if state["alpha"] is None else torch.tensor(state["alpha"], dtype=torch.float64)
        self.weights = torch.tensor(state["weights"], dtype=torch.float64)

    def balance(self, params: list[torch.Tensor], step: int, advantages: dict[str, torch.Tensor], backward,
                stats) -> None:
        """The run's hook for one optimizer step's gradient (:func:`balanced_backward`): a recipe hands it each
        reward's own advantages and its ``backward(advantages, stats)``, and never names MARBLE."""
        balanced_backward(self, params, step, advantages, backward, stats, type(stats))


def flat_grad(params: list[torch.Tensor]) -> torch.Tensor:
    """[P] the parameters' accumulated gradients, concatenated (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double().cpu()
                      for p in params])


def measure_reward_gradients(params: list[torch.Tensor], backward, advantages: dict[str, torch.Tensor],
                             names: list[str]) -> torch.Tensor:
    """[K, P] advantage-linear per-reward gradients ``grad L(A_k) - grad L(0)``, one pass each plus the
    advantage-free pass: ``backward(advantages)`` accumulates a chunk's gradient into ``params``.
    The gradients are cleared before and after."""
    def gradient(advantage) -> torch.Tensor:
        for p in params:
            p.grad = None
        backward(advantage)
        return flat_grad(params)

    base = gradient(torch.zeros_like(advantages[names[0]]))
    grads = torch.stack([gradient(advantages[name]) - base for name in names])
    for p in params:
        p.grad = None
    return grads


def balanced_backward(balancer: MarbleBalancer, params: list[torch.Tensor], step: int,
                      advantages: dict[str, torch.Tensor], backward, stats, scratch_stats) -> None:
    """One optimizer step's gradient under MARBLE: on a refresh step (``balancer.due(step)``) measure
    the per-reward gradients (their passes log into ``scratch_stats()``, a fresh accumulator, so the
    epoch's loss statistics stay those of the update) and refresh the weights; then one pass on the
    balanced advantage, which is the update. ``backward(advantages, stats)`` runs the step's chunk."""
    if balancer.due(step):
        grads = measure_reward_gradients(params, lambda a: backward(a, scratch_stats()), advantages, balancer.names)
        for key, value in balancer.update(grads).items():
            stats.add_scalar(key, value)
    backward(balancer.combine(advantages), stats)
