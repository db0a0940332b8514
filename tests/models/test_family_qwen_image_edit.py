"""Qwen-Image-Edit and -Edit-Plus specifics (the shared checks are in tests/models/test_families.py): the source
latents appended to the noisy tokens as the pipelines append them, the text read together with the sources,
several sources for Plus, and the one-line errors of an editing prompt without its source."""

import inspect
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.data.edit_sources import load_source_image
from flowrl.data.prompts import load_prompts
from flowrl.models import build_policy
from flowrl.rewards_api import with_source_pixels
from tests.models.conftest import SMALL_VAE_AREA


@pytest.fixture(scope="module")
def edit():
    return build_policy("qwen_image_edit", "tiny", seed=0)


@pytest.fixture(scope="module")
def plus():
    return build_policy("qwen_image_edit_plus", "tiny", seed=0)


def _pipeline_source_tokens(policy, images, vae_sizes):
    """The packed source latents ``[1, Ss, 4C]`` the pipeline's own ``prepare_latents`` makes from the sources."""
    pipe = policy.pipeline
    pixels = [pipe.image_processor.preprocess(image, h, w).unsqueeze(2) for image, (h, w) in zip(images, vae_sizes)]
    argument = pixels if policy.several_sources else pixels[0]
    channels = pipe.transformer.config.in_channels // 4
    _, tokens = pipe.prepare_latents(argument, 1, channels, policy.height, policy.width, torch.float32, "cpu", None)
    return tokens


def test_edit_source_latents_and_text_are_the_pipelines(edit):
    meta = edit.example_metadata(1)
    image = load_source_image(meta[0]["source_image"])
    cond = edit.encode(["make it blue"], metadata=meta)
    # a 64 px square source goes to the VAE area's square (128 px in the suite, conftest.py): 4 x 4 latents (x32)
    assert edit.area_size(image, edit.vae_area) == (128, 128) and cond.image_latents.shape == (1, 1, 16, 4, 4)
    resized = edit.pipeline.image_processor.resize(image, 128, 128)
    theirs = _pipeline_source_tokens(edit, [resized], [(128, 128)])
    torch.testing.assert_close(edit.pack(cond.image_latents[:, 0]), theirs, rtol=0, atol=1e-6)
    text, _ = edit.pipeline.encode_prompt(prompt=["make it blue"], image=resized, device="cpu")
    torch.testing.assert_close(cond.prompt_embeds[:, :text.shape[1]], text, rtol=0, atol=0)
    assert cond.prompt_embeds.shape[1] == edit.max_sequence_length and cond.prompt_mask.sum() == text.shape[1]
    negative, _ = edit.pipeline.encode_prompt(prompt=[""], image=resized, device="cpu")  # the negative sees it too
    torch.testing.assert_close(cond.negative_prompt_embeds[:, :negative.shape[1]], negative, rtol=0, atol=0)


def test_the_velocity_runs_noisy_then_source_tokens_with_one_grid_each(edit, monkeypatch):
    cond = edit.encode(["make it blue"], metadata=edit.example_metadata(1))
    seen = {}
    forward = edit.transformer.forward

    def spy(**kwargs):
        seen.update(tokens=kwargs["hidden_states"].shape, shapes=kwargs["img_shapes"])
        return forward(**kwargs)

    monkeypatch.setattr(edit.transformer, "forward", spy)
    v = edit.velocity(edit.init_noise(1, torch.Generator().manual_seed(0)), 0.5, cond, 1.0)
    assert v.shape == edit.latent_shape(1)
    # one noisy token (32 px), then the 128 px source's 4 x 4 latents in 2 x 2 patches
    assert seen["tokens"] == (1, 1 + 2 * 2, 64) and seen["shapes"] == [[(1, 1, 1), (1, 2, 2)]]


def test_plus_takes_several_sources_in_order(plus):
    meta = plus.example_metadata(1)
    images = [load_source_image(p) for p in meta[0]["source_image"]]
    cond = plus.encode(["put the circle in the square"], metadata=meta)
    side = int(SMALL_VAE_AREA ** 0.5)  # px: the square sources at the suite's VAE area (tests/models/conftest.py)
    assert cond.image_latents.shape == (1, 2, 16, side // 32, side // 32)
    theirs = _pipeline_source_tokens(plus, images, [(side, side)] * 2)
    ours = torch.cat([plus.pack(cond.image_latents[:, k]) for k in range(2)], dim=1)  # [1, 2 * Ss, 64]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    condition = [plus.pipeline.image_processor.resize(image, 384, 384) for image in images]
    text, _ = plus.pipeline.encode_prompt(prompt=["put the circle in the square"], image=condition, device="cpu")
    torch.testing.assert_close(cond.prompt_embeds[:, :text.shape[1]], text, rtol=0, atol=0)
    one = plus.encode(["put the circle in the square"], metadata=[{"source_image": meta[0]["source_image"][0]}])
    assert one.image_latents.shape[1] == 1 and one.prompt_mask.sum() < cond.prompt_mask.sum()  # "Picture 2: ..." too


def test_the_source_areas_are_the_pipelines(monkeypatch):
    """Outside the suite's small Edit and Plus areas (tests/models/conftest.py, undone here) the policies resize sources as
    the pipelines do: Edit to its inline 1024 x 1024, Plus to its module's VAE and condition areas."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    from flowrl.models.qwen_image_edit import QwenImageEditPolicy
    from flowrl.models.qwen_image_edit_plus import QwenImageEditPlusPolicy

    monkeypatch.undo()  # the conftest's fixture patched through this same monkeypatch
    assert "calculate_dimensions(1024 * 1024," in inspect.getsource(pipeline_qwenimage_edit.QwenImageEditPipeline)
    assert QwenImageEditPolicy.vae_area == 1024 * 1024
    assert QwenImageEditPlusPolicy.vae_area == pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE == 1024 * 1024
    assert QwenImageEditPlusPolicy.condition_area == pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE


def test_an_edit_prompt_without_its_source_is_a_one_line_error(edit, plus):
    with pytest.raises(ValueError, match="qwen_image_edit: prompt 0 of the batch has no metadata 'source_image'"):
        edit.encode(["make it blue"])
    with pytest.raises(ValueError, match="prompt 1 of the batch has no metadata 'source_image' \\(a path\\)"):
        edit.encode(["a", "b"], metadata=edit.example_metadata(1) + [{}])
    with pytest.raises(ValueError, match="a path or a list of paths"):
        plus.encode(["a"], metadata=[{"source_image": []}])
    with pytest.raises(ValueError, match="no metadata 'source_image' \\(a path\\)"):  # a list is Plus's
        edit.encode(["a"], metadata=plus.example_metadata(1))


def test_prompt_files_resolve_every_source_and_rewards_see_the_first(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "metadata": {"source_image": ["x.png", "/abs/y.png"]}}))
    metadata = load_prompts(tmp_path / "p.jsonl").metadata
    assert metadata == [{"source_image": [str(tmp_path / "x.png"), "/abs/y.png"]}]
    shipped = load_prompts("assets/prompts/edit_plus_train.jsonl").metadata
    sources = [p for m in shipped for p in m["source_image"]]
    assert len(sources) == 4 and all(os.path.isfile(p) for p in sources)
    rows = with_source_pixels(torch.zeros(1, 3, 8, 8), shipped[:1])
    first = with_source_pixels(torch.zeros(1, 3, 8, 8), [{"source_image": shipped[0]["source_image"][0]}])
    torch.testing.assert_close(rows[0]["source_pixels"], first[0]["source_pixels"])
