"""How each pass of recipe nft draws its training timesteps (``nft.timestep_schedule``).

``TIMESTEP_SCHEDULES`` maps the option's names to functions of one signature,
``(schedule [num_steps], num_rows, nft section, seed) -> timesteps [num_rows, k] or None``: row ``i``'s sigmas for
its ``k`` (sample, t) pairs, or None where the recipe draws ``t ~ U(0, 1)`` itself, with the noise. The recipe
looks the name up once and calls the entry, so no name of it appears in an ``if``.

- ``sampling``: DiffusionNFT's, each row the sampling schedule's sigmas in its own random order
  (:func:`schedule_timesteps`), so no sigma repeats within a sample;
- ``stratified``: AWM's ``discrete_wo_init`` draw, one sigma per stratum (:func:`flowrl.algorithms.awm.
  stratified_timesteps`, with ``nft.timesteps_per_sample`` strata over ``nft.stratified_fraction`` of the schedule);
- ``uniform``: None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from flowrl.algorithms.awm import stratified_timesteps

if TYPE_CHECKING:
    from flowrl.config.nft import NFTSection


def schedule_timesteps(schedule: torch.Tensor, num_rows: int, *, seed: list[int]) -> torch.Tensor:
    """[num_rows, len(schedule)]: each row the schedule's sigmas in its own random order (seeded)."""
    keys = np.random.default_rng(seed).random((num_rows, len(schedule)))
    return schedule[torch.as_tensor(np.argsort(keys, axis=1))]


def sampling_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int]) -> torch.Tensor:
    """``sampling``: [num_rows, num_steps], :func:`schedule_timesteps`."""
    return schedule_timesteps(schedule, num_rows, seed=seed)


def stratified_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int]) -> torch.Tensor:
    """``stratified``: [num_rows, nft.timesteps_per_sample], AWM's draw."""
    return stratified_timesteps(schedule, num_rows, nft.timesteps_per_sample, nft.stratified_fraction, seed=seed)


def uniform_schedule(schedule: torch.Tensor, num_rows: int, nft: NFTSection, seed: list[int]) -> None:
    """``uniform``: None, ``t ~ U(0, 1)`` is drawn with the noise."""
    return None


# nft.timestep_schedule -> its draw (the config's Literal lists the same names; tests hold them equal).
TIMESTEP_SCHEDULES: dict[str, Callable[[torch.Tensor, int, NFTSection, list[int]], torch.Tensor | None]] = {
    "sampling": sampling_schedule, "stratified": stratified_schedule, "uniform": uniform_schedule}
