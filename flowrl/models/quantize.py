"""A quantised frozen base under the LoRA (``model.quantize``): QLoRA-style training on small GPUs.

Only the transformer is quantised, and only its frozen base weights: the LoRA that peft attaches on top
(``TorchaoLoraLinear`` over torchao weights, ``lora.Linear4bit`` over bitsandbytes ones) stays in float32 and
trains, and the reference policy (adapter off) is the same quantised model. flowrl writes no quantisation code:

| scheme | library | base weight | runs on |
| --- | --- | --- | --- |
| ``int8`` | torchao ``Int8WeightOnlyConfig`` | int8 per output channel + one scale per row | CPU and CUDA |
| ``fp8`` | torchao ``Float8WeightOnlyConfig`` | float8 e4m3 per output channel + one scale per row | CUDA, compute capability >= 8.9 |
| ``nf4`` | bitsandbytes NF4 (``BitsAndBytesConfig``) | 4-bit NormalFloat, an 8-bit absmax per 64 (double quant.) | CUDA |

A hub or local pipeline is quantised as it loads, shard by shard (diffusers' ``PipelineQuantizationConfig``,
so the full-precision transformer never sits on the GPU); a tiny pipeline built in code goes through the
same ``from_pretrained(quantization_config=...)`` of its transformer class from a temporary directory.
A scheme that cannot run here (no CUDA, no package, an older GPU) is one line before anything loads. Under DDP
the quantised weights are kept out of DDP's broadcast (they are frozen and the same on every rank); FSDP2 and
DeepSpeed cannot shard them and are refused (:func:`flowrl.recipes.build.check_memory_options`).
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile

import torch

from flowrl.core.devices import resolve_device

# With torchao installed, importing it or any diffusers model logs three lines a flowrl user can do nothing about:
# torchao 0.18 registers two enums with torch's pytree the way torch 2.14 deprecates, and diffusers 0.42 cannot
# import the tensor classes of torchao < 0.16 (for checkpoints saved quantised, which flowrl never loads). A
# command's error is one line, so these two loggers keep to errors.
for _name in ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)

QUANT_SCHEMES = ("none", "int8", "nf4", "fp8")
QUANT_EXTRA = "pip install 'flowrl[quant]'"


def check_quantize(scheme: str, device) -> None:
    """Raise a one-line ValueError where ``scheme`` cannot run on ``device`` (a torch device or its name)."""
    if scheme == "none":
        return
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"model.quantize: unknown scheme {scheme!r}; choose one of {', '.join(QUANT_SCHEMES)}")
    device = resolve_device(device)  # "auto" too
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if scheme == "nf4":
        if not on_cuda:
            raise ValueError("model.quantize=nf4 needs a CUDA GPU (bitsandbytes' 4-bit kernels) and this run is on "
                             f"{device.type}; use model.quantize=int8, which also runs on the CPU")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("model.quantize=nf4 needs bitsandbytes, which is not installed: pip install bitsandbytes "
                             "(or use model.quantize=int8)")
        return
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"model.quantize={scheme} needs torchao, which is not installed: {QUANT_EXTRA}")
    if scheme == "fp8":
        if not on_cuda:
            raise ValueError("model.quantize=fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper) and this "
                             f"run is on {device.type}; use model.quantize=int8")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"model.quantize=fp8 needs compute capability >= 8.9 (Ada, Hopper); this GPU has "
                             f"{capability[0]}.{capability[1]}: use model.quantize=int8 or nf4")


def transformer_quantization(scheme: str, dtype: torch.dtype):
    """The diffusers quantisation config of the transformer under ``scheme`` (compute in ``dtype``)."""
    if scheme == "nf4":
        from diffusers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)
    from diffusers import TorchAoConfig
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return TorchAoConfig({"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[scheme]())


def pipeline_quantization(scheme: str, dtype: torch.dtype):
    """``quantization_config`` for a pipeline's ``from_pretrained``: the transformer alone (None for none)."""
    if scheme == "none":
        return None
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping={"transformer": transformer_quantization(scheme, dtype)})


def quantize_pipeline(pipeline, scheme: str, device) -> None:
    """Quantise the transformer of a pipeline built in code (the tiny ones) in place of the pipeline.

    It round-trips through ``save_pretrained`` / ``from_pretrained(quantization_config=...)`` of its own class:
    the path a loaded model takes, so tiny runs test what real ones run. bitsandbytes quantises as the weights
    reach the GPU, so nf4 loads onto ``device``."""
    if scheme == "none":
        return
    transformer = pipeline.transformer
    dtype = transformer.dtype
    placement = {"device_map": str(resolve_device(device))} if scheme == "nf4" else {}
    from diffusers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # diffusers warns that int8 wants bfloat16: the tiny models run in float32 on CPUs
    try:
        with tempfile.TemporaryDirectory(prefix="flowrl-quantize-") as folder:
            transformer.save_pretrained(folder)
            quantized = type(transformer).from_pretrained(folder, quantization_config=transformer_quantization(
                scheme, dtype), dtype=dtype, **placement)
    finally:
        logging.set_verbosity(verbosity)
    pipeline.register_modules(transformer=quantized)


def quantized_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{``param_name.inner``: plain tensor} for every quantised weight of ``module``: the integer (or float8)
    data and scales inside torchao's tensor subclasses, and bitsandbytes' packed 4-bit data with its absmax
    (``quant_state``), so a test can check that training left them unchanged bit for bit."""
    found: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        data = param.data if type(param) is torch.nn.Parameter else param
        if hasattr(data, "__tensor_flatten__"):  # torchao: Int8Tensor(qdata, scale), Float8Tensor(qdata, scale)
            for inner in data.__tensor_flatten__()[0]:
                found[f"{name}.{inner}"] = getattr(data, inner)
        elif getattr(param, "quant_state", None) is not None:  # bitsandbytes Params4bit
            found[f"{name}.packed"] = param.data
            found[f"{name}.absmax"] = param.quant_state.absmax
    return found


def quantized_parameter_names(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s quantised parameters (torchao subclasses, bitsandbytes 4-bit)."""
    return sorted({name.rsplit(".", 1)[0] for name in quantized_tensors(module)})


def ignore_quantized_in_ddp(module: torch.nn.Module) -> None:
    """Have DDP leave the quantised base weights alone when it wraps ``module``.

    DDP broadcasts every parameter from rank 0 as it wraps a module, and torchao's quantised tensors implement no
    ``view`` for that; the weights are frozen and the same on every rank (the same file, quantised the same way),
    so there is nothing to synchronise. torch's documented hook for parameters DDP must not touch is this one."""
    names = quantized_parameter_names(module)
    if names:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether any weight of ``module`` is a quantised one (torchao subclass or bitsandbytes 4-bit)."""
    return bool(quantized_tensors(module))
