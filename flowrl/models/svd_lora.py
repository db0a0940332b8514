"""A LoRA extracted from fully fine-tuned weights by truncated SVD: ``W_trained - W_base ~= B A`` per linear layer.

Why: ComfyUI and most UIs load LoRAs, not a whole transformer; a full fine-tuning run (``model.trainable=full``)
can still hand them one. For each ``nn.Linear`` whose weight moved, the difference ``D [out, in]`` is factored as
``D = U S V^T`` and its best rank-r approximation (Eckart-Young) kept: ``B = U_r sqrt(S_r)`` ``[out, r]``,
``A = sqrt(S_r) V_r^T`` ``[r, in]``. A layer narrower than r is exact and padded with zero rows/columns, so every
module has rank r (one LoRA config; padding changes nothing). The relative reconstruction error
``||D - B A||_F / ||D||_F`` is returned per layer: it says how much of the fine-tune the LoRA keeps. What a LoRA
cannot hold (biases, norms, convolutions that moved) is listed with its relative change ``||D|| / ||W_base||``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SvdReport:
    """Per-layer relative errors of the extracted LoRA, and the moved tensors a LoRA cannot hold."""

    rank: int
    errors: dict[str, float] = field(default_factory=dict)  # module -> ||D - BA|| / ||D||
    left_out: dict[str, float] = field(default_factory=dict)  # tensor -> ||D|| / ||W_base||

    def summary(self) -> str:
        """One line: how many layers, the mean and max relative error, what was left out."""
        values = list(self.errors.values())
        line = (f"SVD LoRA rank {self.rank}: {len(values)} layers, relative reconstruction error "
                f"mean {sum(values) / max(len(values), 1):.4f}, max {max(values, default=0.0):.4f}")
        if values:
            worst = max(self.errors, key=self.errors.get)
            line += f" ({worst})"
        if self.left_out:
            line += (f"; {len(self.left_out)} moved tensors a LoRA cannot hold (biases, norms, convolutions), "
                     f"relative change max {max(self.left_out.values()):.4f}")
        return line


def svd_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``delta [out, in]`` -> (A ``[rank, in]``, B ``[out, rank]``, relative Frobenius error of ``B @ A``), in float32;
    exact (error 0 up to rounding) when ``rank >= min(out, in)`` or the difference has rank <= ``rank``."""
    delta = delta.float()
    out_features, in_features = delta.shape
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)  # [out, k], [k], [k, in], k = min(out, in)
    kept = min(rank, s.numel())
    root = s[:kept].sqrt()
    b = torch.zeros(out_features, rank)
    a = torch.zeros(rank, in_features)
    b[:, :kept] = u[:, :kept] * root
    a[:kept] = root[:, None] * vh[:kept]
    norm = float(torch.linalg.norm(delta))
    error = float(torch.linalg.norm(delta - b @ a)) / norm if norm > 0 else 0.0
    return a.contiguous(), b.contiguous(), error


def extract_lora(base: torch.nn.Module, trained: dict[str, torch.Tensor], rank: int
                 ) -> tuple[dict[str, torch.Tensor], dict, SvdReport]:
    """The LoRA of ``trained`` (parameter name -> tensor, the trained subset) over the ``base`` transformer.

    Returns ``(state, config, report)``: ``state`` in :func:`flowrl.models.lora_io.lora_state_dict` keys
    (``<module>.lora_A.weight``/``lora_B.weight``), ``config`` a peft LoRA config (rank = alpha = ``rank``: scale 1),
    ready for :func:`flowrl.models.lora_io.write_lora_files`."""
    import json

    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"--svd-rank must be >= 1, got {rank}")
    report = SvdReport(rank=rank)
    params = dict(base.named_parameters())
    unknown = sorted(set(trained) - set(params))
    if unknown:
        raise ValueError(f"the trained weights do not fit the base model: no parameter {unknown[0]!r} there")
    linear = {f"{name}.weight": name for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)}
    full_rank = max((min(params[key].shape) for key in trained if key in linear), default=0)
    if full_rank and rank > full_rank:  # every layer's factors would be zero-padded past its exact rank
        raise ValueError(f"--svd-rank {rank} is above the full rank of every trained layer (at most {full_rank}); "
                         f"use --svd-rank {full_rank} or less ({full_rank} is exact)")
    state = {}
    for key, value in trained.items():
        reference = params[key].detach().float().cpu()
        delta = value.float().cpu() - reference
        if not bool(delta.any()):
            continue
        if key in linear:
            a, b, error = svd_factors(delta, rank)
            state[f"{linear[key]}.lora_A.weight"], state[f"{linear[key]}.lora_B.weight"] = a, b
            report.errors[linear[key]] = error
        else:
            report.left_out[key] = float(torch.linalg.norm(delta) / torch.linalg.norm(reference).clamp(min=1e-12))
    if not state:
        raise ValueError("no linear layer's weight differs from the base model: nothing to extract")
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(report.errors)).to_dict()
    config = json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return state, config, report
