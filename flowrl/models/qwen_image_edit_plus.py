"""Qwen-Image-Edit-Plus (2509) policy adapter: editing with several source images per prompt.

The Plus pipeline is Qwen-Image-Edit's with two changes, and only those are here:

* a prompt takes a list of sources (``metadata["source_image"]`` a path or a list of paths): each is VAE-encoded
  at about 1024 x 1024 px, packed and appended after the noisy tokens in order, one grid each in ``img_shapes``;
* the text encoder sees every source at about 384 x 384 px, each announced as "Picture i:" before the
  instruction (the pipeline's template does that; the adapter hands it the resized list).
"""

from __future__ import annotations

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE

from flowrl.data.edit_sources import SOURCE_KEY
from flowrl.models.qwen_image_edit import QwenImageEditPolicy


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    family = "qwen_image_edit_plus"
    pipeline_class_name = "QwenImageEditPlusPipeline"
    several_sources = True
    condition_area = CONDITION_IMAGE_SIZE  # px: the area the text encoder sees each source at, 384 x 384

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_qwen_image_edit import tiny_qwen_image_edit_plus_pipeline

        return tiny_qwen_image_edit_plus_pipeline(seed)

    def vae_input(self, image):
        """``[1, 3, H, W]`` in [-1, 1]: the source preprocessed straight to the VAE area (the Plus pipeline)."""
        height, width = self.area_size(image, self.vae_area)
        return self.pipeline.image_processor.preprocess(image, height, width)

    def condition_images(self, images: list) -> list:
        """Every source resized to the condition area (~384 x 384 px) for the text encoder, in order."""
        return [self.pipeline.image_processor.resize(image, *self.area_size(image, self.condition_area))
                for image in images]

    def pipeline_image(self, images: list) -> list:
        return list(images)

    def example_metadata(self, num_prompts: int) -> list[dict]:
        """Two example sources per prompt (consecutive coloured shapes), as a list."""
        from flowrl.models.tiny_flux_kontext import example_source_paths

        paths = example_source_paths(num_prompts + 1)
        return [{SOURCE_KEY: [paths[i], paths[i + 1]]} for i in range(num_prompts)]
