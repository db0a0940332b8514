"""The ``flowrl`` command line: train, sample, eval, export-lora, fit-reward, data prepare, serve-rewards.

Every subcommand takes a YAML config plus ``a.b=value`` overrides. Errors a user can fix (bad
config keys, missing files, impossible options, a reward that fails, a run that stopped itself to contain a
fault) are printed as one line, without a traceback; ``--debug`` (or ``FLOWRL_DEBUG=1``) re-raises them.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONFIG = "configs/toy/nft.yaml"


def seed(text: str) -> int:
    """A ``--seed``: a whole number >= 0 (numpy's generators take no other); argparse names the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _debug_arg(parser: argparse.ArgumentParser, default=False) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show the full traceback of an error (sets FLOWRL_DEBUG=1)")


def _config_args(parser: argparse.ArgumentParser, *, optional_config: bool = False) -> None:
    _debug_arg(parser, argparse.SUPPRESS)  # SUPPRESS: `flowrl --debug train` is not reset by the subcommand
    parser.add_argument("config", nargs="?",  # a missing one is explained by missing_config(), not argparse
                        help="YAML config file" + (" (default: the embedded toy config)" if optional_config else ""))
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. sampling.num_steps=4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowrl", description="RL alignment for flow-matching text-to-image models.")
    _debug_arg(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser("train", help="train a LoRA with an RL recipe (GRPO, NFT, TMPO, ...)")
    _config_args(train, optional_config=True)

    sample = commands.add_parser("sample", help="render an image grid for a list of prompts")
    _config_args(sample)
    sample.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    sample.add_argument("--prompts-file", help="a .txt or .jsonl prompt file")
    sample.add_argument("--num-per-prompt", type=int, default=4, help="images per prompt (one grid row each)")
    sample.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/samples.png)")
    sample.add_argument("--lora", default=None, help="LoRA weights to apply (.safetensors or peft dir)")
    sample.add_argument("--sde", action="store_true", help="sample with the configured SDE instead of the ODE")
    sample.add_argument("--raw", action="store_true",
                        help="write the bare mosaic at the model's pixels (default: rows labelled with their prompt, "
                             "small images enlarged for viewing)")
    sample.add_argument("--preference", default=None, metavar="W1,W2,...",
                        help="ParetoSlider: reward weights on the simplex, one per reward of the --lora run's "
                             "model.preference.rewards, in that order (e.g. 0.3,0.7)")

    evaluate = commands.add_parser("eval", help="benchmark checkpoints side by side: rewards, diversity, FID/KID, "
                                   "an HTML report")
    _config_args(evaluate)
    evaluate.add_argument("--checkpoint", action="append", default=[], metavar="[LABEL=]WHAT[:ema]",
                          help="base, a LoRA file, an adapter/export dir, a checkpoint dir or a run dir (repeatable; "
                               "the base model is always added; none: the config's run_dir); :ema takes a "
                               "checkpoint's EMA weights")
    evaluate.add_argument("--out", default=None, help="output directory (default: RUN_DIR/eval)")
    evaluate.add_argument("--suite", default=None, metavar="FILE|geneval",
                          help="the prompt suite instead of eval.suite: a .txt/.jsonl file (GenEval-format metadata "
                               "splits the tables by its tag), or geneval, the generated GenEval eval split")
    evaluate.add_argument("--preference", default=None, metavar="W1,W2,...",
                          help="ParetoSlider: render every checkpoint at these reward weights (each must be trained "
                               "with model.preference; one weight per reward, summing to 1)")

    export = commands.add_parser("export-lora", help="export a checkpoint's LoRA for diffusers or ComfyUI")
    _debug_arg(export, argparse.SUPPRESS)
    export.add_argument("checkpoint", help="checkpoint directory, or a run directory (its latest checkpoint)")
    export.add_argument("out", help="output directory")
    export.add_argument("--format", choices=("all", "diffusers", "comfyui", "kohya"), default="all",
                        help="all: the diffusers file (diffusers, ComfyUI, flowrl), the kohya file (lora_unet_ native "
                             "names) and README.md; diffusers / kohya: that file; comfyui: the diffusers file under "
                             "its old comfyui name. Every file has alpha/r folded into lora_B: strength 1.0 everywhere")
    export.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw LoRA")
    export.add_argument("--merge", action="store_true",
                        help="also write OUT/transformer: the base transformer with the LoRA fused in")
    export.add_argument("--force", action="store_true", help="overwrite export files already in OUT")
    export.add_argument("--svd-rank", type=int, default=None, metavar="R",
                        help="full fine-tuning checkpoints: also a LoRA of rank R extracted by truncated SVD of "
                             "W_trained - W_base (its reconstruction error is printed)")

    fit = commands.add_parser("fit-reward", help="fit the artifact reward (a logistic head on frozen image features) "
                              "on a folder of clean and a folder of artifact-containing images")
    _debug_arg(fit, argparse.SUPPRESS)
    fit.add_argument("clean_dir", help="folder of clean images (png, jpg, webp; subfolders included)")
    fit.add_argument("artifact_dir", help="folder of artifact-containing images")
    fit.add_argument("--out", required=True, help="the reward file to write (.safetensors), loaded by "
                     "rewards: [{name: fitted, kwargs: {path: FILE}}]")
    fit.add_argument("--features", default="toy", help="frozen feature network: toy, pixels, clip, dino, inception "
                     "(default toy, the toy world's)")
    fit.add_argument("--feature-kwargs", default="{}", help="JSON object of the feature network's arguments, e.g. "
                     "'{\"model\": \"ViT-L-14\", \"pretrained\": \"/path/open_clip.bin\"}'")
    fit.add_argument("--held-out", type=float, default=0.2, help="share of each folder held out to measure accuracy")
    fit.add_argument("--seed", type=seed, default=0, help="seed of the held-out split")
    fit.add_argument("--l2", type=float, default=1e-3, help="L2 penalty of the logistic head")
    fit.add_argument("--device", default="auto", help="where the feature network runs (auto: cuda when available)")
    fit.add_argument("--force", action="store_true", help="overwrite an existing --out")

    data = commands.add_parser("data", help="prepare a full prompt set (the files under assets/prompts are "
                               "small samples for smoke runs)")
    _debug_arg(data, argparse.SUPPRESS)
    data_commands = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prepare = data_commands.add_parser("prepare", help="write OUT's train and eval prompt files for NAME")
    _debug_arg(prepare, argparse.SUPPRESS)
    prepare.add_argument("name", metavar="NAME", help="geneval (generated offline: OUT/train.jsonl, OUT/eval.jsonl), "
                         "pickscore (Pick-a-Pic v1 captions) or ocr (Flow-GRPO's OCR prompts): OUT/train.txt, "
                         "OUT/eval.txt")
    prepare.add_argument("out", metavar="OUT", help="output directory")
    prepare.add_argument("--seed", type=seed, default=0, help="seed of the generated or shuffled split (geneval's "
                         "seed 0 is GenEval's published benchmark)")
    prepare.add_argument("--force", action="store_true", help="overwrite prompt files already in OUT")

    serve = commands.add_parser("serve-rewards", help="serve rewards over HTTP on Ray Serve (one deployment each, "
                                "batched, replicated) for `rewards: [{name: remote, kwargs: {url: ...}}]`")
    _config_args(serve)
    serve.add_argument("--address", default=None, help="Ray cluster to join (auto: the one `ray start` began on this "
                       "node; HOST:6379 a remote head); default: the config's address, else a local cluster")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; ``a.b=value`` overrides may also follow the options
    (``flowrl eval CONFIG --checkpoint X a.b=1``), which plain argparse would reject."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
    return args


def missing_config(command: str) -> str:
    if command == "serve-rewards":
        return ("'flowrl serve-rewards' needs a config: the YAML file of the reward service (address, rewards), e.g. "
                "'flowrl serve-rewards configs/serve/toy_cpu.yaml'")
    return (f"'flowrl {command}' needs a config: the YAML file of a run (model, sampling, rewards), e.g. "
            f"'flowrl {command} configs/toy/nft.yaml'; configs/smoke/ holds tiny offline ones, configs/toy/ the toy "
            "world's, and a run directory's config.yaml is one too")


def quiet_model_loading() -> None:
    """Turn off diffusers' and transformers' per-component loading bars ("Loading pipeline components",
    "Loading weights"): a run loads its models once, and the nested bars bury flowrl's own lines.
    The hub's download bars stay (a first download takes minutes); ``--debug`` keeps every bar."""
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    downloads = not hub_utils.are_progress_bars_disabled()
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()  # also turns the hub's bars off,
    if downloads:
        hub_utils.enable_progress_bars()  # which the download of a model keeps


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    if args.debug:
        os.environ["FLOWRL_DEBUG"] = "1"
    from flowrl.config import ConfigError
    from flowrl.rewards_api import RewardError, missing_extra
    from flowrl.training.faults import TrainingAborted

    try:
        if args.command in ("sample", "eval", "serve-rewards") and not args.config:
            raise ConfigError(missing_config(args.command))
        if args.command == "data":  # before quiet_model_loading: it loads no model, so it imports none
            from flowrl.commands.data import run_data_prepare

            for path in run_data_prepare(args):
                print(f"wrote {path}")
            return 0
        if args.command == "serve-rewards":  # loads no model here: each replica builds its own reward
            from flowrl.commands.serve_rewards import run_serve_rewards

            run_serve_rewards(args)
            return 0
        if not os.environ.get("FLOWRL_DEBUG"):
            quiet_model_loading()
        if args.command == "sample":
            from flowrl.commands.sample import run_sample

            out = run_sample(args)
            print(f"wrote {out}")
            return 0
        if args.command == "train":
            from flowrl.commands.train import run_train

            config, overrides = args.config, list(args.overrides)
            if config and "=" in config and not os.path.exists(config):  # `flowrl train a.b=1`: overrides only
                config, overrides = None, [config, *overrides]
            run_train(config or DEFAULT_CONFIG, overrides)
            return 0
        if args.command == "export-lora":
            from flowrl.commands.export import run_export

            for path in run_export(args):
                print(f"wrote {path}")
            return 0
        if args.command == "fit-reward":
            from flowrl.commands.fit_reward import describe, run_fit_reward

            summary = run_fit_reward(args)
            print(describe(summary))
            print(f"wrote {summary['path']}")
            return 0
        if args.command == "eval":
            from flowrl.eval.runner import run_eval

            report = run_eval(args.config, list(args.overrides), args.checkpoint, args.out, args.preference, args.suite)
            print(f"wrote {report}")
            return 0
        raise NotImplementedError(f"'flowrl {args.command}' is not available in this release yet")
    except (ConfigError, FileNotFoundError, NotImplementedError, ValueError, RewardError, TrainingAborted) as error:
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"flowrl {args.command}: error: {message}", file=sys.stderr)
        return 2
    except ImportError as error:  # a package of the rewards extra that this install left out (eval, tiny models)
        if not missing_extra(error) or os.environ.get("FLOWRL_DEBUG"):
            raise
        message = str(error) if "flowrl[rewards]" in str(error) else missing_extra(error)
        print(f"flowrl {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
