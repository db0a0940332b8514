"""The tiny offline SD3 / FLUX pipelines behave like real diffusers pipelines."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from transformers import AutoTokenizer

from flowrl.models import tiny

PROMPTS = ["a photo of a cat", "a red car on a street at night"]
CASES = {
    "sd3": (tiny.tiny_sd3_pipeline, StableDiffusion3Pipeline, tiny.TINY_SD3_RESOLUTION, 4.5),
    "flux": (tiny.tiny_flux_pipeline, FluxPipeline, tiny.TINY_FLUX_RESOLUTION, 3.5),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    build, cls, res, guidance = CASES[request.param]
    pipe = build(seed=0)
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe, cls, res, guidance


def generate(pipe, res, guidance, **kwargs):
    return pipe(
        prompt=PROMPTS, num_inference_steps=3, height=res, width=res, guidance_scale=guidance,
        generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs,
    ).images


def state(pipe):
    return {
        f"{name}.{key}": value
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for key, value in module.state_dict().items()
    }


def test_generates_finite_images_in_unit_range(case):
    _, pipe, _, res, guidance = case
    images = generate(pipe, res, guidance)  # the pipelines' default T5 length (256 / 512)
    assert images.shape == (len(PROMPTS), 3, res, res)
    assert images.dtype == torch.float32
    assert torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1
    assert images.std() > 0.01  # not a constant image
    assert not torch.equal(images[0], images[1])


def test_components_are_float32_eval_cpu_and_consistent(case):
    name, pipe, _, _, _ = case
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            assert not module.training
            assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    assert pipe.vae_scale_factor == tiny.TINY_VAE_SCALE_FACTOR
    assert pipe.vae.config.latent_channels == tiny.TINY_LATENT_CHANNELS
    assert pipe.text_encoder.config.vocab_size == len(pipe.tokenizer)
    t5 = pipe.text_encoder_3 if name == "sd3" else pipe.text_encoder_2
    t5_tok = pipe.tokenizer_3 if name == "sd3" else pipe.tokenizer_2
    assert t5.config.vocab_size == len(t5_tok)
    sched = pipe.scheduler.config
    assert sched.shift == 3.0
    if name == "sd3":
        assert pipe.transformer.config.in_channels == tiny.TINY_LATENT_CHANNELS
        assert not sched.use_dynamic_shifting
    else:
        assert pipe.transformer.config.in_channels == 4 * tiny.TINY_LATENT_CHANNELS
        assert pipe.transformer.config.guidance_embeds
        assert sched.use_dynamic_shifting
        assert (sched.base_shift, sched.max_shift) == (0.5, 1.15)
        assert (sched.base_image_seq_len, sched.max_image_seq_len) == (256, 4096)


def test_save_and_plain_from_pretrained_reproduce_images(case, tmp_path):
    _, pipe, cls, res, guidance = case
    pipe.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.scheduler) is type(pipe.scheduler)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.scheduler.config) == public(pipe.scheduler.config)
    for name in [n for n in pipe.components if n.startswith("tokenizer")]:
        tok, tok_loaded = getattr(pipe, name), getattr(loaded, name)
        assert type(tok_loaded) is type(tok), name
        assert (tok_loaded.model_max_length, tok_loaded.pad_token_id) == (tok.model_max_length, tok.pad_token_id)
        assert tok_loaded(PROMPTS).input_ids == tok(PROMPTS).input_ids
    before = state(pipe)
    after = state(loaded)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    kwargs = {"max_sequence_length": tiny.TINY_T5_MAX_LENGTH}
    assert torch.equal(generate(pipe, res, guidance, **kwargs), generate(loaded, res, guidance, **kwargs))


def test_seed_determines_weights(case):
    name, pipe, _, _, _ = case
    build = CASES[name][0]
    rng = torch.get_rng_state()
    same, other = build(seed=0), build(seed=1)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone
    reference, same, other = state(pipe), state(same), state(other)
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    for component in pipe.components:  # every network changes with the seed
        keys = [k for k in reference if k.startswith(component + ".") and reference[k].is_floating_point()]
        assert not keys or any(not torch.equal(reference[k], other[k]) for k in keys), component


def test_clip_tokenizer_and_round_trip(tmp_path):
    tok = tiny.tiny_clip_tokenizer()
    assert tok.model_max_length == 77
    ids = tok(PROMPTS, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    assert [len(row) for row in ids] == [77, 77]
    assert ids[0][:7] == [49406, 320, 1125, 539, 320, 2368, 49407]  # ids of openai CLIP
    long_ids = tok(" ".join(["cat"] * 200), truncation=True).input_ids
    assert len(long_ids) == 77 and long_ids[-1] == 49407
    g_tok = tiny.tiny_clip_tokenizer(pad_token="!")
    assert g_tok.pad_token_id == 0
    tok.save_pretrained(tmp_path / "clip")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "clip")
    assert type(loaded) is type(tok) and loaded.model_max_length == 77
    assert loaded(PROMPTS, padding="max_length", max_length=77).input_ids == ids


def test_clip_tokenizer_cut_to_a_grammar_splits_its_prompts_like_clip(tmp_path):
    from flowrl.toy.prompts import all_prompts

    texts = [p for p, _ in all_prompts()]
    full, cut = tiny.tiny_clip_tokenizer(), tiny.clip_tokenizer_for(texts, model_max_length=16)
    assert len(cut) < 600 and cut.model_max_length == 16
    for text in texts:  # same pieces; only the ids are renumbered
        assert cut.convert_ids_to_tokens(cut(text).input_ids) == full.convert_ids_to_tokens(full(text).input_ids)
    # a hand-checked case: CLIP keeps "purple" and "diamonds" whole
    assert cut.convert_ids_to_tokens(cut("Purple diamonds").input_ids) == [
        "<|startoftext|>", "purple</w>", "diamonds</w>", "<|endoftext|>"]
    # words outside the grammar fall back to byte-level pieces, never to an unknown token
    pieces = cut.convert_ids_to_tokens(cut("zebra").input_ids)[1:-1]
    assert "".join(pieces) == "zebra</w>" and len(pieces) > 1
    cut.save_pretrained(tmp_path / "cut")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "cut")
    assert loaded(texts[:5]).input_ids == cut(texts[:5]).input_ids
    with pytest.raises(ValueError, match="ASCII"):
        tiny.clip_tokenizer_for(["a red circle, please"])


def test_t5_tokenizer_and_round_trip(tmp_path):
    tok = tiny.tiny_t5_tokenizer()
    assert tok.model_max_length == tiny.T5_MODEL_MAX_LENGTH
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    enc = tok(PROMPTS, padding="max_length", max_length=tiny.TINY_T5_MAX_LENGTH, truncation=True)
    assert [len(row) for row in enc.input_ids] == [tiny.TINY_T5_MAX_LENGTH] * 2
    assert tok.convert_ids_to_tokens(tok("a photo of a cat").input_ids) == ["▁a", "▁photo", "▁of", "▁a", "▁cat", "</s>"]
    assert tok.decode(tok("A Zebra, 42!").input_ids, skip_special_tokens=True) == "A Zebra, 42!"
    tok.save_pretrained(tmp_path / "t5")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "t5")
    assert type(loaded) is type(tok) and loaded.model_max_length == tiny.T5_MODEL_MAX_LENGTH
    assert len(loaded) == len(tok)
    again = loaded(PROMPTS, padding="max_length", max_length=tiny.TINY_T5_MAX_LENGTH, truncation=True)
    assert again.input_ids == enc.input_ids
