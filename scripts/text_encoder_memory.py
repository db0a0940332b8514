"""GPU memory that ``model.text_cache=disk`` + ``model.free_text_encoders=true`` (or
``model.text_encoder_device=cpu``) saves on every GPU, by arithmetic.

Counts the parameters of the text encoders of the tiny pipelines (built, so their counts are exact) and of
the published SD3.5-Medium and FLUX.1-dev text encoders, instantiated from the architecture configs in
``configs/models/*_text_encoders.json`` on the ``meta`` device (no memory allocated, nothing downloaded),
and prints the bytes their weights take in bf16: what each GPU no longer holds. Also the size of one
cached prompt (embeddings in bf16), which the cache keeps on disk instead. Activations of the encoding
pass itself are not counted.

    .venv/bin/python scripts/text_encoder_memory.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

PUBLISHED = {"sd3": ("SD3.5-Medium", ROOT / "configs/models/sd35_medium_text_encoders.json", 256),
             "flux": ("FLUX.1-dev", ROOT / "configs/models/flux1_dev_text_encoders.json", 512)}
CLIP_TOKENS = 77


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() lists a tied tensor once


def published_encoders(path: Path) -> dict[str, tuple[str, int, int]]:
    """{component: (class, parameters, output width)} of the encoders described in ``path``."""
    import transformers
    from accelerate import init_empty_weights

    spec = json.loads(path.read_text())
    out = {}
    for name, entry in spec.items():
        if name.startswith("_"):
            continue
        model_class = getattr(transformers, entry["class"])
        config = model_class.config_class(**entry["config"])
        with init_empty_weights():
            model = model_class(config)
        model.tie_weights()  # as from_pretrained does: init_empty_weights leaves T5's shared/embed_tokens untied
        assert all(p.device.type == "meta" for p in model.parameters())
        width = entry["config"].get("d_model") or entry["config"]["hidden_size"]
        out[name] = (entry["class"], count(model), width)
    return out


def prompt_bytes(family: str, encoders: dict, t5_tokens: int) -> int:
    """bf16 bytes of one cached prompt: the sequence embedding [L, D] and the pooled one [P]."""
    t5_width = encoders["text_encoder_3" if family == "sd3" else "text_encoder_2"][2]
    if family == "sd3":  # CLIP-L + CLIP-G hidden states side by side, zero-padded to T5's width, then T5's tokens
        pooled = encoders["text_encoder"][2] + encoders["text_encoder_2"][2]
        return 2 * ((CLIP_TOKENS + t5_tokens) * t5_width + pooled)
    return 2 * (t5_tokens * t5_width + encoders["text_encoder"][2])


def main() -> None:
    from flowrl.models import tiny

    rows = []
    for family, (label, path, t5_tokens) in PUBLISHED.items():
        pipeline = tiny.tiny_sd3_pipeline(0) if family == "sd3" else tiny.tiny_flux_pipeline(0)
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        tiny_counts = {n: count(getattr(pipeline, n)) for n in names if getattr(pipeline, n, None) is not None}
        published = published_encoders(path)
        for name, (cls, params, _) in published.items():
            rows.append((label, name, cls, tiny_counts.get(name, 0), params))
        total = sum(p for _, p, _ in published.values())
        rows.append((label, "all text encoders", "", sum(tiny_counts.values()), total))
        rows.append((label, f"one cached prompt (T5 {t5_tokens} tokens)", "", None,
                     prompt_bytes(family, published, t5_tokens) / 2))

    print(f"{'model':<13} {'component':<34} {'class':<28} {'tiny params':>12} {'params':>15} {'bf16 / GPU':>11}")
    for label, name, cls, tiny_params, params in rows:
        tiny_text = "" if tiny_params is None else f"{tiny_params:,}"
        size = 2 * params
        size_text = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
        params_text = "" if name.startswith("one cached") else f"{int(params):,}"
        print(f"{label:<13} {name:<34} {cls:<28} {tiny_text:>12} {params_text:>15} {size_text:>11}")
    print("Saved per GPU by text_cache=disk + free_text_encoders=true (or text_encoder_device=cpu): the "
          "'all text encoders' rows; the cache costs the 'one cached prompt' row per prompt, on disk.")


if __name__ == "__main__":
    main()
