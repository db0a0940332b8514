"""The tiny Qwen-Image-Edit and Qwen-Image-Edit-Plus sources go through the VAE at 128 x 128 px, not the pipelines'
1024 x 1024.

At 1024 x 1024 the tiny VAE's encoding of each source was most of every Edit and Plus test's time (about 110 s of
the suite). The fixture shrinks each pipeline's area and its policy's ``vae_area`` together, so every comparison of
flowrl with a pipeline still runs both sides at one area:

- the Plus pipeline reads its VAE area from a module constant at call time: the fixture sets the constant;
- the Edit pipeline writes ``calculate_dimensions(1024 * 1024, ratio)`` inline in ``__call__``: the fixture wraps
  that module's ``calculate_dimensions`` so a request for 1024 x 1024 is answered at the small area (any other
  area passes through).

``test_the_source_areas_are_the_pipelines`` undoes the fixture and holds the policies' defaults to the pipelines'.
"""

import pytest

SMALL_VAE_AREA = 128 * 128
PIPELINE_AREA = 1024 * 1024  # the area both pipelines resize a source to before the VAE


@pytest.fixture(autouse=True)
def small_qwen_edit_vae_area(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    from flowrl.models.qwen_image_edit import QwenImageEditPolicy
    from flowrl.models.qwen_image_edit_plus import QwenImageEditPlusPolicy

    pipeline_sizes = pipeline_qwenimage_edit.calculate_dimensions

    def small_sizes(target_area, ratio):
        return pipeline_sizes(SMALL_VAE_AREA if target_area == PIPELINE_AREA else target_area, ratio)

    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", small_sizes)
    monkeypatch.setattr(QwenImageEditPolicy, "vae_area", SMALL_VAE_AREA)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SMALL_VAE_AREA)
    monkeypatch.setattr(QwenImageEditPlusPolicy, "vae_area", SMALL_VAE_AREA)
