"""Count the device-to-host reads of a training epoch: does any happen once per micro-batch?

On a GPU every ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()`` or ``.cpu()`` of a
device tensor waits for the GPU to drain its queue (a host sync). This script counts those calls (a
``TorchFunctionMode`` over the training thread; the reward worker thread is not counted) while the tiny SD3
smoke config trains ``--epochs`` epochs, once with micro-batches of ``--small`` rows and once of ``--large``. A
read per micro-batch shows up as a count that grows with the number of micro-batches; reads per epoch or per
optimizer step do not change. On the CPU the calls are counted, not timed: each is a sync on a GPU.

Run from the repository root:
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench/host_syncs.py
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

READS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu")


class CountReads(TorchFunctionMode):
    """Counts tensor-to-host reads, by kind and by the flowrl line that made them."""

    def __init__(self):
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.kinds[name] += 1
            site = next((f"{Path(f.filename).relative_to(Path.cwd())}:{f.lineno}"
                         for f in reversed(traceback.extract_stack()[:-1])
                         if "/flowrl/" in f.filename and "site-packages" not in f.filename), "elsewhere")
            self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def count(recipe: str, micro_batch: int, epochs: int) -> CountReads:
    from flowrl.commands.train import run_train

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run_dir={tmp}/run", f"recipe={recipe}", f"train.epochs={epochs}",
                     f"train.micro_batch_size={micro_batch}", "log.progress=false", "log.eval_every=0",
                     "log.report_prompts=0", "train.checkpoint_every=0", "sampling.group_size=4",
                     "sampling.prompts_per_batch=2"]
        if recipe == "grpo":
            overrides.append("train.clip_range=0.2")
        counter = CountReads()
        with counter:
            run_train("configs/smoke/sd3_tiny.yaml", overrides)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--small", type=int, default=1, help="rows per micro-batch of the first run")
    parser.add_argument("--large", type=int, default=8, help="rows per micro-batch of the second run")
    parser.add_argument("--recipes", nargs="+", default=["grpo", "nft"])
    parser.add_argument("--sites", type=int, default=8, help="busiest flowrl lines to list per run")
    args = parser.parse_args()
    torch.manual_seed(0)
    for recipe in args.recipes:
        runs = {size: count(recipe, size, args.epochs) for size in (args.small, args.large)}
        small, large = (sum(runs[s].kinds.values()) / args.epochs for s in (args.small, args.large))
        print(f"{recipe}: host reads per epoch: {small:.0f} with micro-batches of {args.small}, "
              f"{large:.0f} of {args.large}; growth from more micro-batches: {small - large:+.0f}")
        for size, counter in runs.items():
            busiest = ", ".join(f"{site} x{n}" for site, n in counter.sites.most_common(args.sites))
            print(f"  micro-batch {size}: {dict(counter.kinds)}; busiest: {busiest}")


if __name__ == "__main__":
    main()
