"""How a rollout samples: the options that stay the same for every batch of a run, in one frozen value.

:func:`flowrl.sampling.rollout.rollout`, :func:`flowrl.sampling.rollout.chunked_rollout` and SA-Solver's loop
(:func:`flowrl.sampling.sa_solver.sa_solver_rollout`) take one :class:`RolloutSettings` for how to sample and
keep as parameters only what differs per call: the prompts, the group size, the row seeds, the metadata and the
text conditioning. A caller builds the settings once (per epoch, per batch where the plan changes) and derives
a variant with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.sampling.plan import StepPlan
from flowrl.sampling.self_guidance import SelfGuidance
from flowrl.sampling.steps import StepKind


@dataclass(frozen=True)
class RolloutSettings:
    """How to sample ``num_steps`` denoising steps at ``guidance_scale``; the fields below say why each exists.

    - ``noise_level``: the noise of the stochastic steps (``kind``); the plan may override it per step
      (``StepPlan.noise_levels``, TMPO's per-split levels). 0 with the plan's window at the last step is the
      plain ODE sampler.
    - ``kind``: the stochastic step of the plan's SDE window (:data:`flowrl.sampling.steps.STEP_KINDS`: sde or
      cps), whose log-probabilities the trajectory records for the policy loss.
    - ``plan``: which steps are stochastic and stored, and where a tree branches (:class:`StepPlan`); None is
      the full plan, every step stochastic and stored (``StepPlan(num_steps)``). Its ``num_steps`` must match.
    - ``ode_solver``: the solver of the unstored deterministic steps
      (:data:`flowrl.sampling.steps.ODE_SOLVERS`): where it acts (after the window only, or on every
      deterministic step) and whether its history carries the window's clean-latent predictions or restarts
      after every SDE step.
    - ``same_noise_in_group``: every row of a group starts from the first row's initial noise, so a group's
      rows differ only by their SDE noise.
    - ``same_noise_in_pairs``: rows 2i and 2i + 1 of a group share row 2i's initial noise (SDPO's pairs; the
      group size must be even).
    - ``store_x0_preds``: the trajectory also keeps the clean-latent prediction ``x - sigma v`` at every stored
      state, from the velocities the loop computes anyway (no extra model call): dense_cosine credit reads them.
    - ``store_means``: the trajectory keeps the float32 mean of every stored step: GRPO-Guard's ratio needs the
      sampling policy's mean.
    - ``decode``: decode the clean latents to images (the rewards need them; a test of latents alone does not).
    - ``decode_batch_size``: latents decoded per VAE call, which is the memory peak at high resolution.
    - ``self_guidance``: disperses the transformer features of each group's rows at its steps
      (:mod:`flowrl.sampling.self_guidance`; None: off).
    """

    num_steps: int
    guidance_scale: float
    noise_level: float
    kind: StepKind = "sde"
    plan: StepPlan | None = None
    ode_solver: str = "euler"
    same_noise_in_group: bool = False
    same_noise_in_pairs: bool = False
    store_x0_preds: bool = False
    store_means: bool = False
    decode: bool = True
    decode_batch_size: int = 16
    self_guidance: SelfGuidance | None = None

    @property
    def step_plan(self) -> StepPlan:
        """The plan in force: ``plan``, or the full plan of ``num_steps`` where it is None."""
        return self.plan or StepPlan(self.num_steps)
