"""How five algorithms' numbers moved when flowrl made them follow their reference code: old variant against new,
each computed by flowrl's own functions on small synthetic inputs with fixed seeds, printed as markdown tables.

1. GRPO-Guard (``train.ratio_norm``): on SD3.5's 10-step schedule (shift 3) at noise level 0.7, D = 4096 latent
   dims, 64 samples and a small off-policy move of the velocity, per trained step (0..8, Flow-GRPO skips the last):
   the spread of the earlier ``batch_sensitivity`` log-ratio over that of ``grpo_guard``'s, and the size of the
   policy loss's gradient in the velocity under the earlier variant over grpo_guard's (its 1/|dt| scale included).
2. BranchGRPO (``sampling.tree.backup``): 500 trees of 16 leaves split before steps 0, 3, 6, 9, rewards U(0, 1) and
   Bernoulli(1/2): mean |A| of the edges at each split depth under the per-depth z-score (the default) and under
   the earlier ``leaf_mean`` backup.
3. TMPO (``train.tmpo_target``): 8 paths, beta 15: the release's residual advantage and the earlier gradient target.
4. DiffusionNFT: the old adapter's decay at a few optimizer steps under decay types 0, 1, 2 and the earlier ramps,
   and the policy loss's scale advantage_clip / strength (earlier: 1).
5. AWM (``nft.awm_weighting``): each sample's gradient weight t l^-0.75 under ghuber (earlier uniform: 1), read
   off autograd through flowrl's loss, and its spread.

    python scripts/reference_figures.py
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowrl.algorithms.advantages import edge_advantages, grpo_advantages
from flowrl.algorithms.awm import awm_policy_loss, matching_log_prob
from flowrl.algorithms.branch import branch_advantages
from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.algorithms.ratio_norm import (
    batch_sensitivity_log_ratio, grpo_guard_log_ratio, grpo_guard_loss_scale, step_sensitivities,
)
from flowrl.algorithms.tmpo import softmax_tb_advantages, softmax_tb_gradient
from flowrl.config.nft import NFTSection
from flowrl.config.schema import TrainConfig
from flowrl.sampling import sde_step
from flowrl.training.ema import decay_schedule

SEED = 0


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get 4 significant digits, so the tables stay narrow and diff cleanly."""
    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --- 1. GRPO-Guard -----------------------------------------------------------------------------------------------

def sd3_sigmas(num_steps: int = 10, shift: float = 3.0) -> torch.Tensor:
    """[num_steps + 1] SD3.5's sampling sigmas: the scheduler the SD3 adapter deep-copies in ``sigmas()``
    (a static shift 3 in its config), without loading a model."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(num_steps, device="cpu")
    return scheduler.sigmas.double()


def guard_step_figures(sigma: float, sigma_next: float, sensitivity: float, generator: torch.Generator, *,
                       batch: int, dims: int, noise_level: float, move: float) -> dict[str, float]:
    """One trained SDE step, both log-ratios of the same off-policy batch and their loss gradients in the velocity.

    The loss is the PPO surrogate with a clip range wide enough to bind nowhere, so the gradients compared are the
    surrogate's own; the recipe sums it over rows and, under grpo_guard, multiplies it by 1/|dt|. float64, so the
    earlier variant's difference of two log-densities carries no rounding."""
    shape = (batch, 1, 1, dims)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)  # [B, 1, 1, D] the step's states
    old_velocity = torch.randn(shape, generator=generator, dtype=torch.float64)  # [B, 1, 1, D] sampling policy
    moved_velocity = old_velocity + move * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(batch, generator=generator, dtype=torch.float64)  # [B]
    old = sde_step(old_velocity, x, sigma, sigma_next, noise_level=noise_level, generator=generator)

    def log_ratio_and_gradient(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        velocity = moved_velocity.clone().requires_grad_(True)
        new = sde_step(velocity, x, sigma, sigma_next, noise_level=noise_level, prev_sample=old.prev_sample)
        if variant == "grpo_guard":
            log_ratio = grpo_guard_log_ratio(new.mean, old.mean, old.prev_sample, new.std)  # [B]
            scale = grpo_guard_loss_scale(sigma, sigma_next)
        else:
            log_ratio = batch_sensitivity_log_ratio(new.log_prob - old.log_prob, sensitivity)  # [B]
            scale = 1.0
        loss, stats = grpo_clip_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_low=1.0, clip_high=1.0)
        assert not stats["clipped"].any(), "the clip range must not bind: the figure is the surrogate's gradient"
        (gradient,) = torch.autograd.grad((loss * scale).sum(), velocity)  # [B, 1, 1, D]
        return log_ratio.detach(), gradient

    earlier_ratio, earlier_gradient = log_ratio_and_gradient("batch_sensitivity")
    guard_ratio, guard_gradient = log_ratio_and_gradient("grpo_guard")
    return {"earlier_std": float(earlier_ratio.std()), "guard_std": float(guard_ratio.std()),
            "spread_ratio": float(earlier_ratio.std() / guard_ratio.std()),
            "gradient_ratio": float(earlier_gradient.norm() / guard_gradient.norm())}


