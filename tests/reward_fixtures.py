"""Test-only rewards (importable by dotted path, e.g. ``tests.reward_fixtures:LeftRightContrast``)."""

import torch


class LeftRightContrast:
    """Mean brightness of the left half minus the right half: learnable even through the tiny random
    VAE, whose group norms make the image's overall brightness almost independent of the latent."""

    name = "contrast"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        half = images.shape[-1] // 2
        return {self.name: images[..., :half].mean(dim=(1, 2, 3)) - images[..., half:].mean(dim=(1, 2, 3))}
