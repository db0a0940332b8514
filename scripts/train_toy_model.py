"""Train the tiny pretrained toy-world flow models shipped in ``assets/toy_clean/`` and ``assets/toy/``.

What: a real ``StableDiffusion3Pipeline`` (MMDiT ``SD3Transformer2DModel``, ``AutoencoderKL``,
two CLIP text encoders, the offline CLIP BPE tokenizer, ``FlowMatchEulerDiscreteScheduler``;
the T5 slot holds a 1-layer stand-in whose output is exactly zero, see ``make_null_t5``) trained
from scratch with rectified flow matching on 32 px renders of the toy world (``flowrl.toy.world``)
for every prompt of the grammar (``flowrl.toy.prompts.all_prompts``): every binding and every pair is in
pre-training, and RL holds whole prompts out (``flowrl.toy.prompts.split``), as GenEval's prompts are held out
from the RL that reports on them.

Why: the RL loop needs a *pretrained* base model that is cheap (a 64-image CFG rollout in ~1.5 s on 2 CPU
cores) and whose failures RL can fix on prompts it was never rewarded on. Two runs make it: the clean model
(faithful captions, ``assets/toy_clean``: the instrument's ceiling) and the base (the clean model fine-tuned on
noisy captions with ``--init-from`` and ``--caption-noise``, ``assets/toy``), whose failures are choices
(a swapped colour, a count off by one, a flipped relation, a missing object).

Stages (each cached under ``--work-dir``, so a rerun resumes where it stopped):
  1. data:  render ``--n-images`` scenes (task-balanced over the train split, seeded) -> data.pt
  2. vae:   (``--vae-from DIR`` reuses a trained pipeline's VAE when only the flow changes)
            train a small AutoencoderKL (32x32x3 -> 16x16x4, channels (32, 32), 0.8 MB;
            MSE + L1 + 1e-5 KL) -> vae.pt, then freeze it and set scaling_factor = 1/std,
            shift_factor = mean of the latents (SD3). The VAE must reconstruct held-out renders to
            ToyEval strict >= 0.9 (``--min-vae-recon``), else the script stops: a VAE that rounds
            the corners of 6-10 px shapes caps every flow model built on it.
  3. flow:  train the transformer and both CLIP encoders jointly with rectified flow matching
            (x_t = (1-t) x0 + t eps, target eps - x0, timestep = 1000 t, logit-normal t), 10% empty
            prompts for classifier-free guidance, EMA of the weights; checkpoints ckpt.pt every
            ``--ckpt-every`` steps (resumable), EMA pipeline exported to ``--out`` at every checkpoint
  4. eval:  ToyEval strict / partial on task-stratified held-out and train prompts.

Text encoders are random-init CLIPs trained jointly with the transformer: frozen random CLIPs
of width 16/32 give tiny (init std 0.02), entangled token features; training them costs almost
nothing (16 tokens, 2 layers) and lets colours, shapes, numbers and relations separate.

The T5 stream carries no information: the prompt embeddings end in ``max_sequence_length`` zero
tokens (256 by default in diffusers and in flowrl's SD3Policy). Training draws that padding
length at random (1 on 90% of steps, else 1..64: ``--pad-random``) so the model tolerates other
paddings; sample with
``max_sequence_length=1`` (fastest; the T5 tokenizer cannot pad to 0; it is what the RL loop
should pass to ``build_policy(..., max_sequence_length=1)``).

Sampling defaults (documented, the pipeline's call signature cannot store them):
    pipe(prompts, num_inference_steps=10, guidance_scale=3.0, max_sequence_length=1,
         height=32, width=32, output_type="pt")

Commands (2 CPU threads):
    .venv/bin/python scripts/train_toy_model.py --work-dir runs/toy_model --out assets/toy_clean
    .venv/bin/python scripts/train_toy_model.py --work-dir runs/toy_model_noisy --out assets/toy \
        --init-from runs/toy_model --caption-noise color=0.45,count=0.45,relation=0.45,missing=0.45 \
        --steps 2500 --lr 5e-4 --ckpt-every 500
Only re-export / re-evaluate the latest checkpoint:  add ``--export-only`` / ``--eval-only``.

Commands, times and scores of the shipped models: assets/toy/README.md ("Training", "Measured").

Design notes, from failed attempts:
- VAE: (16, 32) and (32, 64) channels trained 500 steps rounded the corners of the 6-10 px shapes
  (held-out reconstructions 0.38-0.45 strict): under-training, not capacity. (16, 32) at 5000
  steps reaches 0.82, (32, 32) at 4000 steps 0.957.
- Patch 4 (16 image tokens of 8x8 px), 14 000 steps on 20 000 renders: held-out strict 0.13. A
  6-10 px shape then lives in one or two tokens; patch 2 (64 tokens of 4x4 px) reaches 0.31.
- CLIP's full 49 408-entry vocabulary: the text encoders' embedding tables were 9 of 15 MiB and AdamW
  updated every row at every step; the grammar-cut tokenizer (``clip_tokenizer_for``) splits every
  prompt into the same pieces with 585 entries.
- Patch size: a 1-level VAE (32x32x4 latents, 0.92 after 3000 steps) with 8x8 patches makes
  256-value tokens, wider than the transformer (96); the velocity must carry every latent value's
  noise, so samples kept visible noise. Keep tokens (patch^2 x channels) below the width.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from flowrl.models.tiny import (
    clip_tokenizer_for,
    sd3_pipeline_of,
    tiny_clip_text_encoder,
    tiny_sd3_transformer,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
    tiny_vae,
)
from flowrl.toy import captions
from flowrl.toy import prompts as toy_prompts
from flowrl.toy.world import render_batch

RESOLUTION = 32
LATENT_CHANNELS = 4
VAE_CHANNELS = (32, 32)
MIN_VAE_RECON = 0.9  # ToyEval strict of held-out VAE reconstructions below this caps every flow model
TEXT_LEN = 16  # longest grammar prompt is 12 CLIP tokens with BOS/EOS
CLIP_WIDTHS = (16, 32)  # text_encoder (CLIP-L stand-in), text_encoder_2 (CLIP-G stand-in)
SHIFT = 2.0
DEFAULT_STEPS, DEFAULT_GUIDANCE, DEFAULT_MAX_SEQ = 10, 3.0, 1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------ models
def make_tokenizers():
    """CLIP's BPE cut to the grammar's words: the same pieces as the full tokenizer, but ~600 embedding
    rows instead of 49 408, which would otherwise hold most of the text encoders' weights (and of
    AdamW's time: their gradients are dense)."""
    texts = [p for p, _ in toy_prompts.all_prompts()]
    return (clip_tokenizer_for(texts, model_max_length=TEXT_LEN),
            clip_tokenizer_for(texts, pad_token="!", model_max_length=TEXT_LEN))


