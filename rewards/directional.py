"""D²-Align's directional correction for rewards that score through an image embedding.

Preference mode collapse follows a reward's own bias: a direction in its embedding space that it
rewards for every prompt (a house style, over-exposure, one background). Raising it raises the reward
whatever the prompt asked, so RL drives every image there. D²-Align learns that direction with the
reward frozen, then removes it from the reward during RL.

How flowrl learns it (``fit_direction``, run by ``python -m tools.d2align_fit`` on base-model samples): a
ridge regression of each image's reward on its embedding *within its prompt's group* (both centred
per group, a fixed-effects fit), ``delta = argmin sum_i (r_i - rbar_g - <e_i - ebar_g, delta>)^2 +
ridge * n * |delta|^2``. ``delta`` is how the reward changes along the embedding averaged over prompts:
what every prompt agrees on. Prompt-specific preferences point different ways for different prompts
and mostly cancel in it; a bias shared by all prompts does not.

How it is applied (:class:`DirectionalCorrection`): ``r'(x, p) = r(x, p) - strength * <e(x), delta>``.
For a cosine reward ``r = <e, t_p>`` that is ``<e, t_p - strength * delta>``: the text embedding moved
against the shared direction, the form D²-Align describes. ``strength`` 1 removes the fitted shared
part, smaller values damp it.

When it applies: rewards with an image embedding that the score is (close to) linear in: the CLIP
family (CLIPScore, PickScore, HPSv2), aesthetic heads on CLIP features, and the toy world's ToyClip.
The inner reward implements ``embed_images(images) -> [N, D]``. It does not apply to detector or VLM
rewards (OCR, checklists, ToyEval), which have no such space, and it cannot remove a bias that is not
in the embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch


def fit_direction(embeddings: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, *,
                  ridge: float = 1e-3) -> torch.Tensor:
    """[D] the within-group (fixed-effects) ridge fit of ``rewards`` [N] on ``embeddings`` [N, D]; rows
    with a NaN reward or embedding are left out."""
    keep = torch.isfinite(rewards) & torch.isfinite(embeddings).all(1)
    e, r, g = embeddings[keep].double(), rewards[keep].double(), group_ids[keep]
    if not len(r):
        raise ValueError("no finite (reward, embedding) pair to fit the direction on")
    _, inverse = torch.unique(g, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    e_mean = torch.zeros(groups, e.shape[1], dtype=torch.float64).index_add_(0, inverse, e) / count[:, None]
    r_mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, r) / count
    ec, rc = e - e_mean[inverse], r - r_mean[inverse]
    gram = ec.T @ ec + ridge * len(r) * torch.eye(e.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, ec.T @ rc).float()


def save_direction(path: str | Path, direction: torch.Tensor, *, reward: str, metadata: Mapping[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({"direction": direction.float().contiguous()}, str(path),
              metadata={"reward": reward, **{k: str(v) for k, v in metadata.items()}})


def load_direction(path: str | Path) -> tuple[torch.Tensor, dict[str, str]]:
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"direction file not found: {path} (write one with python -m tools.d2align_fit)")
    with safe_open(str(path), framework="pt") as f:
        if "direction" not in f.keys():
            raise ValueError(f"{path} holds no 'direction' tensor (write it with python -m tools.d2align_fit)")
        return f.get_tensor("direction"), dict(f.metadata() or {})


class DirectionalCorrection:
    """Reward protocol around an embedding reward: ``{name}_d2`` is the corrected score, ``/raw`` the
    inner one, ``/shared`` the removed part ``<e, delta>``; the inner reward's other outputs pass through."""

    def __init__(self, reward: str, direction: str, strength: float = 1.0, device: Any = None,
                 **reward_kwargs: Any) -> None:
        from flowrl.rewards_api import accepts_keyword, build_reward

        if device is not None and accepts_keyword(reward, "device"):
            reward_kwargs.setdefault("device", device)  # each process scores on its own accelerator
        self.inner = build_reward(reward, **reward_kwargs)
        if not hasattr(self.inner, "embed_images"):
            raise ValueError(f"reward '{reward}' has no image embedding (embed_images), so D²-Align's correction "
                             "does not apply to it; see rewards/directional.py for the rewards it fits")
        self.direction, meta = load_direction(direction)
        if meta.get("reward") not in (None, reward):
            raise ValueError(f"{direction} was fitted for reward '{meta['reward']}', not '{reward}'")
        self.strength = float(strength)
        self.name = f"{self.inner.name}_d2"
        self.scores_groups = getattr(self.inner, "scores_groups", False)  # a group-wise inner reward: called per group

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        embeddings = self.inner.embed_images(images).float()  # [N, D], computed once
        if embeddings.shape[1] != self.direction.numel():
            raise ValueError(f"the direction has {self.direction.numel()} dimensions, the reward's embedding "
                             f"{embeddings.shape[1]}: refit it for this reward")
        if hasattr(self.inner, "score_embeddings"):  # the score from the same embeddings
            raw, extra = self.inner.score_embeddings(embeddings, self.inner.embed_texts(prompts, metadata)), {}
        else:  # the inner reward embeds again inside its own call
            scores = self.inner(images, prompts, metadata)
            raw = scores[self.inner.name]
            extra = {f"{self.name}/{k.split('/', 1)[1]}": v for k, v in scores.items() if "/" in k}
        shared = embeddings @ self.direction.to(embeddings)  # [N]
        raw = raw.float()
        return {self.name: raw - self.strength * shared, f"{self.name}/raw": raw, f"{self.name}/shared": shared,
                **extra}