def guard_figures(*, num_steps: int = 10, noise_level: float = 0.7, batch: int = 64, dims: int = 4096,
                  move: float = 0.01) -> list[dict[str, float]]:
    """Per trained step of the SD3 schedule (every step but the last, as Flow-GRPO trains a full-SDE rollout):
    sigma, |dt| and :func:`guard_step_figures`."""
    sigmas = sd3_sigmas(num_steps)
    columns = list(range(num_steps - 1))
    sensitivities = step_sensitivities(sigmas, columns, noise_level=noise_level, kind="sde")
    generator = torch.Generator().manual_seed(SEED)
    figures = []
    for k in columns:
        sigma, sigma_next = float(sigmas[k]), float(sigmas[k + 1])
        step = guard_step_figures(sigma, sigma_next, sensitivities[k], generator, batch=batch, dims=dims,
                                  noise_level=noise_level, move=move)
        figures.append({"step": k, "sigma": sigma, "dt": sigma - sigma_next, **step})
    return figures


def print_guard(figures: list[dict[str, float]]) -> None:
    print("## GRPO-Guard: earlier batch_sensitivity against grpo_guard (SD3 10 steps, a = 0.7, D = 4096, B = 64)\n")
    rows = [[f["step"], f["sigma"], f["dt"], f["earlier_std"], f["guard_std"], f["spread_ratio"], f["gradient_ratio"]]
            for f in figures]
    print(markdown_table(["step", "sigma", "abs dt", "std earlier", "std guard", "spread ratio",
                          "grad ratio (earlier / guard, 1/abs dt incl.)"], rows))
    spread = [f["spread_ratio"] for f in figures]
    gradient = [f["gradient_ratio"] for f in figures]
    print()
    print(markdown_table(["over steps", "min", "max", "max / min"],
                         [["spread ratio", min(spread), max(spread), max(spread) / min(spread)],
                          ["grad ratio", min(gradient), max(gradient), max(gradient) / min(gradient)]]))
    print()


# --- 2. BranchGRPO -----------------------------------------------------------------------------------------------