def make_text_encoder(width: int, vocab: dict[str, int], layers: int = 2,
                      pooled: bool = True) -> CLIPTextModelWithProjection:
    """A CLIP text encoder over the grammar-cut vocabulary, for prompts of at most TEXT_LEN tokens.

    SD3 reads the token features of the penultimate layer, so with ``layers=1`` each token's feature is its
    own embedding plus its position's: a colour word means the same whatever shape follows, which is what a
    held-out colour-shape binding needs. ``pooled=False`` fixes the projection at zero, so the pooled
    embedding (the final layer's EOS token, a summary of the whole prompt) carries nothing either."""
    te = tiny_clip_text_encoder(width, vocab=vocab, max_positions=TEXT_LEN, layers=layers)
    if not pooled:
        with torch.no_grad():
            te.text_projection.weight.zero_()
        te.text_projection.requires_grad_(False)
    return te


def make_vae(channels: tuple[int, ...] = VAE_CHANNELS) -> AutoencoderKL:
    # 2 levels -> vae_scale_factor 2: 32 px <-> 16x16x4 latents. No mid-block attention, no quant convs.
    # (A 3-level 8x8x4 VAE trained for 5 min reconstructed only 17% of held-out scenes ToyEval-correctly;
    # 2-level ones need thousands of steps to keep the corners of 6-10 px shapes: see the module docstring.
    # (32, 32) channels: 0.8 MB of weights.)
    return tiny_vae(channels=channels, norm_groups=8, latent_channels=LATENT_CHANNELS, sample_size=RESOLUTION,
                    mid_block_attention=False)


