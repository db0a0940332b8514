"""Shared plumbing for rewards that ask a vision-language model (VLM) about an image.

Why one module: the checklist, yes/no and likelihood rewards all need the same three things --
load any chat-template VLM (`AutoModelForImageTextToText` + `AutoProcessor`, e.g.
"Qwen/Qwen2.5-VL-7B-Instruct"), turn (image, question[, answer]) pairs into one left-padded batch,
and read logits from ONE forward pass per chunk (no generation). Keeping it here means every
VLM reward batches, pads and masks the same way, and a fix lands once.

Left padding puts every row's last real token at position -1, so next-token logits are
``logits[:, -1]`` for the whole batch, and an answer appended to the prompt is the row's suffix.
Models with rotary / multimodal positions (Qwen2-VL's M-RoPE) derive positions from the attention
mask, so a padded row scores the same as the same row alone (the tests hold this to 1e-5).
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from flowrl.core.devices import resolve_device, resolve_dtype

DEFAULT_VLM = "Qwen/Qwen2.5-VL-7B-Instruct"



def _one_line(text: Any, limit: int = 300) -> str:
    s = re.sub(r"\s+", " ", str(text)).strip()
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ------------------------------------------------------------------------------------ loading

def _has_chat_template(processor: Any) -> bool:
    tokenizer = getattr(processor, "tokenizer", None)
    return bool(getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None))


def resolve_vlm(model: Any = DEFAULT_VLM, processor: Any = None, *, device: str | torch.device | None = "auto",
                dtype: str | torch.dtype | None = None, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """-> (model in eval mode without grads, processor).

    ``model`` is a hub id or local path (loaded with the Auto classes; dtype and device resolved by
    `flowrl.core.devices`), or an already-built model, in which case ``processor`` must be given too
    (tests inject tiny models this way; a caller may share one loaded VLM between rewards).
    ``trust_remote_code`` is passed through and never turned on here. Failures are one-line
    ValueErrors naming the model.
    """
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        name = str(model)
        dev = resolve_device(device)
        try:
            from transformers import AutoModelForImageTextToText, AutoProcessor
            if processor is None:
                processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
            model = AutoModelForImageTextToText.from_pretrained(
                name, dtype=resolve_dtype(dtype, dev), trust_remote_code=trust_remote_code).to(dev)
        except Exception as err:  # OSError (offline, bad path), ValueError (unsupported architecture), ...
            raise ValueError(f"cannot load VLM '{name}': {type(err).__name__}: {_one_line(err)}") from err
    else:
        name = type(model).__name__
        if processor is None:
            raise ValueError(f"a built VLM model ({name}) needs its processor: pass processor=...")
    if getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"VLM '{name}': processor {type(processor).__name__} has no tokenizer")
    if not _has_chat_template(processor):
        raise ValueError(f"VLM '{name}': processor has no chat template; use an instruct/chat model "
                         "or set processor.chat_template")
    model.eval().requires_grad_(False)
    return model, processor


def input_device(model: Any) -> torch.device:
    """Where inputs go: the token embedding's device (right for device_map-sharded models too)."""
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(model.parameters()).device


# ------------------------------------------------------------------------------------- images

def images_to_pil(images: torch.Tensor) -> tuple[list[Image.Image], torch.Tensor]:
    """[N,3,H,W] float in [0,1] -> (N RGB uint8 PIL images, finite [N] bool).

    PIL uint8 is what VLM image processors were trained on (they rescale 0..255 themselves).
    Non-finite pixels are zeroed for conversion; callers score those rows NaN via ``finite``.
    """
    x = images.detach().to("cpu", torch.float32)  # [N, 3, H, W]
    finite = torch.isfinite(x).flatten(1).all(1)  # [N]
    u8 = (torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1) * 255).round().to(torch.uint8)
    arrs = u8.permute(0, 2, 3, 1).contiguous().numpy()  # [N, H, W, 3]
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arrs], finite


def _as_pil_list(images: Any) -> list[Image.Image]:
    if isinstance(images, torch.Tensor):
        return images_to_pil(images)[0]
    return list(images)


# ------------------------------------------------------------------------------------ batching

def chat_prompts(processor: Any, questions: Sequence[str]) -> list[str]:
    """One user turn (image, then question) per row, rendered up to the assistant's first token."""
    conversations = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
                     for q in questions]
    texts = processor.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    return [texts] if isinstance(texts, str) else list(texts)


