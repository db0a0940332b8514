"""``flowrl sample CONFIG``: render a grid (one row per prompt) with the configured model.

``--preference 0.3,0.7`` moves ParetoSlider's slider: the reward weights (one per reward, in the order the run's
``model.preference.rewards`` gave, on the simplex) of the preference embedding that ``--lora``'s export carries.
A vector of the wrong length, with a negative entry or not summing to 1, or ``--preference`` without such an
export, is refused in one line before anything is loaded or written."""

from __future__ import annotations

from pathlib import Path

from flowrl.core.media import IMAGE_SUFFIXES


def run_sample(args) -> Path:
    from torchvision.utils import save_image

    from flowrl.config import Config, load_config
    from flowrl.data.prompts import load_prompts
    from flowrl.core.devices import resolve_device
    from flowrl.models import policy_from_config
    from flowrl.models.text_cache import attach_configured_cache
    from flowrl.models.lora_io import load_lora_into
    from flowrl.models.preference import load_preference, preference_file, set_preference
    from flowrl.core.media import stills
    from flowrl.sampling import RolloutSettings, StepPlan, rollout, root_seeds
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
    preference = check_slider(args.preference, args.lora)
    device = resolve_device(cfg.device)
    model = cfg.model
    policy = policy_from_config(model, device=device, seed=cfg.seed)
    attach_configured_cache(policy, model, cfg.run_dir, prompts)
    if args.lora:
        load_lora_into(policy, args.lora)
        if preference_file(args.lora) is not None:  # a slider model: at the centre unless --preference moves it
            load_preference(policy, args.lora)
    if preference is not None:
        set_preference(policy, preference)
    steps = cfg.sampling.num_steps
    plan = StepPlan(steps) if args.sde else StepPlan(steps, sde_start=steps - 1, sde_size=1)
    noise = cfg.sampling.noise_level if args.sde else 0.0
    settings = RolloutSettings(num_steps=steps, guidance_scale=cfg.sampling.guidance_scale, noise_level=noise,
                               kind=cfg.sampling.kind, plan=plan, self_guidance=guide)
    traj = rollout(policy, prompts, settings, group_size=n, metadata=metadata,
                   seeds=root_seeds(cfg.seed, 0, len(prompts) * n))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if getattr(args, "raw", False):  # the model's own pixels, for scripts that read them back
            save_image(stills(traj.images), out, nrow=n, padding=2)
        else:
            import io

            from PIL import Image

            from flowrl.eval.report import labelled_grid

            grid = labelled_grid(traj.images, prompts, n, f"{cfg.model.path}: {n} samples per prompt")
            Image.open(io.BytesIO(grid)).convert("RGB").save(out)
    except OSError as error:
        raise ValueError(f"cannot write {out}: {error.strerror or error}; choose a writable --out") from None
    (out.with_suffix(".txt")).write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return out


def check_slider(text: str | None, lora: str | None) -> list[float] | None:
    """``--preference`` as a list of weights, checked against the rewards of ``lora``'s preference embedding (None
    without ``--preference``); a one-line ValueError for a bad vector or an adapter trained without one."""
    import json

    from flowrl.models.preference import check_preference, parse_preference, read_preference_header

    if text is None:
        return None
    values = parse_preference(text)
    check_preference(values)  # sign and sum, whatever the model
    if not lora:
        raise ValueError("--preference needs a model trained with model.preference: pass its adapter with --lora "
                         "(a run's lora/ directory or an export-lora directory)")
    try:
        header = read_preference_header(lora)
    except FileNotFoundError as error:
        raise ValueError(f"--preference: {error}") from None
    check_preference(values, json.loads(header["flowrl.preference.rewards"]))
    return values
