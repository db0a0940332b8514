"""Prompt embeddings cached on disk (flowrl.models.text_cache): the same bits as the live encoders, in
lookups and in whole GRPO / NFT runs; encoded once, in chunks; keyed by the encoders' hash; the encoders
kept on the CPU or freed; and every misuse a one-line error."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import fields

import pytest
import torch

from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.models.base import TEXT_CHUNK, PolicyBase
from flowrl.models.text_cache import TextCache, attach_text_cache, text_encoder_hash

PROMPTS = ["a red circle", "a blue square on grass", "a red circle", "two cats", "a green triangle", "", "sky",
           "a yellow star", "night", "an orange moon over the sea"]
FAMILIES = ["sd3", "flux"]


def assert_same_cond(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None) == (y is None), f.name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f.name


def key_of(policy):
    return text_encoder_hash(policy.pipeline, family=policy.family, max_sequence_length=policy.max_sequence_length,
                             chunk=TEXT_CHUNK)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_lookup_equals_live_encode_exactly(tmp_path, family):
    policy = build_policy(family, "tiny")
    live = policy.encode(PROMPTS, negative=True)
    # A prompt's embedding does not depend on the batch it comes in (fixed-size encoder calls).
    assert_same_cond(policy.encode(PROMPTS[3:5], negative=True), live.select([3, 4]))
    cache = attach_text_cache(policy, tmp_path / "cache", PROMPTS[:6] + ["not used by the lookup"], free=True)
    assert not policy.text_encoders()
    assert_same_cond(policy.encode(PROMPTS[:6], negative=True), live.select(range(6)))
    # A fresh process reads the same bits back from the files, without encoders.
    fresh = build_policy(family, "tiny")
    fresh.free_text_encoders()
    fresh.text_cache = TextCache(tmp_path / "cache", cache.key)
    assert_same_cond(fresh.encode(PROMPTS[:6], negative=True), live.select(range(6)))


def test_uncached_prompt_after_freeing_is_a_one_line_error(tmp_path):
    policy = build_policy("sd3", "tiny")
    attach_text_cache(policy, tmp_path, ["a red circle"], free=True)
    with pytest.raises(ValueError) as error:
        policy.encode(["a red circle", "a purple cow"])
    message = str(error.value)
    assert "\n" not in message and "'a purple cow'" in message and "model.free_text_encoders=false" in message


def test_prompts_are_encoded_once_in_chunks_and_reused(tmp_path, monkeypatch):
    calls = []
    original = PolicyBase.encode_chunks

    def counting(self, prompts):
        calls.append(len(prompts))
        return original(self, prompts)

    monkeypatch.setattr(PolicyBase, "encode_chunks", counting)
    batches = []
    from flowrl.models.sd3 import SD3Policy
    batch_original = SD3Policy.encode_batch
    monkeypatch.setattr(SD3Policy, "encode_batch", lambda self, p, d: batches.append(len(p)) or batch_original(self, p, d))
    policy = build_policy("sd3", "tiny")
    prompts = [f"prompt number {i}" for i in range(19)]
    cache = attach_text_cache(policy, tmp_path, prompts + prompts[:5])
    assert calls == [20] and batches == [TEXT_CHUNK] * 3  # 19 distinct + "", one call per chunk of 8
    assert len(cache) == 20 and len(list(tmp_path.glob("*.safetensors"))) == 1
    # A second run sharing the directory encodes only what is new, into a second file.
    again = attach_text_cache(build_policy("sd3", "tiny"), tmp_path, prompts + ["one more"])
    assert calls == [20, 1] and len(again) == 21 and len(list(tmp_path.glob("*.safetensors"))) == 2
    assert attach_text_cache(build_policy("sd3", "tiny"), tmp_path, prompts) and calls == [20, 1]
    # Lookups read the cache: no encoder call for cached prompts.
    policy.encode(prompts[:4])
    assert calls == [20, 1]


def test_the_key_follows_weights_tokenizer_and_length():
    sd3 = key_of(build_policy("sd3", "tiny", seed=0))
    assert sd3 == key_of(build_policy("sd3", "tiny", seed=0))  # deterministic
    assert sd3 != key_of(build_policy("sd3", "tiny", seed=1))  # other weights
    assert sd3 != key_of(build_policy("sd3", "tiny", seed=0, max_sequence_length=16))
    assert sd3 != key_of(build_policy("flux", "tiny", seed=0))
    bf16 = build_policy("sd3", "tiny", seed=0, dtype="bfloat16")
    assert key_of(bf16) not in (sd3,)  # the dtype the encoders run in
    tokenizer_changed = build_policy("sd3", "tiny", seed=0)
    tokenizer_changed.pipeline.tokenizer_3.model_max_length = 77
    assert key_of(tokenizer_changed) != sd3


def test_directory_shared_by_two_models_and_a_file_from_another_encoder(tmp_path):
    attach_text_cache(build_policy("sd3", "tiny"), tmp_path / "shared", PROMPTS)
    attach_text_cache(build_policy("flux", "tiny"), tmp_path / "shared", PROMPTS)  # coexist: files per hash
    assert len(list((tmp_path / "shared").glob("*.safetensors"))) == 2
    file = tmp_path / "pinned.safetensors"
    first = build_policy("sd3", "tiny", seed=0)
    attach_text_cache(first, file, PROMPTS)
    attach_text_cache(build_policy("sd3", "tiny", seed=0), file, PROMPTS + ["extra"])  # extended in place
    assert "extra" in TextCache(file, key_of(first))
    other = build_policy("sd3", "tiny", seed=1)
    with pytest.raises(ValueError) as error:
        attach_text_cache(other, file, PROMPTS)
    message = str(error.value)
    assert "\n" not in message and key_of(first)[:16] in message and key_of(other)[:16] in message
    assert "delete the file or point model.text_cache_path elsewhere" in message


def test_text_encoders_can_stay_on_the_cpu():
    policy = build_policy("sd3", "tiny", text_encoder_device="cpu").to("meta")  # "meta" stands in for a GPU
    assert all(p.device.type == "cpu" for e in policy.text_encoders() for p in e.parameters())
    assert next(policy.transformer.parameters()).device.type == "meta"


@pytest.mark.parametrize("overrides, key", [
    (["model.free_text_encoders=true"], "model.free_text_encoders"),
    (["model.text_cache_path=/tmp/x"], "model.text_cache_path"),
    (["model.text_encoder_device=tpu"], "model.text_encoder_device"),
    (["model.text_cache=memory"], "model.text_cache"),
])
def test_options_are_checked_at_load_time(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(Config, "configs/smoke/sd3_tiny.yaml", overrides)
    assert key in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("recipe, path", [("grpo", "configs/smoke/sd3_tiny.yaml"),
                                          ("grpo", "configs/smoke/flux_tiny.yaml"),
                                          ("nft", "configs/smoke/flux_tiny.yaml")])
def test_runs_with_the_cache_and_freed_encoders_equal_live_runs(tmp_path, recipe, path):
    from flowrl.recipes import grpo, nft
    from safetensors.torch import load_file

    base = ["train.epochs=2", "log.progress=false", "log.eval_every=0", "log.test_every=1", "log.test_prompts=2",
            "log.report_prompts=0", "log.eval_images_per_prompt=2", "sampling.group_size=2", f"recipe={recipe}"]
    if recipe == "nft":
        base += ["train.ema=true"]
    runs = {}
    for name, extra in (("live", []), ("cached", ["model.text_cache=disk", "model.free_text_encoders=true"])):
        cfg = load_config(Config, path, base + extra + [f"run_dir={tmp_path / name}"])
        metrics = (grpo if recipe == "grpo" else nft).train(cfg)
        lora = load_file(str(tmp_path / name / "lora" / "pytorch_lora_weights.safetensors"))
        runs[name] = ({k: v for k, v in metrics.items() if not k.startswith("perf/")}, lora)
    assert runs["cached"][0] == runs["live"][0]
    assert runs["cached"][1].keys() == runs["live"][1].keys()
    assert all(torch.equal(runs["cached"][1][k], runs["live"][1][k]) for k in runs["live"][1])
    assert list((tmp_path / "cached" / "text_cache").glob("*.safetensors"))


def test_the_key_holds_the_encoders_device_type(monkeypatch):
    """A cache filled by encoders on one device type is not read by encoders on another (their kernels round
    differently), so the device type is part of the key."""
    from flowrl.models import text_cache

    policy = build_policy("sd3", "tiny")
    assert text_cache.encoder_device_type(policy.pipeline) == "cpu"
    on_cpu = key_of(policy)
    monkeypatch.setattr(text_cache, "encoder_device_type", lambda pipeline: "cuda")
    assert key_of(policy) != on_cpu


def test_sample_reads_the_text_cache_with_freed_encoders(tmp_path):
    """``flowrl sample`` fills and reads ``model.text_cache: disk`` as training does: with the encoders freed after
    caching, the images are the ones the live encoders give (``flowrl eval``: tests/eval/test_eval.py)."""
    import contextlib
    import io

    from PIL import Image

    from flowrl.cli import main

    def sample(out, *overrides):
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            code = main(["sample", "configs/smoke/sd3_tiny.yaml", "sampling.num_steps=2", f"run_dir={tmp_path / 'run'}",
                         *overrides, "--prompt", "a cat", "--num-per-prompt", "2", "--out", str(out)])
        assert code == 0
        return Image.open(out).tobytes()

    live = sample(tmp_path / "live.png")
    cached = sample(tmp_path / "cached.png", "model.text_cache=disk", "model.free_text_encoders=true")
    assert list((tmp_path / "run" / "text_cache").glob("*.safetensors"))
    assert cached == live
