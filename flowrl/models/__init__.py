"""Model families behind one Policy adapter (each with an offline tiny variant for tests and smoke runs).

``build_policy`` takes flat arguments; ``path="tiny"`` builds the offline tiny pipeline of the
family, anything else is a hub id or a local diffusers directory. A family is one entry of
``FAMILY_CLASSES`` (:mod:`flowrl.models.families`): its config name -> the module and class of its adapter
(imported on use, so a family's diffusers classes load only when it is picked).
"""

from __future__ import annotations

from flowrl.models.base import (
    Policy, PolicyBase, TextCond, cast_components, component_dtypes, load_pipeline, resolve_dtype,
)
from flowrl.models.families import FAMILIES, FAMILY_CLASSES, PIPELINE_FAMILIES, policy_class
from flowrl.models.quantize import check_quantize, pipeline_quantization, quantize_pipeline


def build_policy(family: str, path: str, *, dtype: str = "float32", device="cpu", height: int | None = None,
                 width: int | None = None, max_sequence_length: int | None = None, seed: int = 0,
                 text_encoder_device: str = "gpu", revision: str | None = None,
                 variant: str | None = None, num_frames: int | None = None, negative_prompt: str = "",
                 quantize: str = "none", text_encoder_dtype: str | None = None,
                 vae_dtype: str | None = None, guidance_scale_2: float | None = None) -> PolicyBase:
    """Load the pipeline of ``family`` from ``path`` (at ``revision``, with ``variant`` weight files) and wrap it in
    its policy adapter.

    ``dtype`` places the transformer, and the text encoders and the VAE unless ``text_encoder_dtype`` /
    ``vae_dtype`` place them otherwise (:func:`~flowrl.models.base.component_dtypes`); embeddings of text
    encoders in another dtype are cast to the transformer's.

    ``text_encoder_device="cpu"`` keeps the text encoders on the CPU (they never reach ``device``).
    ``num_frames`` (video families) is the clip length; ``negative_prompt`` the CFG negative of every prompt.
    ``quantize`` (none | int8 | nf4 | fp8) quantises the frozen transformer (:mod:`flowrl.models.quantize`); a
    scheme this machine cannot run is one line before anything loads. ``guidance_scale_2`` is the low-noise expert's
    CFG scale of a two-expert family (wan22_t2v, wan22_i2v)."""
    cls = policy_class(family)
    check_quantize(quantize, device)
    dtypes = component_dtypes(dtype, text_encoder_dtype=text_encoder_dtype, vae_dtype=vae_dtype)
    extra = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if num_frames is not None:
        if not cls.video:
            video = [name for name in FAMILIES if policy_class(name).video]
            raise ValueError(f"model.num_frames is for video families ({', '.join(video)}); {family} makes "
                             "images: remove it")
        extra["num_frames"] = num_frames
    if guidance_scale_2 is not None:
        if not getattr(cls, "two_experts", False):
            raise ValueError(f"model.guidance_scale_2 is for two-expert families (wan22_t2v, wan22_i2v); {family} "
                             "has one transformer: remove it")
        extra["guidance_scale_2"] = guidance_scale_2
    if path == "tiny":
        pipeline = cls.tiny_pipeline(seed)
        height, width = height or cls.tiny_size[0], width or cls.tiny_size[1]
        extra.setdefault("max_sequence_length", cls.tiny_max_sequence_length)
        cast_components(pipeline, dtypes)  # built in float32
        quantize_pipeline(pipeline, quantize, device)  # built in code, so quantised after the build
        pipeline.set_progress_bar_config(disable=True)
    else:
        import diffusers

        pipeline_class = getattr(diffusers, cls.pipeline_class_name)
        check_pipeline_family(family, path, cls.pipeline_class_name)
        hub = {k: v for k, v in (("revision", revision), ("variant", variant),
                                 ("quantization_config", pipeline_quantization(quantize, resolve_dtype(dtype))))
               if v is not None}  # from_pretrained's
        pipeline = load_pipeline(pipeline_class, path, dtype=dtypes if len(dtypes) > 1 else dtypes["default"],
                                 device="cpu", **hub)
    policy = cls(pipeline, height=height, width=width, **extra)
    if dtypes.get("text_encoder", dtypes["default"]) != dtypes["default"]:
        policy.cond_dtype = dtypes["default"]
    if text_encoder_device not in ("gpu", "cpu"):
        raise ValueError(f"text_encoder_device must be 'gpu' or 'cpu', got {text_encoder_device!r}")
    policy.text_encoders_on_cpu = text_encoder_device == "cpu"
    policy.negative_prompt = negative_prompt
    return policy.to(device)  # loaded on the CPU first: CPU text encoders never pass through the GPU


def policy_from_config(model, *, device="cpu", seed: int = 0) -> PolicyBase:
    """:func:`build_policy` with every field of a ``ModelConfig`` (``cfg.model``): the one way train, eval and
    sample load a model, so that all of them honour the same settings."""
    return build_policy(model.family, model.path, dtype=model.dtype, device=device, height=model.height,
                        width=model.width, max_sequence_length=model.max_sequence_length, seed=seed,
                        text_encoder_device=model.text_encoder_device, revision=model.revision, variant=model.variant,
                        num_frames=model.num_frames, negative_prompt=model.negative_prompt, quantize=model.quantize,
                        text_encoder_dtype=model.text_encoder_dtype, vae_dtype=model.vae_dtype,
                        guidance_scale_2=model.guidance_scale_2)


def check_pipeline_family(family: str, path: str, expected: str) -> None:
    """A local pipeline directory of another family (``model.family=flux`` with an SD3 path) is a one-line
    error here, not an AttributeError from deep inside transformers."""
    import json
    from pathlib import Path

    index = Path(path) / "model_index.json"
    if not index.is_file():
        return  # a hub id, or a directory from_pretrained itself will reject with a clear message
    try:
        config = json.loads(index.read_text())
        found = config.get("_class_name")
    except (ValueError, OSError, AttributeError):
        raise ValueError(f"model.path {path}: model_index.json is not a diffusers pipeline index") from None
    if found and found != expected:
        hint = (f"set model.family={PIPELINE_FAMILIES[found]}" if found in PIPELINE_FAMILIES
                else "point model.path at a matching one")
        raise ValueError(f"model.path {path} holds a {found}, but model.family={family} needs a {expected}: {hint}")
    mismatch = policy_class(family).index_mismatch(config) if family in FAMILY_CLASSES else None
    if mismatch:
        raise ValueError(f"model.path {path} is a {found or expected}, but not model.family={family}'s: {mismatch}")


__all__ = ["FAMILIES", "FAMILY_CLASSES", "Policy", "PolicyBase", "TextCond", "build_policy", "policy_class",
           "policy_from_config", "resolve_dtype"]
