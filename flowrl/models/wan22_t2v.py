"""Wan2.2 T2V A14B policy adapter: a ``WanPipeline`` of two experts switched at ``boundary_ratio``.

The flow, the CFG, the text and the latents are Wan2.1's (:class:`~flowrl.models.wan.WanPolicy`); what A14B adds is
which transformer runs. ``WanPipeline.__call__`` runs ``transformer`` (high noise) at every step whose timestep
``t = 1000 sigma`` is ``>= boundary_ratio * num_train_timesteps`` and ``transformer_2`` (low noise) below, guided at
``guidance_scale_2`` (by default ``guidance_scale``; either way CFG runs only when ``guidance_scale > 1``). The
velocity here makes the same choice in the same float32 comparison for every row, so the rollout, the log-prob
recorded in it and the one the loss recomputes (rows of any mix of steps) all use the pipeline's expert.

Both experts are one module, :class:`~flowrl.models.wan_experts.WanExperts`, as ``policy.transformer``: the LoRA
(on the experts ``lora.experts`` names), the optimizer, checkpoints and the distributed wrapper see both.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flowrl.models.base import TextCond
from flowrl.models.wan import WanPolicy
from flowrl.models.wan_experts import EXPERTS, WanExperts


class Wan22T2VPolicy(WanPolicy):
    family = "wan22_t2v"
    default_guidance = 4.0  # Wan2.2 T2V A14B's sample_guide_scale for the high-noise expert (3.0 for the low)
    default_height, default_width = 720, 1280  # A14B's 720p size
    checkpoint_name = "Wan2.2 T2V A14B"
    two_experts = True
    experts = tuple(EXPERTS)
    preference_sites = {}  # a preference embedding hooks one transformer; two experts have two time embedders

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_wan22_t2v import tiny_wan22_t2v_pipeline

        return tiny_wan22_t2v_pipeline(seed)

    def __init__(self, pipeline, *, guidance_scale_2: float | None = None, **kwargs):
        super().__init__(pipeline, **kwargs)
        self.transformer = WanExperts(pipeline.transformer, pipeline.transformer_2)
        self.guidance_scale_2 = guidance_scale_2
        """The low-noise expert's CFG scale (``model.guidance_scale_2``); None: the high-noise one's."""

    @property
    def boundary_timestep(self) -> float:
        """The pipeline's ``boundary_ratio * num_train_timesteps``: the high-noise expert runs at ``t >=`` it."""
        return self.pipeline.config.boundary_ratio * self.pipeline.scheduler.config.num_train_timesteps

    def high_noise_rows(self, timestep: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the rows whose step WanPipeline gives ``transformer`` (``timestep`` ``[B]`` float32, compared
        with the Python-float boundary as the pipeline compares its float32 ``t``)."""
        return timestep >= self.boundary_timestep

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, F, h, w]`` from the expert of each row's step; rows on both sides of the boundary
        (the loss's mixed steps) run each expert on its own rows."""
        timestep = self.timesteps(sigma, x)  # [B]
        cfg = guidance_scale > 1  # WanPipeline: do_classifier_free_guidance reads guidance_scale alone
        low_scale = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        high = self.high_noise_rows(timestep)  # [B]
        if bool(high.all()):
            return self.guided_velocity(x, timestep, cond, guidance_scale, cfg=cfg, expert="transformer")
        if not bool(high.any()):
            return self.guided_velocity(x, timestep, cond, low_scale, cfg=cfg, expert="transformer_2")
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device)  # [B, C, F, h, w]
        for rows, scale, expert in ((high, guidance_scale, "transformer"), (~high, low_scale, "transformer_2")):
            index = rows.nonzero().squeeze(1)  # [b]
            out[index] = self.guided_velocity(x[index], timestep[index], cond.select(index), scale, cfg=cfg,
                                              expert=expert).to(out.dtype)
        return out

    def attach_adapter(self, config, experts: Sequence[str] | None) -> None:
        """The LoRA on the experts ``lora.experts`` names (default both); one-line error for a name not in
        :data:`~flowrl.models.wan_experts.EXPERTS`."""
        self.transformer.add_adapter(config, self.experts if experts is None else tuple(experts))

    @classmethod
    def load_exported_lora(cls, pipeline, directory) -> None:
        """Each expert's file of the export into its component: ``load_lora_weights(directory)`` for
        ``transformer``, and with ``weight_name`` and ``load_into_transformer_2=True`` for ``transformer_2``."""
        from pathlib import Path

        from flowrl.models.lora_io import EXPERT_WEIGHT_NAMES

        for component, name in EXPERT_WEIGHT_NAMES.items():
            if (Path(directory) / name).is_file():
                pipeline.load_lora_weights(directory, weight_name=name,
                                           load_into_transformer_2=component == "transformer_2")

    def pipeline_guidance(self) -> dict:
        return {"guidance_scale_2": self.guidance_scale_2}
