"""``flowrl fit-reward CLEAN_DIR ARTIFACT_DIR --out FILE``: fit the artifact reward on two folders of images.

The reward (``fitted``, ``rewards/fitted.py``) is a logistic head on frozen image features; this command only
wires the arguments to its ``fit`` and prints what came of it. flowrl never imports the reward plugins, so
the class is resolved by its registry name through the reward seam, at call time, as ``build_reward`` does.
``fit`` checks every input (folders, image counts, feature name, an existing ``--out``) before it reads an
image and writes ``--out`` atomically once the head is fitted, so a bad input leaves no file.
"""

from __future__ import annotations

import json
from typing import Any


def run_fit_reward(args) -> dict[str, Any]:
    """Fit and write the reward file; returns ``fit``'s summary (held-out accuracy and counts, the path)."""
    from flowrl.features import FEATURE_NETWORKS
    from flowrl.rewards_api import resolve_reward_class

    if args.features not in FEATURE_NETWORKS:  # before the plugin is imported: one line naming the choices
        raise ValueError(f"--features {args.features!r} is not a feature network; choose one of "
                         f"{', '.join(sorted(FEATURE_NETWORKS))}")
    try:
        feature_kwargs = json.loads(args.feature_kwargs)
    except json.JSONDecodeError as error:
        raise ValueError(f"--feature-kwargs is not a JSON object ({error.msg}), e.g. "
                         "'{\"model\": \"ViT-L-14\", \"pretrained\": \"/path/open_clip.bin\"}'") from None
    if not isinstance(feature_kwargs, dict):
        raise ValueError(f"--feature-kwargs must be a JSON object, got {type(feature_kwargs).__name__}")
    fitted = resolve_reward_class("fitted")
    return fitted.fit(args.clean_dir, args.artifact_dir, args.out, features=args.features,
                      feature_kwargs=feature_kwargs, held_out=args.held_out, seed=args.seed, l2=args.l2,
                      device=args.device, force=args.force)


def describe(summary: dict[str, Any]) -> str:
    """The one line the command prints: held-out accuracy first, then what it was fitted and tested on."""
    fit, held = summary["counts"]["fit"], summary["counts"]["held_out"]
    return (f"held-out accuracy {summary['held_out_accuracy']:.4f} ({summary['held_out_correct']} of "
            f"{summary['held_out_total']}: {held['clean']} clean, {held['artifact']} artifact); fitted on "
            f"{fit['clean']} clean + {fit['artifact']} artifact images (fit accuracy "
            f"{summary['fit_correct'] / summary['fit_total']:.4f})")
