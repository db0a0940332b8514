"""``flowrl eval CONFIG --checkpoint A [--checkpoint B ...]``: generate a benchmark suite with each
checkpoint on the same seeds, score rewards, diversity and FID/KID, write ``results.json`` and ``report.html``.

For every checkpoint (the base model is always added, as the column deltas are taken against):
1. render ``eval.images_per_prompt`` ODE images per suite prompt with the eval seeds, written as PNG under
   ``OUT/images/<label>/`` with the clean latents beside them; batches of ``eval.batch_prompts`` prompts
   whose files all exist (rendered with the same settings and checkpoint, see ``manifest.json``) are not
   rendered again, so an interrupted eval resumes. A missing prompt's whole batch is rendered again, as
   a prompt's floats depend on its batch, and scores are computed from the written files, so a resumed
   eval scores exactly what a fresh one does;
2. score every configured reward (``reward/*`` for trained ones, ``held_out/*`` for weight-0 ones, which
   catch hacking), per task where prompts carry one, and the share of prompts whose images all score alike;
3. diversity within each prompt's images: mean pairwise cosine distance and Vendi score of
   ``eval.features``, latent L-GMD, the suite's per-axis scores (:mod:`flowrl.eval.suites`), the toy
   world's exact attribute diversity (``eval.toy_diversity``);
4. FID and KID against ``eval.reference`` (a directory of images) with ``eval.fid_features``.

    flowrl eval configs/toy/nft.yaml --checkpoint runs/toy_nft            # base vs the trained run
    flowrl eval configs/sd35/grpo_ocr.yaml --checkpoint a=runs/a:ema --checkpoint b=runs/b/lora eval.reference=ref/
"""

from __future__ import annotations

import json
import shutil
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from flowrl.eval.checkpoints import (EvalCheckpoint, check_fits, check_same_model, load_adapter, read_adapter,
                                     unique_labels)
from flowrl.eval.suites import axis_scores, prompt_axes
from flowrl.data.tasks import task_of
from flowrl.core.media import image_files, read_rgb

def run_eval(config: str, overrides: list[str], checkpoints: list[str], out: str | None = None,
             preference: str | None = None, suite: str | None = None) -> Path:
    """Evaluate ``checkpoints`` (specs, see :mod:`flowrl.eval.checkpoints`); returns the report path.

    ``suite`` (``--suite``) replaces ``eval.suite``: a prompt file, or ``geneval``, the generated GenEval split
    (:func:`flowrl.eval.suites.load_suite`); a GenEval judge among the rewards then gives per-task scores and
    their mean (``reward/geneval/task/<task>``, ``reward/geneval/task_mean``) in results.json.

    ``preference`` (``--preference 0.3,0.7``): render every trained checkpoint at these ParetoSlider weights; each
    must carry a preference embedding of as many rewards (checked before anything is written; the base model
    renders as itself)."""
    from flowrl.config import Config, load_config
    from flowrl.core.devices import resolve_device
    from flowrl.eval.checkpoints import parse_checkpoint
    from flowrl.eval.suites import load_suite

    cfg = load_config(Config, config, [*overrides, *([f"eval.suite={suite}"] if suite else [])])
    suite = load_suite(cfg.eval.suite)
    if not checkpoints and _has_adapter(Path(cfg.run_dir)):  # `flowrl eval CONFIG`: the config's own run
        checkpoints = [cfg.run_dir]
    specs = [parse_checkpoint(spec) for spec in checkpoints]
    if not any(c.is_base for c in specs):
        specs.insert(0, EvalCheckpoint("base"))
    specs = unique_labels(specs)
    for checkpoint in specs:  # refuse another model's adapter before rendering anything
        if not checkpoint.is_base:
            check_same_model(checkpoint, cfg.model.family, cfg.model.path)
    slider = check_slider(preference, specs)
    reference = load_reference(cfg.eval.reference, cfg) if cfg.eval.reference else None
    for checkpoint in specs:  # full weights, an unreadable file: refused before the output directory exists
        if not checkpoint.is_base:
            read_adapter(checkpoint)
    out_dir = Path(out or Path(cfg.run_dir) / "eval")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)

    from accelerate import PartialState

    # under `accelerate launch` each process renders a share of the suite's batches; on a CPU machine accelerate
    # joins the processes into one gloo group only when asked for the CPU (as training's Accelerator is)
    configured = resolve_device(cfg.device)
    state = PartialState(cpu=configured.type == "cpu")
    device = state.device if state.num_processes > 1 else configured
    try:
        images = generate_all(cfg, suite, specs, out_dir, device, preference=slider,
                              shard=Shard(state.process_index, state.num_processes, state.wait_for_everyone))
    except (ValueError, FileNotFoundError):  # a refusal (a size the model cannot sample): leave no empty directory
        if created and state.is_main_process and not any(out_dir.rglob("*.png")):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    if not state.is_main_process:  # the main process scores the files every process wrote
        return out_dir / "report.html"
    results = score_all(cfg, suite, specs, images, reference, device)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    from flowrl.eval.report import write_eval_report

    return write_eval_report(out_dir, results, suite, {c.label: images[c.label][0] for c in specs},
                             cfg.eval.images_per_prompt, grid_prompts=cfg.eval.grid_prompts)


