"""FLUX.1 Kontext specifics (the shared checks are in tests/models/test_families.py): the source image's path from
the prompt file to the transformer, the source pixels the scorer hands edit rewards, the edit reward,
and the LoRA export formats."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.data.prompts import PromptSet, load_prompts
from flowrl.models import build_policy
from flowrl.data.edit_sources import source_pixels
from flowrl.models.lora_io import (COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, lora_config_dict,
                                   lora_state_dict, write_lora_files)
from flowrl.eval.held_out import evaluate_rows
from flowrl.rewards_api import build_reward, score
from rewards.edit import EditPreservation


@pytest.fixture(scope="module")
def policy():
    return build_policy("flux_kontext", "tiny", seed=0)


def test_prompt_file_sources_are_relative_to_the_file(tmp_path):
    (tmp_path / "images").mkdir()
    absolute = str(tmp_path / "elsewhere.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "metadata": {"source_image": "images/x.png"}}) + "\n"
                                      + json.dumps({"prompt": "b", "metadata": {"source_image": absolute}}) + "\n")
    metadata = load_prompts(tmp_path / "p.jsonl").metadata
    assert metadata == [{"source_image": str(tmp_path / "images" / "x.png")}, {"source_image": absolute}]
    shipped = load_prompts("assets/prompts/edit_train.jsonl").metadata
    assert all(os.path.isfile(m["source_image"]) for m in shipped)


def test_encode_holds_the_pipelines_source_latents_per_prompt_and_caches_them(policy, monkeypatch):
    metadata = policy.example_metadata(3)
    cond = policy.encode(["a", "b", "c"], metadata=metadata)
    assert cond.image_latents.shape == (3, *policy.latent_shape(1)[1:])  # [B, C, h, w]
    pipe = policy.pipeline
    for row, meta in enumerate(metadata):  # the pipeline's own preprocessing and prepare_latents encoding
        image = Image.open(meta["source_image"]).convert("RGB")
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, 64, 64), 64, 64)
        torch.testing.assert_close(cond.image_latents[row:row + 1], pipe._encode_vae_image(pixels, None),
                                   rtol=0, atol=0)
    assert torch.equal(cond.select([2, 0, 0]).image_latents, cond.image_latents[[2, 0, 0]])  # rows index the source
    calls = []
    monkeypatch.setattr(policy.vae, "encode", lambda *a, **k: calls.append(1))
    again = policy.encode(["a", "b", "c"], metadata=metadata)
    assert not calls and torch.equal(again.image_latents, cond.image_latents)


def test_the_source_conditions_the_velocity(policy):
    x = policy.init_noise(2, generator=torch.Generator().manual_seed(0))
    metadata = policy.example_metadata(2)
    edit = policy.encode(["a", "a"], metadata=metadata)
    plain = policy.encode(["a", "a"])
    assert plain.image_latents is None
    with torch.no_grad():
        v_edit, v_plain = (policy.velocity(x, 0.5, c, 2.5) for c in (edit, plain))
    assert v_edit.shape == x.shape and not torch.allclose(v_edit[0], v_plain[0], atol=1e-4)
    assert not torch.allclose(v_edit[0], v_edit[1], atol=1e-4)  # two sources, two velocities
    ids = policy.source_image_ids(*policy.latent_shape(1)[2:])
    assert torch.equal(ids[:, 0], torch.ones(len(ids))) and torch.equal(ids[:, 1:], policy.image_ids(8, 8)[:, 1:])


def test_a_missing_or_partial_source_is_a_one_line_error(policy, tmp_path):
    with pytest.raises(FileNotFoundError, match="source image not found: .*nope.png") as error:
        policy.encode(["a"], metadata=[{"source_image": str(tmp_path / "nope.png")}])
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="prompt 1 of the batch has no metadata 'source_image'"):
        policy.encode(["a", "b"], metadata=policy.example_metadata(1) + [{}])


def test_edit_preservation_by_hand():
    images = torch.tensor([[[[0.0, 1.0], [0.5, 0.5]]] * 3, [[[0.2, 0.2], [0.2, 0.2]]] * 3])  # [2, 3, 2, 2]
    source = torch.full((3, 2, 2), 0.5)
    out = EditPreservation()(images, ["a", "b", "c"][:2], [{"source_pixels": source}, {"source_pixels": source}])
    # row 0: |d| = 0.5, 0.5, 0, 0 -> mean 0.25 -> 0.75; row 1: |d| = 0.3 everywhere -> 0.7
    torch.testing.assert_close(out["edit_preservation"], torch.tensor([0.75, 0.7]))
    no_source = EditPreservation()(images, ["a", "b"], [{"source_pixels": source}, {}])["edit_preservation"]
    assert no_source[0] == 0.75 and torch.isnan(no_source[1])
    assert build_reward("edit_preservation").name == "edit_preservation"


def test_the_scorer_hands_rewards_the_source_without_touching_the_metadata(tmp_path):
    pixels = np.tile(np.array([51, 102, 204], dtype=np.uint8), (8, 8, 1))  # (0.2, 0.4, 0.8), resizes to itself
    Image.fromarray(pixels).save(tmp_path / "src.png")
    metadata = [{"source_image": str(tmp_path / "src.png"), "task": "edit"}, {"task": "none"}]
    seen = []

    class Spy:
        name = "spy"

        def __call__(self, images, prompts, metadata):
            seen.extend(metadata)
            return {"spy": torch.zeros(len(images))}

    images = torch.full((2, 3, 4, 4), 0.5)  # the output's size, not the source's
    scores = score([Spy(), EditPreservation()], images, ["a", "b"], metadata)
    assert seen[0]["source_pixels"].shape == (3, 4, 4) and seen[0]["source_image"] == str(tmp_path / "src.png")
    assert "source_pixels" not in seen[1]
    torch.testing.assert_close(seen[0]["source_pixels"], source_pixels(str(tmp_path / "src.png"), 4, 4))
    assert 0 <= seen[0]["source_pixels"].min() and seen[0]["source_pixels"].max() <= 1
    torch.testing.assert_close(seen[0]["source_pixels"][:, 0, 0], torch.tensor([0.2, 0.4, 0.8]))
    # |0.5 - (0.2, 0.4, 0.8)| = (0.3, 0.1, 0.3), mean 0.7 / 3 -> 1 - 0.2333
    assert scores["edit_preservation"][0] == pytest.approx(1 - 0.7 / 3) and torch.isnan(scores["edit_preservation"][1])
    assert metadata == [{"source_image": str(tmp_path / "src.png"), "task": "edit"}, {"task": "none"}]  # untouched
    json.dumps(metadata)  # what reports and metrics write stays JSON
    summary, _ = evaluate_rows(images[:1], PromptSet(["a"], metadata[:1]), 1, [EditPreservation()], "none")
    json.dumps(summary)


def test_lora_exports_in_every_format(tmp_path):
    """diffusers and comfyui files load in plain FluxKontextPipeline; the kohya file through the sd-scripts reader
    of tools/comfyui_reference.py (diffusers' kohya converter hard-codes FLUX.1's 3072 width, so not the tiny one)."""
    from safetensors.torch import load_file

    from tools import comfyui_reference as comfy

    trained = build_policy("flux_kontext", "tiny", seed=0)
    trained.add_lora(rank=4, alpha=8.0, init_seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in trained.trainable_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    state, config = lora_state_dict(trained.transformer), lora_config_dict(trained.transformer)
    files = write_lora_files(tmp_path, state, config, family="flux_kontext", base_model="tiny", config_text=None)
    files += write_lora_files(tmp_path, state, config, family="flux_kontext", base_model="tiny", config_text=None,
                              format="comfyui")
    assert {p.name for p in files} == {DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, "README.md", COMFYUI_WEIGHT_NAME}
    inputs = dict(hidden_states=torch.randn(1, 32, 64, generator=generator),
                  encoder_hidden_states=torch.randn(1, 5, 64, generator=generator),
                  pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
                  guidance=torch.tensor([2.5]), txt_ids=torch.zeros(5, 3),
                  img_ids=torch.cat([trained.image_ids(8, 8), trained.source_image_ids(8, 8)]), return_dict=False)
    with torch.no_grad():
        ours = trained.transformer(**inputs)[0]
        for name in (DIFFUSERS_WEIGHT_NAME, COMFYUI_WEIGHT_NAME):
            plain = type(trained).tiny_pipeline(0)
            plain.load_lora_weights(str(tmp_path), weight_name=name)
            torch.testing.assert_close(plain.transformer(**inputs)[0], ours, rtol=0, atol=1e-5)
    base = {k: v.float() for k, v in type(trained).tiny_pipeline(0).transformer.state_dict().items()}
    dmap = comfy.diffusers_map("flux", trained.transformer.config)
    native = comfy.native_weights(base, dmap)
    lora = load_file(str(tmp_path / KOHYA_WEIGHT_NAME))
    deltas, loaded, _ = comfy.sd_scripts_deltas(lora, native.keys())
    assert loaded == set(lora)
    expected = comfy.to_native({k[:-len(".lora_A.weight")] + ".weight": 2.0 * state[k.replace("lora_A", "lora_B")] @ v
                                for k, v in state.items() if k.endswith(".lora_A.weight")}, dmap, native)
    for key in native:
        torch.testing.assert_close(deltas.get(key, torch.zeros_like(native[key])), expected[key], atol=1e-6, rtol=0)
