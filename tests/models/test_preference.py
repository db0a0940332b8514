"""ParetoSlider's preference embedding (flowrl/models/preference.py) on every family's tiny pipeline.

Per family: a freshly attached embedding leaves the velocity bit-identical (zero-initialised output); once its
output layer is non-zero, the velocity depends on w, per row, through ``TextCond.preference`` and through the
slider (``set_preference``), and ``reference()`` switches it off. Then the export round-trip on SD3: the exported
file, installed into a fresh plain diffusers pipeline with ``load_preference``, gives the trained policy's
transformer outputs at a given w; and the one-line refusals of a bad preference.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.models import FAMILIES, build_policy
from flowrl.models.preference import (PREFERENCE_WEIGHT_NAME, attach_preference, check_preference, load_preference,
                                      parse_preference, read_preference_header, set_preference)

PROMPTS = ["a red circle", "two blue squares"]


def _inputs(policy):
    metadata = policy.example_metadata(len(PROMPTS))
    cond = policy.encode(PROMPTS, metadata=metadata)
    x = policy.init_noise(len(PROMPTS), generator=torch.Generator().manual_seed(0))
    return x, cond


def _velocity(policy, x, cond):
    with torch.no_grad():
        return policy.velocity(x, torch.tensor(0.7), cond, policy.default_guidance).float()


def _perturb(embedding, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in embedding.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_accepts_the_conditioning_and_starts_as_the_unconditioned_policy(family):
    policy = build_policy(family, "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    x, cond = _inputs(policy)
    plain = _velocity(policy, x, cond)
    embedding = attach_preference(policy, ["a", "b"], hidden=8, seed=0)
    cond.preference = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert torch.equal(_velocity(policy, x, cond), plain)  # zero-initialised output: identity
    assert all(p.requires_grad for p in embedding.parameters())
    assert any(n.startswith("flowrl_preference.") for n, _ in policy.named_trainable_parameters())

    _perturb(embedding)
    conditioned = _velocity(policy, x, cond)
    assert not torch.allclose(conditioned, plain)
    swapped = cond.select([0, 1])
    swapped.preference = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    other = _velocity(policy, x, swapped)
    assert not torch.allclose(other[0], conditioned[0])  # each row follows its own w
    cond.preference = None
    set_preference(policy, [1.0, 0.0])  # no rows: the slider's w for every row
    slider = _velocity(policy, x, cond)
    assert torch.allclose(slider[0], conditioned[0], atol=1e-5)
    with policy.reference():
        base = _velocity(policy, x, cond)
    policy.transformer.disable_adapters()
    try:
        embedding.enabled = False
        expected = _velocity(policy, x, cond)
    finally:
        embedding.enabled = True
        policy.transformer.enable_adapters()
    assert torch.equal(base, expected)


def test_pooled_site_is_refused_where_the_family_has_no_pooled_text():
    policy = build_policy("qwen_image", "tiny", seed=0)
    with pytest.raises(ValueError, match="no such embedding"):
        attach_preference(policy, ["a", "b"], where="pooled")


def test_the_exported_embedding_loads_into_a_plain_diffusers_pipeline_with_the_same_outputs(tmp_path):
    from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME, lora_config_dict, lora_state_dict, write_lora_files
    from flowrl.models.tiny import tiny_sd3_pipeline

    policy = build_policy("sd3", "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    embedding = attach_preference(policy, ["toyeval", "toy_proxy"], hidden=8, where="pooled", seed=0)
    _perturb(embedding)
    with torch.no_grad():  # a trained LoRA: B non-zero
        for name, param in policy.transformer.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    paths = write_lora_files(tmp_path, lora_state_dict(policy.transformer), lora_config_dict(policy.transformer),
                             family="sd3", base_model="tiny", config_text=None, preference=embedding.describe())
    assert tmp_path / PREFERENCE_WEIGHT_NAME in paths
    header = read_preference_header(tmp_path)
    assert header["flowrl.preference.rewards"] == '["toyeval", "toy_proxy"]'
    from safetensors.torch import load_file

    assert all(k.startswith("preference.") for k in load_file(str(tmp_path / PREFERENCE_WEIGHT_NAME)))
    assert not any("preference" in k for k in load_file(str(tmp_path / DIFFUSERS_WEIGHT_NAME)))

    pipe = tiny_sd3_pipeline(0)
    pipe.load_lora_weights(str(tmp_path))
    load_preference(pipe, tmp_path)
    w = [0.3, 0.7]
    set_preference(pipe, w)
    set_preference(policy, w)
    x = torch.randn(2, pipe.transformer.config.in_channels, 8, 8, generator=torch.Generator().manual_seed(3))
    kwargs = dict(hidden_states=x, timestep=torch.tensor([700.0, 300.0]),
                  encoder_hidden_states=torch.randn(2, 5, pipe.transformer.config.joint_attention_dim,
                                                    generator=torch.Generator().manual_seed(4)),
                  pooled_projections=torch.randn(2, pipe.transformer.config.pooled_projection_dim,
                                                 generator=torch.Generator().manual_seed(5)), return_dict=False)
    with torch.no_grad():
        trained = policy.transformer(**kwargs)[0]
        loaded = pipe.transformer(**kwargs)[0]
        set_preference(pipe, [1.0, 0.0])
        moved = pipe.transformer(**kwargs)[0]
    assert torch.allclose(loaded, trained, atol=1e-5)
    assert not torch.allclose(moved, trained, atol=1e-4)


@pytest.mark.parametrize("text, message", [
    ("0.3,0.3,0.4", "3 entries, but the model was trained on 2 rewards"),
    ("-0.2,1.2", "negative entry"),
    ("0.3,0.6", "sum to 0.9, not 1"),
])
def test_a_bad_preference_is_one_line(text, message):
    with pytest.raises(ValueError, match=message) as error:
        check_preference(parse_preference(text), ["toyeval", "toy_proxy"])
    assert "\n" not in str(error.value)


def test_a_preference_within_the_tolerance_is_taken_as_given():
    assert check_preference([0.3, 0.7 + 5e-7]).tolist() == pytest.approx([0.3, 0.7 + 5e-7])
    with pytest.raises(ValueError, match="comma-separated numbers"):
        parse_preference("0.3;0.7")


def test_a_loaded_embedding_comes_off_again(tmp_path):
    from flowrl.models.preference import install_preference, preference_of, remove_preference

    policy = build_policy("sd3", "tiny", seed=0)
    x, cond = _inputs(policy)
    plain = _velocity(policy, x, cond)
    trained = build_policy("sd3", "tiny", seed=0)
    embedding = attach_preference(trained, ["a", "b"], hidden=4, seed=0)
    _perturb(embedding)
    install_preference(policy, {k: v for k, v in embedding.state_dict().items()}, embedding.describe())
    set_preference(policy, [1.0, 0.0])
    assert not torch.allclose(_velocity(policy, x, cond), plain)
    remove_preference(policy)
    assert preference_of(policy) is None and policy.preference is None and "velocity" not in vars(policy)
    assert torch.equal(_velocity(policy, x, cond), plain)