ARCH = {"patch": 2, "heads": 3, "layers": 4}  # transformer shape: width = 32 x heads = 96


def make_transformer(patch: int, heads: int, layers: int) -> SD3Transformer2DModel:
    width = sum(CLIP_WIDTHS)
    return tiny_sd3_transformer(
        sample_size=RESOLUTION // 2,  # default height = 16 * vae_scale_factor(2) = 32 px
        # patch 2: 64 image tokens of 2x2x4 = 16 values, each 4x4 pixels, so a 6-10 px shape spans
        # several tokens. Tokens must stay narrower than the model: the velocity carries the noise of
        # every latent value, and 256-value tokens squeezed through width 96 left visible noise.
        patch_size=patch, latent_channels=LATENT_CHANNELS, layers=layers, heads=heads, head_dim=32,
        joint_attention_dim=width, pooled_projection_dim=width, pos_embed_max_size=16, qk_norm="rms_norm",
    )


def make_null_t5() -> T5EncoderModel:
    """A 1-layer T5 whose output is exactly zero (final RMSNorm weight 0).

    Plain ``StableDiffusion3Pipeline.from_pretrained`` refuses a directory without text_encoder_3,
    so we ship this stand-in: its embeddings equal the zeros diffusers uses when the T5 is absent.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_t5_encoder(sum(CLIP_WIDTHS), layers=1, heads=1, d_kv=8, d_ff=8, max_distance=16)
    with torch.no_grad():
        model.encoder.final_layer_norm.weight.zero_()
    return model.eval()


def build_pipeline(transformer, vae, te1, te2) -> StableDiffusion3Pipeline:
    tok, tok_2 = make_tokenizers()
    return sd3_pipeline_of(transformer, vae, (te1, te2, make_null_t5()), (tok, tok_2, tiny_t5_tokenizer()), shift=SHIFT)


# -------------------------------------------------------------------------------- data
def task_balanced_specs(items, n: int, rng: np.random.Generator) -> list[tuple[str, dict]]:
    """n (prompt, spec) pairs: a task uniformly at random, then a prompt of that task."""
    by_task: dict[str, list] = {}
    for item in items:
        by_task.setdefault(item[1]["task"], []).append(item)
    tasks = sorted(by_task)
    out = []
    for t in rng.integers(len(tasks), size=n):
        pool = by_task[tasks[t]]
        out.append(pool[rng.integers(len(pool))])
    return out


def stage_data(work: Path, n_images: int, seed: int, noise: dict[str, float] | None = None) -> dict:
    """Render n_images scenes of the whole grammar; with `noise`, each image shows its caption's corrupted spec
    (`flowrl.toy.captions`) with the given probability per kind. Cached as data.pt."""
    path = work / "data.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    t0 = time.time()
    rng = np.random.default_rng(seed)
    items = task_balanced_specs(toy_prompts.all_prompts(), n_images, rng)
    shown, kinds = [s for _, s in items], {}
    if noise and any(noise.values()):
        shown = []
        for _, spec in items:
            drawn, applied = captions.corrupt(spec, noise, rng)
            shown.append(drawn)
            for k in applied or ["none"]:
                kinds[k] = kinds.get(k, 0) + 1
    images = []
    for i in range(0, n_images, 1000):
        imgs, _ = render_batch(shown[i:i + 1000], rng, size=RESOLUTION)
        images.append((imgs * 255).round().to(torch.uint8))
    data = {"images": torch.cat(images), "prompts": [p for p, _ in items]}
    torch.save(data, path)
    log(f"data: rendered {n_images} images in {time.time() - t0:.0f}s"
        + (f"; corruptions {json.dumps(kinds)}" if kinds else ""))
    return data


def to_model_range(u8: torch.Tensor) -> torch.Tensor:
    return u8.float() / 127.5 - 1.0


# --------------------------------------------------------------------------------- VAE
def stage_vae(work: Path, data: dict, channels: tuple[int, ...], steps: int, batch: int, lr: float,
              seed: int) -> AutoencoderKL:
    path = work / "vae.pt"
    vae = make_vae(channels)
    if path.exists():
        vae.load_state_dict(torch.load(path, weights_only=True))
        return vae.eval().requires_grad_(False)
    torch.manual_seed(seed + 1)
    vae = make_vae(channels).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 2)
    images = data["images"]
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:  # warmup then cosine
            g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = to_model_range(images[torch.randint(len(images), (batch,), generator=gen)])
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        kl = 0.5 * (post.mean.square() + post.var - 1 - post.logvar).mean()
        # L1 keeps edges sharp (MSE alone tolerates a soft ring around every 6-10 px shape)
        loss = F.mse_loss(rec, x) + F.l1_loss(rec, x) + 1e-5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {loss.item():.4f} mse {F.mse_loss(rec, x).item():.4f} "
                f"kl {kl.item():.3f} ({time.time() - t0:.0f}s)")
    vae = vae.eval().requires_grad_(False)
    torch.save(vae.state_dict(), path)
    return vae


@torch.no_grad()
def encode_all(vae: AutoencoderKL, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Posterior means (deterministic) of all images: [N, 4, 16, 16], unscaled."""
    return torch.cat([vae.encode(to_model_range(images[i:i + batch])).latent_dist.mean
                      for i in range(0, len(images), batch)])


