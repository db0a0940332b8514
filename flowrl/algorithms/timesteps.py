"""How each pass of recipe nft draws its training timesteps (``nft.timestep_schedule``).

``TIMESTEP_SCHEDULES`` maps the option's names to functions of one signature,
``(schedule [num_steps], num_rows, nft section, seed, sigmas) -> timesteps [num_rows, k] or None``: row ``i``'s sigmas
for its ``k`` (sample, t) pairs, or None where the recipe draws ``t ~ U(0, 1)`` itself, with the noise; ``sigmas(n)``
is the model's own shifted schedule of ``n`` steps, ``[n + 1]`` ending at 0 (``Policy.sigmas``), for a draw on a
finer grid than the sampling schedule. The recipe looks the name up once and calls the entry, so no name of it
appears in an ``if``.

- ``sampling``: DiffusionNFT's, each row the sampling schedule's sigmas in its own random order
  (:func:`schedule_timesteps`), so no sigma repeats within a sample;
- ``stratified``: AWM's ``discrete_wo_init`` draw, one sigma per stratum (:func:`flowrl.algorithms.awm.
  stratified_timesteps`, with ``nft.timesteps_per_sample`` strata over ``nft.stratified_fraction`` of the schedule);
- ``uniform``: None;
- ``logit_normal``: Flow-GRPO's online DPO draw (:func:`logit_normal_timesteps`), ``u = sigmoid(m + s z)`` with
  ``z ~ N(0, 1)`` indexing the model's own shifted 1000-step schedule, so the shift acts on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from flowrl.algorithms.awm import stratified_timesteps

# Flow-GRPO's logit-normal draw indexes its training scheduler's 1000 timesteps.
LOGIT_NORMAL_GRID = 1000

if TYPE_CHECKING:
    from flowrl.config.nft import NFTSection


def schedule_timesteps(schedule: torch.Tensor, num_rows: int, *, seed: list[int]) -> torch.Tensor:
    """[num_rows, len(schedule)]: each row the schedule's sigmas in its own random order (seeded)."""
    keys = np.random.default_rng(seed).random((num_rows, len(schedule)))
    return schedule[torch.as_tensor(np.argsort(keys, axis=1))]


def logit_normal_timesteps(grid: torch.Tensor, num_rows: int, count: int, *, mean: float, std: float,
                           seed: list[int]) -> torch.Tensor:
    """[num_rows, count] sigmas ``grid[floor(G u)]``, ``u = sigmoid(mean + std z)``, ``z ~ N(0, 1)`` (seeded), from a
    grid [G] of sigmas falling from 1: Flow-GRPO's online DPO draw (yifan123/flow_grpo ``scripts/train_sd3_dpo.py``
    at ac4c86e, L890-898: diffusers' ``compute_density_for_timestep_sampling('logit_normal', logit_mean=0,
    logit_std=1)``, ``indices = (u * num_train_timesteps).long()`` into the scheduler's shifted timesteps). u and
    1 - u are alike in law, so the sigma is the grid's shift applied to a logit-normal t: with SD3's shift 3,
    P(sigma < 0.3) = P(t < 0.125) = Phi(logit 0.125) = 2.6%."""
    z = np.random.default_rng(seed).standard_normal((num_rows, count))
    u = 1.0 / (1.0 + np.exp(-(mean + std * z)))
    index = np.minimum((u * len(grid)).astype(np.int64), len(grid) - 1)
    return grid[torch.as_tensor(index)]


def sampling_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int],
                      sigmas: Callable) -> torch.Tensor:
    """``sampling``: [num_rows, num_steps], :func:`schedule_timesteps`."""
    return schedule_timesteps(schedule, num_rows, seed=seed)


def stratified_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int],
                        sigmas: Callable) -> torch.Tensor:
    """``stratified``: [num_rows, nft.timesteps_per_sample], AWM's draw."""
    return stratified_timesteps(schedule, num_rows, nft.timesteps_per_sample, nft.stratified_fraction, seed=seed)


def uniform_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int],
                     sigmas: Callable) -> None:
    """``uniform``: None, ``t ~ U(0, 1)`` is drawn with the noise."""
    return None


def logit_normal_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int],
                          sigmas: Callable) -> torch.Tensor:
    """``logit_normal``: [num_rows, nft.timesteps_per_sample], :func:`logit_normal_timesteps` on the model's own
    1000-step schedule (``sigmas(1000)``, its last, 0, left out) with ``nft.logit_mean`` and ``nft.logit_std``."""
    return logit_normal_timesteps(sigmas(LOGIT_NORMAL_GRID)[:-1].float(), num_rows, nft.timesteps_per_sample,
                                  mean=nft.logit_mean, std=nft.logit_std, seed=seed)


# nft.timestep_schedule -> its draw (the config's Literal lists the same names; tests hold them equal).
TIMESTEP_SCHEDULES: dict[str, Callable[..., torch.Tensor | None]] = {
    "sampling": sampling_schedule, "stratified": stratified_schedule, "uniform": uniform_schedule,
    "logit_normal": logit_normal_schedule}
