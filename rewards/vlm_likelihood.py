"""Prompt-alignment rewards read straight off a VLM's logits (no generation, no parsing).

VlmYes ("vlm_yes"): P("Yes") to "Does this image match the description: {prompt}? Answer Yes
or No." -- a cheap, dense text-image alignment score in [0, 1] (VQAScore-style).

PromptEcho ("prompt_echo"): how well the image "explains" its prompt: the mean per-token
log-likelihood of the prompt text as the VLM's answer to "Describe this image." (= minus the
token cross-entropy of the prompt given the image). Higher (closer to 0) is better; values are
<= 0 and not bounded below. The mean over tokens, not the sum, puts long and short prompts on one
scale. It rewards images from which a captioner would reproduce the prompt's own words.

Both load any chat-template VLM via `rewards.vlm_common` (default Qwen2.5-VL-7B-Instruct), or
take an injected model + processor, and score images with NaN/inf pixels NaN.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from flowrl.rewards_api import check_batch
from rewards.vlm_common import DEFAULT_VLM, images_to_pil, resolve_vlm, text_log_likelihood, yes_probability


class _VlmReward:
    """Holds the VLM and maps a scoring function over the finite images of a batch."""

    name = "vlm"

    def __init__(self, model: Any, processor: Any, device: str, dtype: str | None, batch_size: int,
                 trust_remote_code: bool) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.model, self.processor = resolve_vlm(model, processor, device=device, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)

    def _score(self, pils: list, prompts: list[str]) -> torch.Tensor:  # -> [M]
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        n = check_batch(images, prompts, metadata)
        pils, finite = images_to_pil(images)  # N PIL, [N]
        keep = [i for i in range(n) if bool(finite[i])]
        out = torch.full((n,), math.nan)
        if keep:
            out[keep] = self._score([pils[i] for i in keep], [prompts[i] for i in keep]).float()
        return {self.name: out}


class VlmYes(_VlmReward):
    """P(yes) in [0, 1] that the image matches its prompt. ``template`` holds "{prompt}"; the
    prompt's trailing periods/spaces are dropped so "a cat." does not read "a cat.?"."""

    name = "vlm_yes"

    def __init__(self, model: Any = DEFAULT_VLM, processor: Any = None,
                 template: str = "Does this image match the description: {prompt}? Answer Yes or No.",
                 device: str = "auto", dtype: str | None = None, batch_size: int = 8,
                 yes_token: str = "Yes", no_token: str = "No", trust_remote_code: bool = False) -> None:
        if "{prompt}" not in template:
            raise ValueError(f"template must contain '{{prompt}}', got {template!r}")
        self.template, self.yes_token, self.no_token = template, yes_token, no_token
        super().__init__(model, processor, device, dtype, batch_size, trust_remote_code)

    def _score(self, pils: list, prompts: list[str]) -> torch.Tensor:
        questions = [self.template.format(prompt=p.strip().rstrip(". ")) for p in prompts]
        return yes_probability(self.model, self.processor, pils, questions, self.batch_size,
                               self.yes_token, self.no_token)


class PromptEcho(_VlmReward):
    """Mean log-likelihood (<= 0) of the prompt as the VLM's reply to ``instruction`` given the
    image; an empty prompt scores NaN."""

    name = "prompt_echo"

    def __init__(self, model: Any = DEFAULT_VLM, processor: Any = None,
                 instruction: str = "Describe this image.", device: str = "auto", dtype: str | None = None,
                 batch_size: int = 8, trust_remote_code: bool = False) -> None:
        self.instruction = instruction
        super().__init__(model, processor, device, dtype, batch_size, trust_remote_code)

    def _score(self, pils: list, prompts: list[str]) -> torch.Tensor:
        return text_log_likelihood(self.model, self.processor, pils, prompts, self.instruction, self.batch_size)