@torch.no_grad()
def vae_check(vae: AutoencoderKL, seed: int, n: int = 256) -> dict:
    """ToyEval strict accuracy of VAE reconstructions of fresh renders of RL's held-out prompts (should be ~1)."""
    from rewards.toyeval import ToyEval

    rng = np.random.default_rng(seed + 7)
    items = task_balanced_specs(toy_prompts.heldout_prompts(0), n, rng)
    imgs, _ = render_batch([s for _, s in items], rng, size=RESOLUTION)
    rec = (vae.decode(vae.encode(imgs * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
    ev = ToyEval()
    gt = ev(imgs, [p for p, _ in items], [s for _, s in items])["toyeval"].mean().item()
    got = ev(rec, [p for p, _ in items], [s for _, s in items])["toyeval"].mean().item()
    return {"renders": gt, "reconstructions": got, "mse": F.mse_loss(rec, imgs).item()}


# -------------------------------------------------------------------------------- flow
class Trainable(torch.nn.Module):
    """The transformer and both CLIP text encoders, trained jointly (random init from the torch seed)."""

    def __init__(self, patch: int, heads: int, layers: int, text_layers: int = 2, pooled: bool = True):
        super().__init__()
        vocab = make_tokenizers()[0].get_vocab()
        self.transformer = make_transformer(patch, heads, layers)
        self.te1, self.te2 = (make_text_encoder(width, vocab, text_layers, pooled) for width in CLIP_WIDTHS)


def encode_text(model: Trainable, ids1: torch.Tensor, ids2: torch.Tensor, pad_tokens: int):
    """The pipeline's encode_prompt (CLIP part + zero T5 padding), differentiable."""
    o1 = model.te1(ids1, output_hidden_states=True)
    o2 = model.te2(ids2, output_hidden_states=True)
    embeds = torch.cat([o1.hidden_states[-2], o2.hidden_states[-2]], dim=-1)  # [B, 16, 48]
    if pad_tokens:
        embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], pad_tokens, embeds.shape[-1])], dim=1)
    pooled = torch.cat([o1.text_embeds, o2.text_embeds], dim=-1)  # [B, 48]
    return embeds, pooled


def tokenize(prompts: list[str]):
    tok, tok_2 = make_tokenizers()
    kw = dict(padding="max_length", max_length=TEXT_LEN, truncation=True, return_tensors="pt")
    return tok(prompts, **kw).input_ids, tok_2(prompts, **kw).input_ids


def export(model: Trainable, vae: AutoencoderKL, out: Path) -> None:
    pipe = build_pipeline(copy.deepcopy(model.transformer).eval(), vae, copy.deepcopy(model.te1).eval(),
                          copy.deepcopy(model.te2).eval())
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)


