"""One backward pass of an optimizer step's accumulation, through accelerate's own mechanism.

The recipes accumulate over micro-batches (and GRPO over denoising steps) themselves and know which
backward is the last before their optimizer step; the number varies per step (micro-batches x
trained steps), which a fixed ``gradient_accumulation_steps`` cannot express. So each backward runs
inside :func:`micro_batch` with ``last`` said explicitly:

* DDP / FSDP2: gradients are not all-reduced (reduce-scattered) before the last backward
  (``accelerator.no_sync``; FSDP2: ``set_requires_gradient_sync(False)``).
* DeepSpeed: accelerate's ``sync_gradients`` flag is False until the last backward, so
  ``accelerator.backward`` marks DeepSpeed's gradient-accumulation boundary there
  (``engine.set_gradient_accumulation_boundary``) and the engine steps once per optimizer step
  (clip at ``gradient_clipping`` = ``train.max_grad_norm``, AdamW, zero grad) instead of after every
  micro-batch. DeepSpeed's own ``gradient_accumulation_steps`` stays 1, so its backward does not
  rescale a loss the recipe has already normalised over the whole step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def micro_batch(accelerator, model, *, last: bool) -> Iterator[None]:
    """Run one accumulated backward; ``last``: the final one before the optimizer step."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.sync_gradients = last
        try:
            yield
        finally:
            accelerator.sync_gradients = True  # what the optimizer step and everything after it expect
        return
    with torch.enable_grad() if last else accelerator.no_sync(model):
        yield
