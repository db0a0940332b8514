"""ParetoSlider's preference embedding (flowrl/models/preference.py) on every family's tiny pipeline.

Per family: a freshly attached embedding leaves the velocity bit-identical (zero-initialised outputs, the block
modulation's included where the family has it); once its output layers are non-zero, the velocity depends on w, per
row, through ``TextCond.preference`` and through the slider (``set_preference``), and ``reference()`` switches it
off. The block modulation on one tiny SD3 block, against the reference's formula written out by hand; its
gradients are the same under gradient checkpointing. Then the export round-trip on SD3: the exported
file, installed into a fresh plain diffusers pipeline with ``load_preference``, gives the trained policy's
transformer outputs at a given w; and the one-line refusals of a bad preference.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.models import FAMILIES, build_policy, policy_class
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


CONDITIONED = [f for f in FAMILIES if policy_class(f).preference_sites]  # wan22_t2v (two experts): none yet


@pytest.mark.parametrize("family", CONDITIONED)
def test_every_family_accepts_the_conditioning_and_starts_as_the_unconditioned_policy(family):
    policy = build_policy(family, "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    x, cond = _inputs(policy)
    plain = _velocity(policy, x, cond)
    blocks = "blocks" in policy.preference_sites  # sd3, flux, flux_kontext: the block modulation too
    embedding = attach_preference(policy, ["a", "b"], hidden=8, seed=0, blocks=blocks)
    cond.preference = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert torch.equal(_velocity(policy, x, cond), plain)  # zero-initialised outputs (both): identity
    assert all(p.requires_grad for p in embedding.parameters())
    assert any(n.startswith("flowrl_preference.") for n, _ in policy.named_trainable_parameters())

    if blocks:  # the block modulation alone (the timestep MLP still zero) moves the velocity, per row
        _perturb(embedding.blocks)
        only_blocks = _velocity(policy, x, cond)
        assert not torch.allclose(only_blocks, plain)
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

    exported = load_file(str(tmp_path / PREFERENCE_WEIGHT_NAME))
    assert all(k.startswith("preference.") for k in exported)
    assert any(k.startswith("preference.blocks.") for k in exported)  # the block modulation travels with it
    assert header["flowrl.preference.blocks"] == "transformer_blocks"
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


def _block_inputs(transformer, rows=2, tokens=4, text=3):
    g = torch.Generator().manual_seed(11)
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    return (torch.randn(rows, tokens, width, generator=g), torch.randn(rows, text, width, generator=g),
            torch.randn(rows, width, generator=g))


def test_the_block_modulation_adds_the_gated_projection_of_w_to_the_image_stream():
    # The reference (ParetoSlider transformer_sd3.py, block_mod_form residual): after the block's feed-forward
    # residual, h += gate_mlp * m, m = MLP(Linear(sin(pi w), cos(pi w))); written out here with the weights.
    policy = build_policy("sd3", "tiny", seed=0)
    embedding = attach_preference(policy, ["a", "b"], hidden=4, seed=0)
    _perturb(embedding.blocks, seed=2)
    block = policy.transformer.transformer_blocks[0]
    hidden, text, temb = _block_inputs(policy.transformer)
    w = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    p = dict(embedding.blocks.named_parameters())
    features = torch.cat([torch.sin(torch.pi * w), torch.cos(torch.pi * w)], 1) @ p["features.weight"].T + p["features.bias"]
    m = features
    for i in (0, 2, 4):
        m = torch.relu(m @ p[f"layers.{i}.weight"].T + p[f"layers.{i}.bias"])
    m = m @ p["layers.6.weight"].T + p["layers.6.bias"]  # [2, D]
    gate_mlp = block.norm1.linear(torch.nn.functional.silu(temb)).chunk(6, dim=1)[5]  # AdaLayerNormZero's 6th
    with torch.no_grad():
        plain_text, plain = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb)  # no m: unchanged
        with embedding.conditioned(w):
            carried = embedding.carry_modulation(temb)
        modulated_text, modulated = block(hidden_states=hidden, encoder_hidden_states=text, temb=carried)
        expected = plain + gate_mlp[:, None, :] * m[:, None, :]
    assert torch.allclose(modulated, expected, atol=1e-5)
    assert (modulated - plain).abs().max() > 1e-3
    assert torch.equal(modulated_text, plain_text)  # the text stream is never modulated
    embedding.enabled = False  # the reference model: nothing carried, nothing added
    assert not hasattr(embedding.carry_modulation(temb), "_flowrl_preference_modulation")


def test_block_modulation_gradients_are_the_same_under_gradient_checkpointing():
    # The recomputed blocks must see the m of their own forward, even after another forward with other rows.
    policy = build_policy("sd3", "tiny", seed=0)
    embedding = attach_preference(policy, ["a", "b"], hidden=4, seed=0)
    _perturb(embedding, seed=3)
    x, cond = _inputs(policy)
    cond.preference = torch.tensor([[0.9, 0.1], [0.2, 0.8]])

    def gradients(checkpointing: bool) -> torch.Tensor:
        if checkpointing:
            policy.transformer.enable_gradient_checkpointing()
        policy.transformer.train()
        embedding.zero_grad()
        out = policy.velocity(x, torch.tensor(0.7), cond, policy.default_guidance)
        swapped = cond.select([1, 0])
        swapped.preference = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        with torch.no_grad():
            policy.velocity(x, torch.tensor(0.7), swapped, policy.default_guidance)
        out.float().square().sum().backward()
        return torch.cat([param.grad.flatten() for param in embedding.blocks.parameters()])

    plain = gradients(False)
    assert plain.abs().sum() > 0
    assert torch.allclose(gradients(True), plain, atol=1e-6)


def test_block_modulation_is_refused_in_one_line_where_a_family_has_no_blocks_site():
    policy = build_policy("qwen_image", "tiny", seed=0)
    with pytest.raises(ValueError, match="model.preference.blocks=false") as error:
        attach_preference(policy, ["a", "b"])
    assert "\n" not in str(error.value)
    attach_preference(policy, ["a", "b"], blocks=False)  # the timestep embedding alone still works


def test_an_adapter_without_block_modulation_still_installs(tmp_path):
    from flowrl.models.preference import install_preference

    trained = build_policy("sd3", "tiny", seed=0)
    embedding = attach_preference(trained, ["a", "b"], hidden=4, seed=0, blocks=False)
    header = embedding.describe()
    for key in ("flowrl.preference.blocks", "flowrl.preference.temb"):
        header.pop(key)  # an export written before the block modulation existed
    policy = build_policy("sd3", "tiny", seed=0)
    installed = install_preference(policy, dict(embedding.state_dict()), header)
    assert installed.blocks is None


def test_a_family_without_preference_sites_refuses_the_embedding_in_one_line():
    policy = build_policy("wan22_t2v", "tiny", seed=0)
    with pytest.raises(ValueError, match="the wan22_t2v family takes no preference embedding yet"):
        attach_preference(policy, ["a", "b"], hidden=8, seed=0, blocks=False)