def encode(processor: Any, images: Sequence[Image.Image], texts: Sequence[str], device: torch.device,
           dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Processor -> left-padded model inputs on ``device`` (floating inputs cast to ``dtype``).

    add_special_tokens=False: the chat template already renders BOS/role tokens, as in
    ``apply_chat_template(tokenize=True)``; adding them again would double a BOS.
    """
    tokenizer = processor.tokenizer
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = processor(text=list(texts), images=list(images), padding=True, add_special_tokens=False,
                        return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    if not bool(enc["attention_mask"][:, -1].all()):
        raise RuntimeError(f"{type(processor).__name__} did not left-pad the batch; cannot read last-token logits")
    out = {}
    for key, value in enc.items():
        if isinstance(value, torch.Tensor):
            cast = dtype if (dtype is not None and value.is_floating_point()) else None
            value = value.to(device=device, dtype=cast)
        out[key] = value
    return out


def _model_dtype(model: Any) -> torch.dtype | None:
    return getattr(model, "dtype", None)


def _forward_logits(model: Any, inputs: dict[str, torch.Tensor], keep: int) -> torch.Tensor:
    """ONE forward -> float32 logits of the last ``keep`` positions [B, keep, V].

    Uses ``logits_to_keep`` where the model accepts it, so a 150k-word vocabulary is projected
    for the few positions we read, not the whole (image-heavy) sequence.
    """
    kwargs: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = keep
    logits = model(**inputs, **kwargs).logits  # [B, L or keep, V]
    return logits[:, -keep:].float()


def _chunks(m: int, batch_size: int) -> list[slice]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [slice(s, min(s + batch_size, m)) for s in range(0, m, batch_size)]


def _check_pairs(images: list, texts: Sequence[str], what: str) -> None:
    if len(images) != len(texts):
        raise ValueError(f"got {len(images)} images but {len(texts)} {what}")


@torch.no_grad()
def next_token_logits(model: Any, processor: Any, images: Any, questions: Sequence[str],
                      batch_size: int = 8, token_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Logits of the assistant's first answer token, one forward per chunk of pairs.

    ``images``: [M,3,H,W] float in [0,1] or M PIL images, paired with ``questions`` [M].

    -> CPU float32 [M, V], or [M, len(token_ids)] when ``token_ids`` picks columns (keeps
    memory at M x 2 instead of M x vocabulary for yes/no scoring).
    """
    pils = _as_pil_list(images)
    _check_pairs(pils, questions, "questions")
    texts = chat_prompts(processor, questions) if questions else []
    device, dtype = input_device(model), _model_dtype(model)
    cols = None if token_ids is None else torch.as_tensor(list(token_ids), dtype=torch.long)
    parts = []
    for sl in _chunks(len(pils), batch_size):
        inputs = encode(processor, pils[sl], texts[sl], device, dtype)
        last = _forward_logits(model, inputs, 1)[:, -1]  # [B, V]
        parts.append((last if cols is None else last[:, cols.to(last.device)]).cpu())
    return torch.cat(parts) if parts else torch.zeros(0, 0 if cols is None else len(cols))


# ------------------------------------------------------------------------------------- yes / no

def single_token_id(tokenizer: Any, word: str) -> int:
    """Id of the token that starts an answer ``word``.

    Choice: try ``word`` as written first, then with a leading space, and take the first spelling
    that is ONE token. Chat templates end the generation prompt with a newline, so the answer's
    first token carries no leading space: in byte-level BPE (Qwen, GPT-style) "Yes" and " Yes"
    ("ĠYes") are different ids and the model emits "Yes" there. SentencePiece tokenizers (Llama)
    encode "Yes" as "▁Yes", which is also their answer-start token. The leading-space spelling is
    the fallback for vocabularies that only hold that one.
    """
    for spelling in (word, " " + word):
        ids = tokenizer.encode(spelling, add_special_tokens=False)
        if len(ids) == 1:
            return int(ids[0])
    raise ValueError(f"answer word {word!r} is not a single token for {type(tokenizer).__name__} "
                     f"(encodes to {tokenizer.encode(word, add_special_tokens=False)}); pick another word")


def yes_no_token_ids(tokenizer: Any, yes: str = "Yes", no: str = "No") -> tuple[int, int]:
    """(yes id, no id); a one-line ValueError if they coincide or are not single tokens."""
    ids = single_token_id(tokenizer, yes), single_token_id(tokenizer, no)
    if ids[0] == ids[1]:
        raise ValueError(f"answer words {yes!r} and {no!r} map to the same token id {ids[0]}")
    return ids


@torch.no_grad()
def yes_probability(model: Any, processor: Any, images: Any, questions: Sequence[str], batch_size: int = 8,
                    yes: str = "Yes", no: str = "No") -> torch.Tensor:
    """P(yes) per (image, question) pair -> CPU float32 [M] in [0, 1].

    Softmax over just the two answer logits, i.e. sigmoid(logit_yes - logit_no): the model's
    preference between the two answers, ignoring mass it puts on other tokens (a chatty "Sure").
    """
    ids = yes_no_token_ids(processor.tokenizer, yes, no)
    two = next_token_logits(model, processor, images, questions, batch_size, token_ids=ids)  # [M, 2]
    return two.softmax(-1)[:, 0] if two.numel() else torch.zeros(0)


# ---------------------------------------------------------------------------------- likelihood

def _answer_lengths(tokenizer: Any, prompts: Sequence[str], texts: Sequence[str]) -> list[int]:
    """Tokens that ``prompt + text`` has beyond its longest common prefix with ``prompt`` alone.

    Counting against the joint tokenization (not ``text`` alone) stays exact when a tokenizer
    merges across the boundary; image placeholders expand identically in both, so the count
    holds for the processor's expanded ids, where the answer is the row's suffix (left padding).
    """
    lengths = []
    for prompt, text in zip(prompts, texts):
        a = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        b = tokenizer(prompt + text, add_special_tokens=False)["input_ids"]
        common = 0
        for x, y in zip(a, b):
            if x != y:
                break
            common += 1
        lengths.append(len(b) - common)
    return lengths


@torch.no_grad()
def text_log_likelihood(model: Any, processor: Any, images: Any, texts: Sequence[str],
                        prompt_template: str | Sequence[str] = "Describe this image.",
                        batch_size: int = 8) -> torch.Tensor:
    """Mean per-token log-prob of ``texts`` as the assistant's answer -> CPU float32 [M].

    = minus the token cross-entropy of the answer given image + instruction. The instruction
    (``prompt_template``: one string, or one per pair) is the user turn; its tokens, the image
    tokens and padding are masked out; only answer tokens count. The mean (not the sum) keeps
    long and short texts on one scale. Computed from the logits of one forward per chunk, in
    float32. An empty answer has no tokens: NaN (could not score).
    """
    pils = _as_pil_list(images)
    _check_pairs(pils, texts, "texts")
    questions = [prompt_template] * len(texts) if isinstance(prompt_template, str) else list(prompt_template)
    _check_pairs(pils, questions, "prompt_template entries")
    prompts = chat_prompts(processor, questions) if texts else []
    lengths = _answer_lengths(processor.tokenizer, prompts, texts)
    device, dtype = input_device(model), _model_dtype(model)
    parts = []
    for sl in _chunks(len(pils), batch_size):
        k = torch.tensor(lengths[sl])  # [B] answer tokens per row
        full = [p + t for p, t in zip(prompts[sl], texts[sl])]
        inputs = encode(processor, pils[sl], full, device, dtype)
        ids = inputs["input_ids"]  # [B, L]
        kmax = int(k.max()) if int(k.max()) > 0 else 1
        if kmax >= ids.shape[1]:
            raise RuntimeError(f"answer of {kmax} tokens does not fit a sequence of {ids.shape[1]}")
        logits = _forward_logits(model, inputs, kmax + 1)[:, :-1]  # [B, kmax, V] predicting the last kmax
        target = ids[:, -kmax:]  # [B, kmax]
        logp = logits.log_softmax(-1).gather(-1, target.unsqueeze(-1).to(logits.device)).squeeze(-1).cpu()
        mask = torch.arange(kmax).flip(0).unsqueeze(0) < k.unsqueeze(1)  # [B, kmax]: last k[b] positions
        total = torch.where(mask, logp, torch.zeros_like(logp)).sum(1)  # [B]; where, not *: pads may be NaN
        parts.append(torch.where(k > 0, total / k.clamp_min(1), torch.full_like(total, float("nan"))))
    return torch.cat(parts) if parts else torch.zeros(0)
