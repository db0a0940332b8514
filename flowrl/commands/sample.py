"""``flowrl sample CONFIG``: render a grid (one row per prompt) with the configured model."""

from __future__ import annotations

from pathlib import Path

from flowrl.media import IMAGE_SUFFIXES


def run_sample(args) -> Path:
    from torchvision.utils import save_image

    from flowrl.config import Config, load_config
    from flowrl.data import load_prompts
    from flowrl.devices import resolve_device
    from flowrl.models import policy_from_config
    from flowrl.models.text_cache import attach_configured_cache
    from flowrl.models.lora_io import load_lora_into
    from flowrl.media import stills
    from flowrl.sampling import StepPlan, rollout, root_seeds
    from flowrl.sampling.self_guidance import ONE_IMAGE_ERROR, SelfGuidance

    cfg = load_config(Config, args.config, args.overrides)
    n = args.num_per_prompt
    if n < 1:
        raise ValueError(f"--num-per-prompt must be >= 1 (got {n}): it is the number of images per prompt")
    guide = SelfGuidance.maybe(**cfg.sampling.self_guidance.settings())
    if guide is not None and n < 2:
        raise ValueError(f"{ONE_IMAGE_ERROR} (--num-per-prompt {n}; sampling.self_guidance.scale > 0)")
    out = Path(args.out or Path(cfg.run_dir) / "samples.png")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give an image file, e.g. --out {out / 'samples.png'}")
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"--out {out}: use an image file name ending in {', '.join(IMAGE_SUFFIXES)}")
    prompts, metadata = list(args.prompt), [{} for _ in args.prompt]
    if args.prompts_file:
        prompt_set = load_prompts(args.prompts_file)
        prompts, metadata = prompts + prompt_set.prompts, metadata + prompt_set.metadata
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    device = resolve_device(cfg.device)
    model = cfg.model
    policy = policy_from_config(model, device=device, seed=cfg.seed)
    attach_configured_cache(policy, model, cfg.run_dir, prompts)
    if args.lora:
        load_lora_into(policy, args.lora)
    steps = cfg.sampling.num_steps
    plan = StepPlan(steps) if args.sde else StepPlan(steps, sde_start=steps - 1, sde_size=1)
    noise = cfg.sampling.noise_level if args.sde else 0.0
    traj = rollout(policy, prompts, group_size=n, num_steps=steps, guidance_scale=cfg.sampling.guidance_scale,
                   noise_level=noise, kind=cfg.sampling.kind, plan=plan, metadata=metadata,
                   seeds=root_seeds(cfg.seed, 0, len(prompts) * n), self_guidance=guide)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_image(stills(traj.images), out, nrow=n, padding=2)
    except OSError as error:
        raise ValueError(f"cannot write {out}: {error.strerror or error}; choose a writable --out") from None
    (out.with_suffix(".txt")).write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return out