def initial_weights(init: Path, model: Trainable) -> dict[str, torch.Tensor]:
    """The weights to fine-tune from: a work dir's checkpointed EMA, or a trained pipeline's components."""
    if (init / "ckpt.pt").exists():
        return torch.load(init / "ckpt.pt", weights_only=True)["ema"]
    parts = {"transformer": SD3Transformer2DModel, "te1": CLIPTextModelWithProjection,
             "te2": CLIPTextModelWithProjection}
    folders = {"transformer": "transformer", "te1": "text_encoder", "te2": "text_encoder_2"}
    state = {}
    for name, cls in parts.items():
        loaded = cls.from_pretrained(str(init), subfolder=folders[name])
        state.update({f"{name}.{k}": v for k, v in loaded.state_dict().items()})
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise SystemExit(f"ERROR: {init} does not match the transformer shape asked for (missing {sorted(missing)[:3]})")
    return state


def initial_vae(init: Path) -> tuple[dict[str, torch.Tensor], tuple[float, float]]:
    """The VAE weights and latent (mean, std) of a work dir or of a trained pipeline, kept when fine-tuning."""
    if (init / "vae.pt").exists():
        return (torch.load(init / "vae.pt", weights_only=True),
                tuple(torch.load(init / "data.pt", weights_only=True)["latent_stats"]))
    vae = AutoencoderKL.from_pretrained(str(init), subfolder="vae")
    return vae.state_dict(), (vae.config.shift_factor, 1.0 / vae.config.scaling_factor)


def stage_flow(work: Path, out: Path, data: dict, vae: AutoencoderKL, args) -> Trainable:
    latents = data.get("latents")
    if latents is None:
        raise RuntimeError("latents missing")
    ids1_all, ids2_all = data["ids1"], data["ids2"]
    empty1, empty2 = tokenize([""])

    torch.manual_seed(args.seed + 3)
    model = Trainable(**arch_of(args))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    start = 0
    ckpt_path = work / "ckpt.pt"
    if args.init_from and not ckpt_path.exists():  # fine-tune: both copies start at the given model's EMA
        model.load_state_dict(initial_weights(Path(args.init_from), model))
        ema.load_state_dict(model.state_dict())
        log(f"flow: starting from the weights of {args.init_from}")
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
        log(f"flow: resumed at step {start}")
    if start >= args.steps:
        return ema
    model.train()
    t0, run_loss = time.time(), []
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # per-step RNG: exact resume
        warm = min(1.0, (step + 1) / 200)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(len(latents), (args.batch,), generator=gen)
        x0 = latents[idx]
        drop = torch.rand(args.batch, generator=gen) < args.cfg_drop
        ids1 = torch.where(drop[:, None], empty1, ids1_all[idx])
        ids2 = torch.where(drop[:, None], empty2, ids2_all[idx])
        pad = 1 if torch.rand((), generator=gen) >= args.pad_random else int(2 ** torch.randint(7, (), generator=gen))
        # logit-normal(0, 1) t (SD3), 10% uniform so the ends of the schedule are trained too
        t = torch.sigmoid(torch.randn(args.batch, generator=gen))
        t = torch.where(torch.rand(args.batch, generator=gen) < 0.1, torch.rand(args.batch, generator=gen), t)
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        embeds, pooled = encode_text(model, ids1, ids2, pad)
        v = model.transformer(hidden_states=xt, encoder_hidden_states=embeds, pooled_projections=pooled,
                              timestep=t * 1000, return_dict=False)[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        run_loss.append(loss.item())
        if (step + 1) % 100 == 0:
            rate = (time.time() - t0) / (step + 1 - start)
            log(f"flow step {step + 1}/{args.steps} loss {np.mean(run_loss):.4f} lr {lr:.2e} "
                f"{rate:.3f}s/step eta {rate * (args.steps - step - 1) / 60:.1f} min")
            run_loss = []
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1, "arch": arch_of(args)}, work / "ckpt.tmp")
            os.replace(work / "ckpt.tmp", ckpt_path)
            export(ema, vae, out)
            if args.keep_exports:  # earlier checkpoints are base candidates: less trained, failures spread
                shutil.copytree(out, work / "exports" / f"step_{step + 1}", dirs_exist_ok=True)
            log(f"flow: checkpoint + EMA pipeline exported at step {step + 1} -> {out}")
    return ema