def check_slider(text: str | None, specs: list[EvalCheckpoint]) -> list[float] | None:
    """``--preference`` as weights, or None; a one-line ValueError for a bad vector or a checkpoint without a
    preference embedding of that many rewards."""
    from flowrl.eval.checkpoints import read_slider
    from flowrl.models.preference import check_preference, parse_preference

    if text is None:
        return None
    values = parse_preference(text)
    check_preference(values)
    trained = [c for c in specs if not c.is_base]
    if not trained:
        raise ValueError("--preference needs a checkpoint trained with model.preference: pass --checkpoint RUN_DIR")
    for checkpoint in trained:
        slider = read_slider(checkpoint)
        if slider is None:
            raise ValueError(f"--preference: checkpoint {checkpoint.path} carries no preference embedding: it was not "
                             "trained with model.preference")
        check_preference(values, json.loads(slider[1]["flowrl.preference.rewards"]))
    return values


def _has_adapter(run_dir: Path) -> bool:
    return (run_dir / "lora").is_dir() or (run_dir / "checkpoints").is_dir()


# --- 1. generation ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """This process's share of the rendering under ``accelerate launch``: every ``world``-th batch of prompts
    from ``rank``; ``barrier`` waits for every process."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None


def generate_all(cfg, suite, specs: list[EvalCheckpoint], out_dir: Path, device,
                 preference: list[float] | None = None, shard: Shard = Shard()) -> dict[str, tuple]:
    """``{label: (images [P*n, 3, H, W] read back from PNG, latents [P*n, C, h, w])}`` for every checkpoint
    (on the main process; the others render their share and return ``{}``).

    A label's folder keeps ``manifest.json`` (the render settings, a digest of the checkpoint's files and
    the prompt of each index): files rendered under other settings, another prompt or another version of
    the checkpoint (a run trained further) are rendered again instead of being reused. Under several
    processes each renders whole batches (``eval.batch_prompts``, cut as one process cuts them, so the
    images are the same bits), keeps its own ``manifest.<rank>.json``, and the main process merges them."""

    e = cfg.eval
    plans = []
    for checkpoint in specs:
        folder = out_dir / "images" / checkpoint.label
        settings = render_settings(cfg, checkpoint, preference)
        done = _manifest_prompts(folder, settings)
        missing = [i for i in range(len(suite))
                   if done.get(str(i)) != suite.prompts[i] or not _prompt_done(folder, i, e.images_per_prompt)]
        # whole batches, as a fresh eval cuts them: a prompt's floats depend on its batch's composition
        size = e.batch_prompts
        todo = [i for b in sorted({i // size for i in missing}) for i in range(b * size, min((b + 1) * size, len(suite)))]
        batches = _batches(todo, size)[shard.rank::shard.world]  # whole batches: a prompt's floats depend on them
        plans.append((checkpoint, folder, settings, [i for batch in batches for i in batch]))
    shard.barrier()  # every process has read the manifests before any writes
    policy, attached = None, None
    if any(todo for *_, todo in plans):
        policy = cached_policy(cfg, suite, device)
        policy.check_size(e.height or policy.height, e.width or policy.width, e.num_frames)
        for checkpoint, *_, todo in plans:  # refuse a LoRA of another shape before rendering anything
            if todo and not checkpoint.is_base:
                check_fits(policy.transformer, checkpoint, read_adapter(checkpoint)[0])
    results = {}
    for checkpoint, folder, settings, todo in plans:
        if todo:
            adapter = None if checkpoint.is_base else read_adapter(checkpoint)[1]
            shape = None if adapter is None else (int(adapter["r"]), float(adapter["lora_alpha"]),
                                                  tuple(sorted(adapter["target_modules"])))
            if shape is not None and attached is not None and shape != attached:
                policy = cached_policy(cfg, suite, device)
                attached = None
            if not checkpoint.is_base:
                load_adapter(policy, checkpoint)
                attached = shape
                if preference is not None:  # ParetoSlider: the slider's position
                    from flowrl.models.preference import set_preference

                    set_preference(policy, preference)
            _render_missing(policy, suite, todo, folder, cfg, base=checkpoint.is_base, label=checkpoint.label,
                            settings=settings, shard=shard)
    shard.barrier()  # every process has written its images
    if shard.rank != 0:
        return {}
    for checkpoint, folder, settings, _ in plans:
        if shard.world > 1:
            _merge_manifests(folder, settings)
        results[checkpoint.label] = read_images(folder, len(suite), e.images_per_prompt)
    return results


def render_settings(cfg, checkpoint: EvalCheckpoint, preference: list[float] | None = None) -> dict:
    """What a label's images depend on besides the prompt: model, seeds, sampler, the checkpoint's bytes and a
    ParetoSlider preference."""
    import hashlib

    m, e = cfg.model, cfg.eval
    digest = None
    if not checkpoint.is_base:
        path = checkpoint.path
        files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".json")) if path.is_dir() else [path]
        sha = hashlib.sha256()
        for file in files:
            sha.update(file.name.encode())
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    sha.update(block)
        digest = sha.hexdigest()
    model = [m.family, str(m.path), m.dtype, m.height, m.width, m.max_sequence_length]
    size = [e.height, e.width, e.num_frames]  # eval's own size (null: the model's)
    if m.num_frames is not None or m.negative_prompt:  # only then: renders cached before these existed stay valid
        model += [m.num_frames, m.negative_prompt]
    return {"model": model,
            "seed": e.seed, "images_per_prompt": e.images_per_prompt, "num_steps": e.num_steps or cfg.sampling.num_steps,
            "guidance_scale": cfg.sampling.guidance_scale if e.guidance_scale is None else e.guidance_scale,
            "checkpoint": None if checkpoint.is_base else [str(checkpoint.path), checkpoint.ema, digest],
            # only when on / set: renders cached before self-guidance, eval sizes and preferences existed stay valid
            **({"self_guidance": cfg.sampling.self_guidance.settings()} if cfg.sampling.self_guidance.scale else {}),
            **({"size": size} if size != [None, None, None] else {}),
            **({"preference": preference} if preference is not None and not checkpoint.is_base else {})}


def _manifest_prompts(folder: Path, settings: dict) -> dict[str, str]:
    """``{index: prompt}`` rendered in ``folder`` under ``settings`` (empty for other settings or none), from
    ``manifest.json`` and the per-process ``manifest.<rank>.json`` an interrupted multi-process eval left."""
    done: dict[str, str] = {}
    for file in [folder / "manifest.json", *sorted(folder.glob("manifest.*.json"))]:
        try:
            manifest = json.loads(file.read_text()) if file.is_file() else {}
        except ValueError:
            continue
        if manifest.get("settings") == settings:
            done.update(manifest.get("prompts", {}))
    return done


def _merge_manifests(folder: Path, settings: dict) -> None:
    """One ``manifest.json`` from the per-process ones (main process, after every process has rendered)."""
    done = _manifest_prompts(folder, settings)
    (folder / "manifest.json").write_text(json.dumps({"settings": settings, "prompts": done}, indent=1))
    for part in folder.glob("manifest.*.json"):
        part.unlink()


def _prompt_done(folder: Path, index: int, n: int) -> bool:
    return (folder / f"p{index:04d}.latents.safetensors").is_file() and all(
        (folder / f"p{index:04d}_{k:02d}.png").is_file() for k in range(n))


def cached_policy(cfg, suite, device):
    """The config's model, with the text cache of ``model.text_cache: disk`` holding the suite's prompts."""
    from flowrl.models import policy_from_config
    from flowrl.models.text_cache import attach_configured_cache

    policy = policy_from_config(cfg.model, device=device, seed=cfg.seed)
    attach_configured_cache(policy, cfg.model, cfg.run_dir, suite.prompts)
    return policy


def _render_missing(policy, suite, todo: list[int], folder: Path, cfg, *, base: bool, label: str,
                    settings: dict, shard: Shard = Shard()) -> None:
    """Render the prompts ``todo`` (indices into the suite), ``eval.batch_prompts`` at a time, and write them;
    under several processes (``shard``) each writes ``manifest.<rank>.json``, merged by the main one."""
    import contextlib

    from safetensors.torch import save_file
    from torchvision.utils import save_image

    from flowrl.eval.held_out import render
    from flowrl.core.media import stills
    from flowrl.sampling.self_guidance import SelfGuidance

    e, n = cfg.eval, cfg.eval.images_per_prompt
    folder.mkdir(parents=True, exist_ok=True)
    done = {k: v for k, v in _manifest_prompts(folder, settings).items() if int(k) not in todo}
    manifest = folder / ("manifest.json" if shard.world == 1 else f"manifest.{shard.rank}.json")
    steps = e.num_steps or cfg.sampling.num_steps
    guidance = cfg.sampling.guidance_scale if e.guidance_scale is None else e.guidance_scale
    guide = SelfGuidance.maybe(**cfg.sampling.self_guidance.settings())
    context = policy.reference() if base and policy.has_lora else contextlib.nullcontext()
    share = f" (process 0's share, {shard.world} processes)" if shard.world > 1 else ""
    bar = tqdm(total=len(todo), desc=f"eval {label}{share}", unit="prompt", disable=shard.rank > 0)
    with context, policy.sized(e.height, e.width, e.num_frames), bar:
        for chunk in _batches(todo, e.batch_prompts):  # consecutive suite indices: one rollout per batch
            images, latents = render(policy, suite.subset(chunk), images_per_prompt=n, num_steps=steps,
                                     guidance=guidance, seed=e.seed, first_prompt=chunk[0], batch_prompts=len(chunk),
                                     with_latents=True, self_guidance=guide)  # seeds: the suite index only
            strips = stills(images)  # [P*n, 3, H, W]; a video's frames side by side
            for row, index in enumerate(chunk):
                for k in range(n):
                    save_image(strips[row * n + k], folder / f"p{index:04d}_{k:02d}.png")
                frames = {"frames": str(images.shape[1])} if images.ndim == 5 else None  # a video's film strips
                save_file({"latents": latents[row * n:(row + 1) * n].contiguous()},
                          str(folder / f"p{index:04d}.latents.safetensors"), metadata=frames)
                done[str(index)] = suite.prompts[index]
            manifest.write_text(json.dumps({"settings": settings, "prompts": done}, indent=1))
            bar.update(len(chunk))


def _batches(indices: list[int], size: int) -> list[list[int]]:
    """``indices`` (sorted) cut into runs of consecutive values of at most ``size`` each."""
    batches: list[list[int]] = []
    for index in indices:
        if batches and batches[-1][-1] == index - 1 and len(batches[-1]) < size:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def read_images(folder: Path, num_prompts: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's written images ``[P*n, 3, H, W]`` (videos, written as film strips, back as clips
    ``[P*n, T, 3, H, W]``) and clean latents ``[P*n, C, (F,) h, w]``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from flowrl.core.media import clips

    images = torch.stack([read_rgb(folder / f"p{i:04d}_{k:02d}.png") for i in range(num_prompts) for k in range(n)])
    files = [str(folder / f"p{i:04d}.latents.safetensors") for i in range(num_prompts)]
    latents = torch.cat([load_file(file)["latents"] for file in files])
    if files:
        with safe_open(files[0], framework="pt") as handle:
            frames = int((handle.metadata() or {}).get("frames", 0))
        if frames:
            images = clips(images, frames)
    return images, latents


def load_reference(path: str, cfg) -> torch.Tensor:
    """Reference images ``[R, 3, H, W]`` in [0, 1] for FID/KID, resized to the eval resolution."""
    from torchvision.transforms.functional import resize

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"eval.reference: {path} is not a directory of images")
    files = image_files(folder)
    if len(files) < 2:
        raise ValueError(f"eval.reference: {path} holds {len(files)} images; FID/KID need at least 2 (hundreds for "
                         "a stable FID)")
    size = None
    images = []
    for file in files:
        image = read_rgb(file)
        size = size or (cfg.model.height or image.shape[1], cfg.model.width or image.shape[2])
        images.append(resize(image, list(size), antialias=True))
    return torch.stack(images)


