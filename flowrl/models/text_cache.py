"""Prompt embeddings computed once, stored in safetensors and looked up by prompt text.

T5-XXL alone holds about 9.5 GB of bf16 weights on every GPU, yet a run only ever encodes a fixed set of
prompts (training, held-out, eval prompts and the empty negative prompt). ``model.text_cache: disk``
encodes them once, ``model.free_text_encoders`` then deletes the encoders, and ``model.text_encoder_device:
cpu`` keeps them off the accelerator altogether.

**Exactness.** A cached row is bit-identical to what :meth:`PolicyBase.encode` computes live, because both
go through the same :meth:`PolicyBase.encode_chunks`: every text-encoder call holds exactly ``TEXT_CHUNK``
prompts (a GEMM's rounding depends on its batch size, not on the other rows), and a row is stored in the
dtype the encoders produced it in. The key holds the device type the encoders run on, so a run whose
encoders sit elsewhere (CPU encoders against GPU encoders, whose kernels round differently) encodes its own rows
rather than reusing another device's.

**Key.** :func:`text_encoder_hash`: sha256 over the family, ``max_sequence_length``, ``TEXT_CHUNK``, the
encoders' device type (``cpu``, ``cuda``, ...), each
text encoder's config JSON, and for every tensor of its state dict its name, shape, dtype and 1024 values
sampled at an even stride (their raw bytes), plus each tokenizer's class, vocabulary, special tokens and
length limits. Sampling values instead of hashing every byte keeps it well under a second for T5-XXL on
any device, and is deterministic and device-independent (exact values, no float reductions). Another
checkpoint or a fine-tuned encoder changes every sampled value; the weight files' names and sizes would
not (fine-tunes keep both), and in-memory pipelines (the tiny ones) have no files. Not detected: an edit
to single weights between the sampled ones, or a library upgrade that changes the encoders' arithmetic.

**Layout.** ``model.text_cache_path`` is a directory (default ``RUN_DIR/text_cache``), shared by any runs
that name it: each fill writes one file ``<hash16>-<prompts16>.safetensors``, and files of other encoders
(another hash prefix) are ignored, so SD3 and FLUX runs can share one directory. Or it is one
``.safetensors`` file, extended by rewriting it; a file made by another text encoder is a one-line error.
Each file records the full hash and its prompts in the metadata; tensor ``<sha256(prompt)[:32]>.embeds``
``[L, D]`` and ``.pooled`` ``[P]`` per prompt, read lazily through safetensors' memory map.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

FORMAT = 1  # bump when the stored layout or the encoding path changes meaning
SAMPLES = 1024  # values sampled per tensor for the hash
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZER_NAMES = ("tokenizer", "tokenizer_2", "tokenizer_3")
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")

Encode = Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLES)
    sample = flat[::step][:SAMPLES].to("cpu").contiguous()
    return sample.view(torch.uint8).numpy().tobytes()  # raw bits: bf16 has no numpy dtype


def text_encoder_hash(pipeline, *, family: str, max_sequence_length: int, chunk: int) -> str:
    """The cache key of a pipeline's text encoders and tokenizers (64 hex digits; see the module doc)."""
    sha = hashlib.sha256()
    sha.update(json.dumps({"format": FORMAT, "family": family, "max_sequence_length": max_sequence_length,
                           "chunk": chunk, "device": encoder_device_type(pipeline)}, sort_keys=True).encode())
    for name in TEXT_ENCODER_NAMES:
        encoder = getattr(pipeline, name, None)
        sha.update(f"\n{name}:{type(encoder).__name__}".encode())
        if encoder is None:
            continue
        config = {k: v for k, v in encoder.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        sha.update(json.dumps(config, sort_keys=True, default=str).encode())
        for key, tensor in encoder.state_dict().items():
            sha.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            sha.update(_tensor_bytes(tensor))
    for name in TOKENIZER_NAMES:
        tokenizer = getattr(pipeline, name, None)
        sha.update(f"\n{name}:{type(tokenizer).__name__}".encode())
        if tokenizer is None:
            continue
        sha.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        sha.update(json.dumps({"max": tokenizer.model_max_length, "side": tokenizer.padding_side,
                               "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()}},
                              sort_keys=True).encode())
    return sha.hexdigest()


def encoder_device_type(pipeline) -> str:
    """The device type of the pipeline's first text encoder's weights (``cpu`` without any)."""
    for name in TEXT_ENCODER_NAMES:
        encoder = getattr(pipeline, name, None)
        if encoder is not None:
            return next(encoder.parameters()).device.type
    return "cpu"


def _tensor_name(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]


class TextCache:
    """Prompt -> (embeds ``[L, D]``, pooled ``[P]``) from the cache files of one text-encoder hash.

    ``write``: whether :meth:`fill` writes what it encodes (the main process); the others keep it in memory.
    """

    def __init__(self, path: str | Path, key: str, *, write: bool = True):
        self.path, self.key, self.write = Path(path), key, write
        self.single_file = self.path.suffix == ".safetensors"
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # encoded by this process
        self.index: dict[str, tuple[object, str]] = {}  # prompt -> (safetensors handle, tensor name)
        self.reload()

    def files(self) -> list[Path]:
        if self.single_file:
            return [self.path] if self.path.is_file() else []
        return sorted(self.path.glob(f"{self.key[:16]}-*.safetensors")) if self.path.is_dir() else []

    def reload(self) -> None:
        """Index every cache file of this key (one-line error for a file of another text encoder)."""
        from safetensors import safe_open

        self.index = {}
        for file in self.files():
            handle = safe_open(str(file), framework="pt")
            meta = handle.metadata() or {}
            theirs = meta.get("flowrl.text_encoder_hash", "none")
            if theirs != self.key:
                raise ValueError(f"text cache {file} holds embeddings of text encoders {theirs[:16]}, this model's are "
                                 f"{self.key[:16]}: delete the file or point model.text_cache_path elsewhere")
            for prompt in json.loads(meta["flowrl.prompts"]):
                self.index[prompt] = (handle, _tensor_name(prompt))

    def __contains__(self, prompt: str) -> bool:
        return prompt in self.rows or prompt in self.index

    def __len__(self) -> int:
        return len(self.rows.keys() | self.index.keys())

    def missing(self, prompts: Sequence[str]) -> list[str]:
        return [p for p in dict.fromkeys(prompts) if p not in self]

    def row(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        if prompt in self.rows:
            return self.rows[prompt]
        handle, name = self.index[prompt]
        return handle.get_tensor(f"{name}.embeds"), handle.get_tensor(f"{name}.pooled")

    def lookup(self, prompts: Sequence[str], *, encode: Encode | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds ``[B, L, D]``, pooled ``[B, P]``) of ``prompts`` on ``device``. An uncached prompt is encoded
        with ``encode`` (kept in memory); with the encoders freed (``encode`` None) it is a one-line error."""
        missing = self.missing(prompts)
        if missing and encode is None:
            raise ValueError(f"prompt {missing[0]!r} is not in the text cache ({self.path}) and model.free_text_encoders "
                           "deleted the text encoders: add it to data.prompts, data.test_prompts or data.eval_prompts, "
                           "or set model.free_text_encoders=false")
        if missing:
            self.add(missing, *encode(missing))
        rows = [self.row(p) for p in prompts]
        return (torch.stack([e for e, _ in rows]).to(device), torch.stack([p for _, p in rows]).to(device))

    def add(self, prompts: Sequence[str], embeds: torch.Tensor, pooled: torch.Tensor) -> None:
        for i, prompt in enumerate(prompts):
            self.rows[prompt] = (embeds[i].detach().to("cpu").clone(), pooled[i].detach().to("cpu").clone())

    def fill(self, prompts: Sequence[str], encode: Encode) -> int:
        """Encode the prompts not cached yet (``encode`` batches them) and, with ``write``, store them.
        Returns how many were encoded."""
        missing = self.missing(prompts)
        if not missing:
            return 0
        self.add(missing, *encode(missing))
        if self.write:
            self.save(missing)
        return len(missing)

    def save(self, new: list[str]) -> None:
        """Directory: one new file holding ``new``. Single file: the file rewritten with everything cached."""
        from safetensors.torch import save_file

        prompts = sorted(self.rows.keys() | self.index.keys()) if self.single_file else new
        tensors = {}
        for prompt in prompts:
            embeds, pooled = self.row(prompt)
            name = _tensor_name(prompt)
            tensors[f"{name}.embeds"], tensors[f"{name}.pooled"] = embeds.contiguous(), pooled.contiguous()
        if self.single_file:
            target = self.path
        else:
            digest = hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()[:16]
            target = self.path / f"{self.key[:16]}-{digest}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # not matched by the glob above
        save_file(tensors, str(tmp), metadata={"flowrl.text_encoder_hash": self.key, "flowrl.format": str(FORMAT),
                                               "flowrl.prompts": json.dumps(prompts)})
        os.replace(tmp, target)  # atomic: runs sharing the directory never read a partial file


def attach_text_cache(policy, path: str | Path, prompts: Sequence[str], *, write: bool = True,
                      free: bool = False) -> TextCache:
    """Cache ``prompts`` and the negative prompt (``policy.negative_prompt``) for ``policy`` (encoding only those not on disk yet,
    ``TEXT_CHUNK`` per call), make ``policy.encode`` look them up, and with ``free`` delete its text encoders."""
    from flowrl.models.base import TEXT_CHUNK

    key = text_encoder_hash(policy.pipeline, family=policy.family, max_sequence_length=policy.max_sequence_length,
                            chunk=TEXT_CHUNK)
    cache = TextCache(path, key, write=write)
    cache.fill([*prompts, policy.negative_prompt], policy.encode_chunks)
    policy.text_cache = cache
    if free:
        policy.free_text_encoders()
    return cache


def attach_configured_cache(policy, model, run_dir: str | Path, prompts: Sequence[str], *,
                            write: bool = True) -> TextCache | None:
    """``model.text_cache: disk`` (a :class:`flowrl.config.ModelConfig`) for training, ``flowrl sample`` and
    ``flowrl eval`` alike: the cache at ``model.text_cache_path`` (default ``RUN_DIR/text_cache``) filled with
    ``prompts``, the encoders freed after with ``model.free_text_encoders``; None without a cache."""
    if model.text_cache != "disk":
        return None
    return attach_text_cache(policy, model.text_cache_path or Path(run_dir) / "text_cache", prompts, write=write,
                             free=model.free_text_encoders)
