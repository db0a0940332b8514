"""Model families behind one Policy adapter: SD3/SD3.5 and FLUX.1 (plus offline tiny variants).

``build_policy`` takes flat arguments; ``path="tiny"`` builds the offline tiny pipeline of the
family (tests, smoke runs), anything else is a hub id or a local diffusers directory.
"""

from __future__ import annotations

import torch

from flowrl.models.base import Policy, PolicyBase, TextCond, load_pipeline, resolve_dtype

FAMILIES = ("sd3", "flux")


def build_policy(family: str, path: str, *, dtype: str = "float32", device="cpu", height: int | None = None,
                 width: int | None = None, max_sequence_length: int | None = None, seed: int = 0,
                 text_encoder_device: str = "gpu", revision: str | None = None,
                 variant: str | None = None) -> PolicyBase:
    """Load the pipeline of ``family`` from ``path`` (at ``revision``, with ``variant`` weight files) and wrap it in
    its policy adapter.

    ``text_encoder_device="cpu"`` keeps the text encoders on the CPU (they never reach ``device``)."""
    from flowrl.models.flux import FluxPolicy
    from flowrl.models.sd3 import SD3Policy

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")
    policy_class = SD3Policy if family == "sd3" else FluxPolicy
    extra = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if path == "tiny":
        from flowrl.models import tiny

        pipeline = tiny.tiny_sd3_pipeline(seed) if family == "sd3" else tiny.tiny_flux_pipeline(seed)
        height, width = height or tiny.TINY_SD3_RESOLUTION, width or tiny.TINY_SD3_RESOLUTION
        extra.setdefault("max_sequence_length", tiny.TINY_T5_MAX_LENGTH)
        if resolve_dtype(dtype) != torch.float32:
            pipeline = pipeline.to(dtype=resolve_dtype(dtype))
        pipeline.set_progress_bar_config(disable=True)
    else:
        import diffusers

        pipeline_class = getattr(diffusers, policy_class.pipeline_class_name)
        check_pipeline_family(family, path, policy_class.pipeline_class_name)
        hub = {k: v for k, v in (("revision", revision), ("variant", variant)) if v is not None}  # from_pretrained's
        pipeline = load_pipeline(pipeline_class, path, torch_dtype=resolve_dtype(dtype), device="cpu", **hub)
    policy = policy_class(pipeline, height=height, width=width, **extra)
    if text_encoder_device not in ("gpu", "cpu"):
        raise ValueError(f"text_encoder_device must be 'gpu' or 'cpu', got {text_encoder_device!r}")
    policy.text_encoders_on_cpu = text_encoder_device == "cpu"
    return policy.to(device)  # loaded on the CPU first: CPU text encoders never pass through the GPU


def check_pipeline_family(family: str, path: str, expected: str) -> None:
    """A local pipeline directory of another family (``model.family=flux`` with an SD3 path) is a one-line
    error here, not an AttributeError from deep inside transformers."""
    import json
    from pathlib import Path

    index = Path(path) / "model_index.json"
    if not index.is_file():
        return  # a hub id, or a directory from_pretrained itself will reject with a clear message
    try:
        found = json.loads(index.read_text()).get("_class_name")
    except (ValueError, OSError, AttributeError):
        raise ValueError(f"model.path {path}: model_index.json is not a diffusers pipeline index") from None
    if found and found != expected:
        families = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
        hint = f"set model.family={families[found]}" if found in families else "point model.path at a matching one"
        raise ValueError(f"model.path {path} holds a {found}, but model.family={family} needs a {expected}: {hint}")


__all__ = ["FAMILIES", "Policy", "PolicyBase", "TextCond", "build_policy", "resolve_dtype"]