# --- 2-4. scoring ----------------------------------------------------------------------------------
def score_all(cfg, suite, specs: list[EvalCheckpoint], images: dict[str, tuple], reference, device) -> dict:
    """results.json: the settings, and for each checkpoint its metrics and their change from the base."""
    from flowrl.features import build_feature_network
    from flowrl.rewards_api import build_rewards

    e, n = cfg.eval, cfg.eval.images_per_prompt
    rewards, weights = build_rewards(cfg.rewards, device) if cfg.rewards else ([], {})
    rewards, reward_states = with_trained_states(rewards, specs)
    trained = {k for k, w in weights.items() if w != 0}
    features = build_feature_network(e.features, **e.feature_kwargs)
    fid_network = (build_feature_network(e.fid_features or e.features, **(e.fid_feature_kwargs or e.feature_kwargs))
                   if reference is not None else None)
    style_probe = identity = None
    if e.style_model:
        from flowrl.eval.suites import StyleProbe

        style_probe = StyleProbe(e.style_model, e.style_pretrained)
    if e.identity_features:
        identity = build_feature_network(e.identity_features, **e.identity_feature_kwargs)
    group_ids = torch.arange(len(suite)).repeat_interleave(n)  # [P*n] one group per prompt
    group_axes = {i: prompt_axes(m) for i, m in enumerate(suite.metadata)}
    metrics, not_measured, unreliable, per_image = {}, set(), set(), {}
    for checkpoint in tqdm(specs, desc="scoring", unit="checkpoint"):
        rendered, latents = images[checkpoint.label]
        per_image[checkpoint.label] = {}
        values = reward_metrics(rewards, trained, rendered, suite, n, group_ids,  # rewards see whole clips
                                per_image=per_image[checkpoint.label])
        pictures = rendered[:, rendered.shape[1] // 2] if rendered.ndim == 5 else rendered  # a clip's middle frame
        values.update(diversity_metrics(features, pictures, latents, group_ids))
        axes, missing = axis_scores(pictures, group_ids, group_axes, style_probe=style_probe, identity_network=identity)
        values.update(axes)
        not_measured.update(missing)
        if e.toy_diversity:
            from flowrl.toy.diversity import diversity as toy_diversity

            values.update({f"toy/{k.removeprefix('diversity/')}": float(v)
                           for k, v in toy_diversity(pictures, group_ids).items()})
        if fid_network is not None:
            distance = _fid(reference, pictures, fid_network)
            unreliable.update(distance.pop("unreliable"))
            values.update({f"fid/{k}": v for k, v in distance.items()})
        metrics[checkpoint.label] = values
    base = next(c.label for c in specs if c.is_base)
    row_task = [task_of(m) for m in suite.metadata for _ in range(n)]  # [P * n] prompt-major, as the images
    return {
        "suite": str(e.suite), "prompts": suite.prompts, "tasks": [task_of(m) for m in suite.metadata],
        "images_per_prompt": n, "seed": e.seed, "num_steps": e.num_steps or cfg.sampling.num_steps,
        "guidance_scale": cfg.sampling.guidance_scale if e.guidance_scale is None else e.guidance_scale,
        "model": {"family": cfg.model.family, "path": cfg.model.path}, "features": e.features,
        "trained_rewards": sorted(trained), "base": base,
        "checkpoints": {c.label: {"path": None if c.is_base else str(c.path), "ema": c.ema} for c in specs},
        "metrics": metrics,
        "deltas": {label: {k: v - metrics[base][k] for k, v in values.items()
                           if k in metrics[base] and not math.isnan(v) and not math.isnan(metrics[base][k])}
                   for label, values in metrics.items() if label != base},
        "paired": {label: paired_reward_changes(per_image[base], scores, trained, row_task)
                   for label, scores in per_image.items() if label != base},
        "not_measured": sorted(not_measured), "unreliable": sorted(unreliable),
        "trained_reward_states": reward_states,
    }


def with_trained_states(rewards: list, specs: list[EvalCheckpoint]) -> tuple[list, dict[str, str | None]]:
    """``rewards`` with each reward that trains during a run (:class:`~flowrl.rewards_api.TrainableReward`) given
    the state its run saved (:func:`~flowrl.eval.checkpoints.trained_reward_states`), or left out where no
    checkpoint evaluated holds one: its fresh head would score at random. -> (rewards, {name: the checkpoint whose
    state scores it, or None where it was left out}); one line says which."""
    from flowrl.eval.checkpoints import trained_reward_states
    from flowrl.rewards_api import TrainableReward

    if not any(isinstance(r, TrainableReward) for r in rewards):
        return rewards, {}
    states, source = trained_reward_states(specs)
    kept, used = [], {}
    for reward in rewards:
        if isinstance(reward, TrainableReward):
            if reward.name not in states:
                used[reward.name] = None
                tqdm.write(f"reward {reward.name}: left out, it trains during a run and no checkpoint evaluated "
                           "holds its state (evaluate a checkpoint directory or a run directory with checkpoints)")
                continue
            reward.load_state_dict(states[reward.name])
            used[reward.name] = str(source)
            tqdm.write(f"reward {reward.name}: scored by the state saved in {source}, for every checkpoint")
        kept.append(reward)
    return kept, used


def paired_reward_changes(base: dict[str, torch.Tensor], other: dict[str, torch.Tensor], trained: set[str],
                          row_task: list[str | None]) -> dict[str, dict[str, float]]:
    """Each reward's change from the base with its paired standard error: both render every prompt on the same seeds,
    so the per-image differences carry no prompt or seed variance. ``{metric key: {gain, standard_error,
    standard_errors}}`` for the mean (``reward/<k>``, ``held_out/<k>``) and, with tasks, the mean over tasks."""
    from flowrl.data.tasks import paired_task_mean_gain

    out = {}
    for key in base.keys() & other.keys():
        if "/" in key:  # sub-scores: their means are in the metrics, their errors are not needed for the verdict
            continue
        name = f"{'reward' if key in trained else 'held_out'}/{key}"
        out[name] = paired_task_mean_gain(base[key], other[key], ["all"] * len(row_task))
        if any(t is not None for t in row_task):
            out[f"{name}/task_mean"] = paired_task_mean_gain(base[key], other[key], row_task)
    return out


def reward_metrics(rewards, trained: set[str], images, suite, n: int, group_ids,
                   per_image: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Reward means (``reward/*`` trained, ``held_out/*`` not), per task, and the zero-std prompt share;
    ``per_image``, when given, receives every score key's per-image values ``{key: [P * n]}`` (for paired errors)."""
    from flowrl.algorithms.advantages import zero_std_fraction
    from flowrl.eval.metrics import reward_means
    from flowrl.data.tasks import by_task, row_tasks
    from flowrl.rewards_api import score

    if not rewards:
        return {}
    rows_prompts = [p for p in suite.prompts for _ in range(n)]
    rows_metadata = [m for m in suite.metadata for _ in range(n)]
    # Bounded batches (a VLM reward holds every image it scores) of whole prompts (a group-wise reward scores a
    # prompt's n images as one group).
    scores, size = {}, max(64 // n, 1) * n
    for start in range(0, len(images), size):
        rows = slice(start, start + size)
        chunk = score(rewards, images[rows], rows_prompts[rows], rows_metadata[rows], groups=group_ids[rows],
                      on_error="nan")
        for key, value in chunk.items():
            scores.setdefault(key, []).append(value)
    scores = {k: torch.cat(v) for k, v in scores.items() if sum(len(x) for x in v) == len(images)}
    if per_image is not None:
        per_image.update(scores)
    out = reward_means(scores, trained)
    tasks = row_tasks(rows_metadata)
    if tasks is not None:
        for key, value in by_task(scores, tasks).items():
            name = key.split("/task", 1)[0]
            out[f"{'reward' if name in trained else 'held_out'}/{key}"] = value
    main = next(iter(sorted(trained)), next(iter(scores), None))
    if main is not None:
        out["diversity/zero_std_prompts"] = zero_std_fraction(scores[main], group_ids, tol=1e-6)
    return out


def diversity_metrics(features, images, latents, group_ids) -> dict[str, float]:
    """In-group diversity, each averaged over prompts: cosine distance and Vendi of the features, latent L-GMD."""
    from flowrl.eval.metrics import group_vendi, latent_gmd, pairwise_cosine_distance

    with torch.no_grad():
        embedded = torch.cat([features(images[s:s + 64]) for s in range(0, len(images), 64)]).float().cpu()
    return {"diversity/cosine": float(torch.nanmean(pairwise_cosine_distance(embedded, group_ids))),
            "diversity/vendi": float(torch.nanmean(group_vendi(embedded, group_ids))),
            "diversity/latent_gmd": float(torch.nanmean(latent_gmd(latents, group_ids, p=1.0)))}


def _fid(reference: torch.Tensor, images: torch.Tensor, network) -> dict:
    from flowrl.eval.metrics import fid_kid

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fid_kid(reference, images, network)
    for warning in caught[:1]:  # once per checkpoint is enough: every checkpoint shares the reference
        warnings.warn(str(warning.message), stacklevel=2)
    return result
