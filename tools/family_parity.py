"""Max abs difference between flowrl's ODE rollout and each family's own diffusers pipeline (tiny, offline).

    HF_HUB_OFFLINE=1 .venv/bin/python -m tools.family_parity [--family F] [--steps 3]

Same prompts, per-row seeds, steps and guidance (the family's default) on both sides: ``rollout`` with
``noise_level=0`` against ``policy.pipeline_images(...)``, the family's ``__call__``. The figure behind the
README's "ODE vs pipeline" column; tests/models/test_families.py asserts it stays under 1e-5.
"""

from __future__ import annotations

import argparse
import sys

from flowrl.models import FAMILIES, build_policy
from flowrl.sampling import RolloutSettings, rollout

PROMPTS = ["a red circle", "two blue squares"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default=None, help="default: every family")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=2)
    args = parser.parse_args(argv)
    seeds = list(range(11, 11 + len(PROMPTS) * args.group_size))
    for family in [args.family] if args.family else FAMILIES:
        policy = build_policy(family, "tiny", seed=0)
        metadata, guidance = policy.example_metadata(len(PROMPTS)), policy.default_guidance
        rows = dict(group_size=args.group_size, seeds=seeds, metadata=metadata)
        ode = RolloutSettings(num_steps=args.steps, guidance_scale=guidance, noise_level=0.0)
        ours = rollout(policy, PROMPTS, ode, **rows).images
        theirs = policy.pipeline_images(PROMPTS, num_steps=args.steps, guidance_scale=guidance, **rows)
        print(f"{family:<13} guidance {guidance:<4} {args.steps} steps: max |flowrl - diffusers| = "
              f"{(ours - theirs).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