def tree_edge_ids(num_trees: int, leaves: int, split_steps: tuple[int, ...], num_steps: int) -> torch.Tensor:
    """[T * leaves, num_steps] edge ids of balanced binary trees, one row per leaf: leaf j of a tree sits under
    its column-k edge ``j // width`` (width: the leaves below an edge after the splits up to step k), and rows
    sharing an id at column k are exactly the leaves under that edge (what a tree rollout records)."""
    leaf = torch.arange(leaves)  # [L]
    columns = []
    for k in range(num_steps):
        width = leaves // 2 ** sum(s <= k for s in split_steps)
        columns.append(leaf // width)  # [L] edge within its tree
    per_tree = torch.stack(columns, dim=1)  # [L, K]
    tree = torch.arange(num_trees).repeat_interleave(leaves)  # [N]
    return per_tree.repeat(num_trees, 1) + (tree * leaves)[:, None]  # [N, K] unique across trees


def branch_depth_figures(rewards: torch.Tensor, *, leaves: int, split_steps: tuple[int, ...],
                         num_steps: int) -> list[dict[str, float]]:
    """Mean |A| of the edges at each split depth, BranchGRPO's per-depth z-score against the leaf mean, from
    ``rewards`` [T * leaves], one tree per group, as the grpo recipe computes them (grpo advantages, global std)."""
    num_trees = rewards.numel() // leaves
    edge_ids = tree_edge_ids(num_trees, leaves, split_steps, num_steps)  # [N, K]
    group_ids = torch.arange(num_trees).repeat_interleave(leaves)  # [N]
    root_rows = group_ids * leaves
    parent = torch.where(torch.arange(rewards.numel()) == root_rows, -1, root_rows)  # [N] every leaf under its root
    clip = TrainConfig().advantage_clip
    row_advantages = grpo_advantages(rewards, group_ids, std_scope="global")  # [N]
    depth = branch_advantages(row_advantages, torch.ones_like(rewards, dtype=torch.bool), edge_ids, parent, clip=clip)
    leaf_mean = edge_advantages(row_advantages.clamp(-clip, clip), edge_ids)  # [N, K]
    figures = []
    for level, first_column in enumerate(split_steps, start=1):
        new, old = float(depth[:, first_column].abs().mean()), float(leaf_mean[:, first_column].abs().mean())
        figures.append({"depth": level, "leaves_below": leaves // 2**level, "depth_standardised": new,
                        "leaf_mean": old, "ratio": new / old})
    return figures


def branch_figures(*, num_trees: int = 500, leaves: int = 16, split_steps: tuple[int, ...] = (0, 3, 6, 9),
                   num_steps: int = 12) -> dict[str, list[dict[str, float]]]:
    """:func:`branch_depth_figures` for rewards U(0, 1) and Bernoulli(1/2) (a pass/fail reward)."""
    generator = torch.Generator().manual_seed(SEED)
    size = num_trees * leaves
    rewards = {"U(0, 1)": torch.rand(size, generator=generator, dtype=torch.float64),
               "Bernoulli(1/2)": torch.bernoulli(torch.full((size,), 0.5, dtype=torch.float64), generator=generator)}
    return {name: branch_depth_figures(r, leaves=leaves, split_steps=split_steps, num_steps=num_steps)
            for name, r in rewards.items()}


def print_branch(figures: dict[str, list[dict[str, float]]]) -> None:
    print("## BranchGRPO: mean |A| per split depth, 500 trees of 16 leaves split before steps 0, 3, 6, 9\n")
    rows = [[name, f["depth"], f["leaves_below"], f["depth_standardised"], f["leaf_mean"], f["ratio"]]
            for name, depths in figures.items() for f in depths]
    print(markdown_table(["reward", "depth", "leaves below an edge", "depth_standardised", "leaf_mean", "ratio"],
                         rows))
    print()


# --- 3. TMPO -----------------------------------------------------------------------------------------------------

def tmpo_figures(*, paths: int = 8, beta: float = 15.0, path_log_prob_scale: float = 0.1) -> dict[str, list[float]]:
    """Both TMPO targets of one group of ``paths`` leaves: R the group z-score of U(0, 1) rewards (what the recipe
    feeds in), path log-probs spread by ``path_log_prob_scale`` (per-dimension mean log-densities differ little
    between paths of one prompt). Sorted ascending."""
    generator = torch.Generator().manual_seed(SEED)
    group_ids = torch.zeros(paths, dtype=torch.long)  # [K] one prompt
    rewards = grpo_advantages(torch.rand(paths, generator=generator, dtype=torch.float64), group_ids,
                              std_scope="group")  # [K]
    path_log_probs = path_log_prob_scale * torch.randn(paths, generator=generator, dtype=torch.float64)  # [K]
    reference = softmax_tb_advantages(path_log_probs, rewards, group_ids, beta=beta)  # [K]
    earlier = softmax_tb_gradient(path_log_probs, rewards, group_ids, beta=beta)  # [K]
    return {"residual": sorted(reference.tolist()), "gradient": sorted(earlier.tolist())}


def print_tmpo(figures: dict[str, list[float]]) -> None:
    print("## TMPO: Softmax-TB advantages of 8 paths, beta 15, each sorted\n")
    residual, gradient = figures["residual"], figures["gradient"]
    rows = [[rank, r, g] for rank, (r, g) in enumerate(zip(residual, gradient))]
    rows += [["min", min(residual), min(gradient)], ["max", max(residual), max(gradient)],
             ["sum", sum(residual), sum(gradient)]]
    print(markdown_table(["rank", "residual (reference)", "gradient (earlier)"], rows))
    print()


# --- 4. DiffusionNFT ---------------------------------------------------------------------------------------------

DECAY_STEPS = (0, 75, 100, 133, 208, 300)


def earlier_slow_ramp(step: int) -> float:
    """flowrl's earlier slow old-adapter ramp (no longer in the code; the same numbers as the reference's type 1)."""
    return min(0.001 * step, 0.5)


def earlier_fast_ramp(step: int) -> float:
    """flowrl's earlier type-2 ramp: rising from step 0, without the reference's 75 steps at 0."""
    return min(0.0075 * step, 0.999)


def nft_figures(strengths: tuple[float, ...] = (1.0, 0.1)) -> dict[str, list]:
    """Decays at :data:`DECAY_STEPS` per schedule, and the policy loss scale per strength (earlier: 1)."""
    decays = [[step] + [decay_schedule(step, kind) for kind in (0, 1, 2)]
              + [earlier_slow_ramp(step), earlier_fast_ramp(step)] for step in DECAY_STEPS]
    clip = TrainConfig().advantage_clip
    scales = [[strength, NFTSection(strength=strength).policy_loss_scale(clip), 1.0] for strength in strengths]
    return {"decays": decays, "loss_scales": scales}


def print_nft(figures: dict[str, list]) -> None:
    print("## DiffusionNFT: old adapter decay after s optimizer steps\n")
    print(markdown_table(["step", "type 0", "type 1", "type 2", "earlier min(0.001 s, 0.5)",
                          "earlier min(0.0075 s, 0.999)"], figures["decays"]))
    print()
    print(markdown_table(["strength", "loss scale advantage_clip / strength", "earlier"], figures["loss_scales"]))
    print()


# --- 5. AWM ------------------------------------------------------------------------------------------------------

def awm_gradient_weight(mse: float, t: float, weighting: str) -> float:
    """d loss / d l of one sample with flow-matching error ``mse`` at noise level ``t``, advantage 1, ratio 1
    (AWM's one step per epoch), by autograd through flowrl's log-prob and surrogate: one velocity entry whose
    square is ``l`` (D = 1), so d l / d v = 2 v."""
    velocity = torch.tensor([[mse**0.5]], dtype=torch.float64, requires_grad=True)  # [1, 1]
    target = torch.zeros(1, 1, dtype=torch.float64)
    log_prob = matching_log_prob(velocity, target, torch.tensor([t], dtype=torch.float64), weighting=weighting)
    loss = awm_policy_loss(log_prob, log_prob.detach(), torch.ones(1, dtype=torch.float64), clip_range=1.0)
    (gradient,) = torch.autograd.grad(loss.sum(), velocity)  # [1, 1] d loss / d l * 2 v
    return float(gradient) / (2 * mse**0.5)


def awm_figures(mses: tuple[float, ...] = (0.05, 0.1, 0.3, 1.0),
                ts: tuple[float, ...] = (0.2, 0.5, 0.9)) -> dict[str, list]:
    """The ghuber and uniform weights on the (l, t) grid, each with t l^-0.75 beside it."""
    grid = [[mse, t, awm_gradient_weight(mse, t, "ghuber"), t * mse**-0.75, awm_gradient_weight(mse, t, "uniform")]
            for mse in mses for t in ts]
    ghuber = [row[2] for row in grid]
    uniform = [row[4] for row in grid]
    return {"grid": grid, "ghuber_spread": max(ghuber) / min(ghuber), "uniform_spread": max(uniform) / min(uniform)}


def print_awm(figures: dict[str, list]) -> None:
    print("## AWM: per-sample gradient weight d loss / d l (advantage 1, ratio 1)\n")
    print(markdown_table(["l", "t", "ghuber", "t l^-0.75", "uniform (earlier)"], figures["grid"]))
    print()
    print(markdown_table(["weighting", "max / min over the 12 samples"],
                         [["ghuber", figures["ghuber_spread"]], ["uniform", figures["uniform_spread"]]]))
    print()


def main() -> None:
    print_guard(guard_figures())
    print_branch(branch_figures())
    print_tmpo(tmpo_figures())
    print_nft(nft_figures())
    print_awm(awm_figures())


if __name__ == "__main__":
    main()
