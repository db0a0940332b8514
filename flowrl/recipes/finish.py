"""The end of a run: the final export (the EMA LoRA in diffusers and kohya layout, or the fully fine-tuned
transformer folder) and the before/after report on held-out prompts."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from flowrl.eval.report import write_report
from flowrl.data.tasks import stratified_prefix
from flowrl.models.lora_io import lora_config_dict, lora_state_dict
from flowrl.recipes.epoch_end import eval_size
from flowrl.recipes.run import Run
from flowrl.training.ema import ema_weights


def finish_run(run: Run, metrics: dict) -> dict[str, float]:
    """Export the final adapter (EMA weights when kept) and report before/after on held-out prompts. A finished run
    resumed again (nothing left to train, its export and report written) says so and rebuilds nothing."""
    cfg, accelerator = run.cfg, run.accelerator
    exported = run.run_dir / ("transformer/config.json" if run.policy.full_weights is not None else
                              "lora/pytorch_lora_weights.safetensors")
    if not metrics and run.start_epoch >= cfg.train.epochs and (not cfg.train.export_lora or exported.is_file()) and (
            not cfg.log.report_prompts or (run.run_dir / "report.json").is_file()):
        if accelerator.is_main_process:
            report = f"; its report: {run.run_dir / 'report.html'}" if cfg.log.report_prompts else ""
            tqdm.write(f"flowrl train: the run in {run.run_dir} is complete ({run.start_epoch} epochs){report}; "
                       "raise train.epochs to train it further")
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return metrics
    for finish in run.hook("finish"):  # the diversity guard: export and report the best reward-diversity weights
        finish(run)
    if cfg.train.export_lora and run.policy.full_weights is not None:  # full weights: a diffusers transformer folder
        export_final_transformer(run.policy, run.exported_ema, run.run_dir / "transformer",
                                 write=accelerator.is_main_process)
    elif cfg.train.export_lora:  # every rank gathers (FSDP2), the main one writes
        export_final_lora(run.policy, run.exported_ema, run.run_dir / "lora", write=accelerator.is_main_process)
    if cfg.log.report_prompts:
        prompts = stratified_prefix(run.test_prompts, cfg.log.report_prompts)  # equal share per task
        if accelerator.is_main_process:  # the report samples both models: minutes on a CPU, not a silence
            tqdm.write(f"flowrl train: writing the report: {len(prompts)} held-out prompts x "
                       f"{cfg.log.eval_images_per_prompt} images, before and after training")
        with eval_size(run.policy, cfg):
            report = write_report(run.run_dir, policy=run.policy, ema=run.exported_ema, rewards=run.rewards,
                                  prompts=prompts, images_per_prompt=cfg.log.eval_images_per_prompt,
                                  num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps,
                                  guidance=run.eval_guidance, seed=cfg.seed + 2, diversity=cfg.log.report_diversity,
                                  save=accelerator.is_main_process,
                                  trained=[r.key or r.name for r in cfg.rewards if r.weight != 0])
        metrics.update({f"report/{when}/{k}": v for when in ("before", "after") for k, v in report[when].items()})
        if accelerator.is_main_process:
            tqdm.write(f"flowrl train: {metrics.get('epoch', -1) + 1} epochs; {report['summary']}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def export_final_lora(policy, ema, out_dir: Path, config_file: Path | None = None, *, write: bool = True) -> Path:
    """Write the adapter (EMA weights when kept) to ``out_dir`` as ``export-lora --format all`` does: the diffusers
    file (returned), the kohya file and a README, scale folded, with the base model and the hash of ``config_file``
    (default ``out_dir/../config.yaml``, the run's saved config) in the metadata. Overwrites an earlier export.

    Under FSDP2 every process must call this (the sharded adapter is gathered whole); only ``write`` ones write."""
    import yaml

    from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME, write_lora_files

    with ema_weights(ema):
        state = lora_state_dict(policy.transformer)
    if not write:
        return Path(out_dir) / DIFFUSERS_WEIGHT_NAME
    config_file = Path(config_file) if config_file is not None else Path(out_dir).parent / "config.yaml"
    config_text = config_file.read_text() if config_file.is_file() else None
    model = (yaml.safe_load(config_text) or {}).get("model", {}) if config_text else {}
    family = model.get("family") or policy.family
    base_model = model.get("path") or getattr(policy.pipeline, "name_or_path", None)
    preference = policy.preference.describe() if getattr(policy, "preference", None) is not None else None
    return write_lora_files(out_dir, state, lora_config_dict(policy.transformer), family=family, base_model=base_model,
                            config_text=config_text, force=True, preference=preference)[0]


def export_final_transformer(policy, ema, out_dir: Path, *, write: bool = True) -> Path:
    """Write the fully fine-tuned transformer (EMA weights when kept) to ``out_dir`` as a diffusers model folder
    that ``<Transformer class>.from_pretrained`` loads: every tensor, in the model's dtype. Under FSDP2 every
    process must call this (the weights are gathered whole); only ``write`` ones write."""
    from flowrl.models.full_weights import save_transformer

    with ema_weights(ema):
        return save_transformer(policy, out_dir, write=write)
