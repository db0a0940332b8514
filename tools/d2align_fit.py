"""Fit D²-Align's shared reward direction on base-model samples, with the reward frozen.

Samples ``--images`` ODE images for each of ``--prompts`` training prompts of CONFIG (an equal share per
task where prompts carry one) from the base model, embeds and scores them with ``--reward``, and
writes the within-prompt ridge fit of the score on the embedding (``rewards/directional.py``) to
``--out``. Train with it through the ``d2align`` reward:

    python -m tools.d2align_fit configs/toy/grpo_clip.yaml --reward toy_clip --out runs/d2/toy_clip.safetensors
    flowrl train configs/toy/grpo_clip.yaml \\
        'rewards=[{name: d2align, kwargs: {reward: toy_clip, direction: runs/d2/toy_clip.safetensors}}]'

It prints the direction's largest components and how much of the score's within-prompt variance it
explains. ``--reward-kwargs`` takes a JSON object for the reward's constructor (e.g. a model path).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flowrl.config import Config, load_config
from flowrl.eval.held_out import render
from flowrl.data.tasks import stratified_prefix
from flowrl.recipes.build import build_training_policy, load_prompt_splits
from flowrl.rewards_api import build_reward
from rewards.directional import fit_direction, save_direction


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="config overrides a.b=value")
    parser.add_argument("--reward", required=True, help="an embedding reward (short name or dotted path)")
    parser.add_argument("--reward-kwargs", default="{}", help="JSON object of the reward's constructor arguments")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--images", type=int, default=8, help="images per prompt")
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = load_config(Config, args.config, args.overrides)
    reward = build_reward(args.reward, **json.loads(args.reward_kwargs))
    if not hasattr(reward, "embed_images"):
        raise SystemExit(f"d2align_fit: reward '{args.reward}' has no image embedding (embed_images); "
                         "see rewards/directional.py for the rewards D²-Align applies to")
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else ("cpu" if cfg.device == "auto"
                                                                                else cfg.device)
    policy = build_training_policy(cfg, torch.device(device))  # fresh LoRA: B = 0, the base model
    train_prompts, _ = load_prompt_splits(cfg)
    prompts = stratified_prefix(train_prompts, args.prompts)
    guidance = cfg.sampling.guidance_scale if (cfg.train.cfg or policy.guidance_in_model) else 1.0
    images = render(policy, prompts, images_per_prompt=args.images, num_steps=cfg.sampling.num_steps,
                    guidance=guidance, seed=cfg.seed + 7)  # [P * n, 3, H, W]
    rows = [i for i in range(len(prompts)) for _ in range(args.images)]
    row_prompts, row_meta = [prompts.prompts[i] for i in rows], [prompts.metadata[i] for i in rows]
    scores = reward(images, row_prompts, row_meta)[reward.name].float()
    embeddings = reward.embed_images(images).float()
    groups = torch.tensor(rows)
    direction = fit_direction(embeddings, scores, groups, ridge=args.ridge)
    centred = scores - torch.stack([scores[groups == g].mean() for g in rows])
    shared = embeddings @ direction
    shared_centred = shared - torch.stack([shared[groups == g].mean() for g in rows])
    explained = 1 - float(((centred - shared_centred) ** 2).sum() / (centred ** 2).sum().clamp(min=1e-12))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_direction(args.out, direction, reward=args.reward,
                   metadata={"prompts": len(prompts), "images_per_prompt": args.images, "ridge": args.ridge,
                             "config": args.config, "within_prompt_r2": f"{explained:.4f}"})
    slots = getattr(__import__(type(reward).__module__, fromlist=["SLOTS"]), "SLOTS", None)
    top = torch.argsort(direction.abs(), descending=True)[:6].tolist()
    names = [slots[i] if slots else str(i) for i in top]
    components = ", ".join(f"{n} {direction[i]:+.3f}" for n, i in zip(names, top))
    print(f"wrote {args.out}: {len(scores)} images; the shared direction explains {explained:.1%} of the "
          f"within-prompt variance; largest components {components}")


if __name__ == "__main__":
    main()