# -------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(pipe: StableDiffusion3Pipeline, n: int = 512, seed: int = 0, steps: int = DEFAULT_STEPS,
             guidance: float = DEFAULT_GUIDANCE, max_seq: int = DEFAULT_MAX_SEQ, batch: int = 64) -> dict:
    """ToyEval strict / partial on n task-stratified prompts of RL's held-out and train sets (seeded)."""
    from rewards.toyeval import ToyEval

    ev = ToyEval()
    result = {}
    split = toy_prompts.split(0)  # RL's split: "heldout" is what the main job's report scores
    for name, items in (("heldout", split[1]), ("train", split[0])):
        by_task: dict[str, list] = {}
        for it in items:
            by_task.setdefault(it[1]["task"], []).append(it)
        rng = np.random.default_rng(seed + 11)
        picked = []
        for task in toy_prompts.TASKS:  # n/4 per task, with replacement where a task is small
            pool = by_task[task]
            picked += [pool[i] for i in rng.integers(len(pool), size=n // len(toy_prompts.TASKS))]
        scores = {"toyeval": [], "toyeval/partial": []}
        for i in range(0, len(picked), batch):
            chunk = picked[i:i + batch]
            gens = [torch.Generator().manual_seed(seed * 100_000 + i + j) for j in range(len(chunk))]
            imgs = pipe([p for p, _ in chunk], num_inference_steps=steps, guidance_scale=guidance,
                        max_sequence_length=max_seq, generator=gens, output_type="pt").images
            r = ev(imgs, [p for p, _ in chunk], [s for _, s in chunk])
            for k in scores:
                scores[k].append(r[k])
        strict, partial = torch.cat(scores["toyeval"]), torch.cat(scores["toyeval/partial"])
        per_task = {task: strict[k * (n // 4):(k + 1) * (n // 4)].mean().item()
                    for k, task in enumerate(toy_prompts.TASKS)}
        result[name] = {"strict": strict.mean().item(), "partial": partial.mean().item(), "per_task": per_task}
    return result


def load_pipeline(path: str | Path) -> StableDiffusion3Pipeline:
    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -------------------------------------------------------------------------------- main
def arch_of(args) -> dict[str, int]:
    return {"patch": args.patch, "heads": args.heads, "layers": args.layers, "text_layers": args.text_layers,
            "pooled": args.pooled}


def reuse_vae(work: Path, pipeline_dir: str) -> None:
    """Seed the VAE stage with the VAE of a trained pipeline (skips ~10 min when only the flow changes)."""
    if not (work / "vae.pt").exists():
        vae = AutoencoderKL.from_pretrained(pipeline_dir, subfolder="vae")
        torch.save(vae.state_dict(), work / "vae.pt")
        log(f"vae: reusing {pipeline_dir}/vae")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="assets/toy")
    ap.add_argument("--work-dir", default="runs/toy_model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-images", type=int, default=40000)
    ap.add_argument("--vae-channels", type=lambda s: tuple(int(c) for c in s.split(",")), default=VAE_CHANNELS,
                    help="AutoencoderKL block_out_channels, comma separated; 2 levels -> 16x16x4 latents")
    ap.add_argument("--vae-steps", type=int, default=4000)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--min-vae-recon", type=float, default=MIN_VAE_RECON,
                    help="stop unless held-out VAE reconstructions score at least this ToyEval strict (0: warn only)")
    ap.add_argument("--stop-after-vae", action="store_true", help="run the data and VAE stages only")
    ap.add_argument("--vae-from", help="pipeline directory whose VAE to reuse instead of training one")
    ap.add_argument("--patch", type=int, default=ARCH["patch"], help="transformer patch size on the 16x16 latent")
    ap.add_argument("--heads", type=int, default=ARCH["heads"], help="attention heads of 32 channels (width/32)")
    ap.add_argument("--layers", type=int, default=ARCH["layers"], help="joint transformer blocks")
    ap.add_argument("--text-layers", type=int, default=2,
                    help="CLIP layers; 1 gives the transformer each word's own embedding (see make_text_encoder)")
    ap.add_argument("--no-pooled", dest="pooled", action="store_false",
                    help="fix the CLIP projections at zero, so the pooled prompt embedding is 0")
    ap.add_argument("--pad-random", type=float, default=0.1,
                    help="fraction of steps whose zero T5 padding is 1..64 tokens instead of 1")
    ap.add_argument("--steps", type=int, default=14000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--cfg-drop", type=float, default=0.1)
    ap.add_argument("--ckpt-every", type=int, default=2000)
    ap.add_argument("--keep-exports", action="store_true",
                    help="also keep each checkpoint's EMA pipeline under WORK_DIR/exports/step_N")
    ap.add_argument("--caption-noise", type=captions.parse_noise, default=None,
                    help="noisy captions, e.g. color=0.5,count=0.5,relation=0.5,missing=0.3: the probability "
                         "per kind that an image shows a corrupted spec (flowrl.toy.captions)")
    ap.add_argument("--init-from", help="a trained run's work dir or pipeline dir (e.g. assets/toy_clean): start "
                                        "from its weights, VAE and latent scaling (fine-tuning on noisy captions, "
                                        "or more steps)")
    ap.add_argument("--eval-n", type=int, default=512, help="prompts per split (a quarter per task)")
    ap.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE, help="CFG scale of the evaluation")
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoint's EMA and stop")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the pipeline in --out and stop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # a VAE posterior std that collapses towards 0 makes denormals, 5x slower steps
    work, out = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    if args.eval_only:
        log(json.dumps(evaluate(load_pipeline(out), n=args.eval_n, seed=args.seed, guidance=args.guidance)))
        return

    data = stage_data(work, args.n_images, args.seed, args.caption_noise)
    if args.init_from:  # the latents must be made and scaled as the initial model's were
        vae_state, stats = initial_vae(Path(args.init_from))
        if not (work / "vae.pt").exists():
            torch.save(vae_state, work / "vae.pt")
        data.setdefault("latent_stats", stats)
    if args.vae_from:
        reuse_vae(work, args.vae_from)
    vae = stage_vae(work, data, args.vae_channels, args.vae_steps, args.vae_batch, args.vae_lr, args.seed)
    t_vae = time.time()
    if "latents" not in data:
        raw = encode_all(vae, data["images"])
        mean, std = data.get("latent_stats") or (raw.mean().item(), raw.std().item())
        vae.register_to_config(scaling_factor=1.0 / std, shift_factor=mean)
        data["latents"] = (raw - mean) / std
        data["ids1"], data["ids2"] = tokenize(data["prompts"])
        data["latent_stats"] = (mean, std)
        torch.save(data, work / "data.pt")
        log(f"vae: latent mean {mean:.4f} std {std:.4f}")
    mean, std = data["latent_stats"]
    vae.register_to_config(scaling_factor=1.0 / std, shift_factor=mean)
    check = vae_check(vae, args.seed)
    log(f"vae: check {json.dumps(check)}")
    if check["reconstructions"] < MIN_VAE_RECON:
        msg = (f"VAE reconstructions of held-out renders score ToyEval strict {check['reconstructions']:.3f} "
               f"< {MIN_VAE_RECON}: this caps every flow model trained on this VAE")
        if check["reconstructions"] < args.min_vae_recon:
            raise SystemExit(f"ERROR: {msg} (pass --min-vae-recon 0 to continue anyway)")
        log(f"WARNING: {msg}")
    if args.stop_after_vae:
        return
    if args.export_only:
        ck = torch.load(work / "ckpt.pt", weights_only=True)
        ema = Trainable(**ck.get("arch", arch_of(args)))
        ema.load_state_dict(ck["ema"])
        export(ema, vae, out)
        log(f"exported EMA of step {ck['step']} to {out}")
        return
    stage_flow(work, out, data, vae, args)
    t_flow = time.time()
    pipe = load_pipeline(out)
    res = evaluate(pipe, n=args.eval_n, seed=args.seed, guidance=args.guidance)
    t_eval = time.time()
    res["seconds"] = {"data+vae": round(t_vae - t_start), "flow": round(t_flow - t_vae),
                      "eval": round(t_eval - t_flow), "total": round(t_eval - t_start)}
    (work / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    log(f"done: {json.dumps(res)}")


if __name__ == "__main__":
    main()
