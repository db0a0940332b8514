"""Wan2.2 A14B's two experts as one module: what LoRA, the optimizer and the distributed wrapper see.

``WanPipeline`` with ``boundary_ratio`` runs ``transformer`` (the high-noise expert) at timesteps
``t >= boundary_ratio * num_train_timesteps`` and ``transformer_2`` (the low-noise expert) below. Training code
handles one ``policy.transformer`` (its parameters, its adapter state, ``disable_adapters`` for the reference,
``accelerator.prepare``); holding both experts as submodules of one module keeps every one of those paths whole,
so a checkpoint, the EMA and a DDP gradient cover both. The submodules are named after the pipeline components
(``transformer``, ``transformer_2``), so adapter keys read ``transformer.blocks.0...`` and
``transformer_2.blocks.0...`` and an export splits them by that prefix (:func:`flowrl.models.lora_io.expert_states`).
The experts stay the pipeline's own modules: a LoRA attached here is the one ``WanPipeline.__call__`` runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

EXPERTS = {"high": "transformer", "low": "transformer_2"}
"""Config name of an expert (``lora.experts``) -> its pipeline component."""


class WanExperts(torch.nn.Module):
    """``transformer`` and ``transformer_2`` of a two-expert ``WanPipeline``; ``forward(expert=...)`` runs one."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.adapted: tuple[str, ...] = ()  # components carrying the LoRA, in EXPERTS order

    @property
    def config(self):
        """The high-noise expert's config (patch size, channels): both experts share the layout."""
        return self.transformer.config

    def forward(self, *, expert: str, **kwargs):
        return self.get_submodule(expert)(**kwargs)

    # --- the adapter surface of a diffusers model (PeftAdapterMixin), over the chosen experts -------------
    def add_adapter(self, config, experts: Sequence[str] = tuple(EXPERTS)) -> None:
        """Attach ``config``'s LoRA to the experts named (``high``, ``low``); one-line error for another name."""
        unknown = [name for name in experts if name not in EXPERTS]
        if unknown or not experts:
            raise ValueError(f"lora.experts: {unknown[0] if unknown else 'an empty list'} is not an expert of this "
                             f"model; choose from {', '.join(EXPERTS)}")
        self.adapted = tuple(component for name, component in EXPERTS.items() if name in experts)
        for component in self.adapted:
            self.get_submodule(component).add_adapter(config)

    @property
    def peft_config(self) -> dict:
        """The adapter config, the same on every adapted expert (read by peft's state-dict helpers)."""
        return self.get_submodule(self.adapted[0]).peft_config

    def disable_adapters(self) -> None:
        for component in self.adapted:
            self.get_submodule(component).disable_adapters()

    def enable_adapters(self) -> None:
        for component in self.adapted:
            self.get_submodule(component).enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for component in EXPERTS.values():
            self.get_submodule(component).enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        for component in EXPERTS.values():
            self.get_submodule(component).disable_gradient_checkpointing()
