"""The tiny Qwen-Image-Edit-Plus sources go through the VAE at 128 x 128 px, not the pipeline's 1024 x 1024.

The Plus pipeline reads its VAE area from a module constant at call time, and its policy from ``vae_area``: the
fixture sets both, so every comparison of flowrl with the pipeline still runs both at one area. At 1024 x 1024 the
tiny VAE's encoding was most of each Plus test's time (about 50 s of the suite). The Edit pipeline writes its
area inline, so Qwen-Image-Edit tests keep the full size; ``test_the_source_areas_are_the_pipelines`` holds the
policies' defaults to the pipeline's constants.
"""

import pytest

SMALL_VAE_AREA = 128 * 128


@pytest.fixture(autouse=True)
def small_qwen_edit_plus_vae_area(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from flowrl.models.qwen_image_edit_plus import QwenImageEditPlusPolicy

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SMALL_VAE_AREA)
    monkeypatch.setattr(QwenImageEditPlusPolicy, "vae_area", SMALL_VAE_AREA)
