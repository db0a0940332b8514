"""VLM rewards on a tiny random-init Qwen2-VL built offline: batching, yes/no and likelihood
maths, the checklist DAG logic (with injected P(yes)), and the checklist schema.

Tiny-VLM recipe (reusable): a byte-level BPE trained in memory with `tokenizers` (Qwen's special
tokens + "Yes"/"No" as single tokens), wrapped in PreTrainedTokenizerFast with a Qwen-style chat
template; Qwen2VLProcessor(Qwen2VLImageProcessor with 1-4 merged image tokens,
Qwen2VLVideoProcessor(), tokenizer); Qwen2VLConfig with a 2-layer hidden-32 text model
(mrope_section summing to head_dim / 2) and a depth-1 vision tower (patch 14, merge 2).
"""

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.data.prompts import load_prompts  # noqa: E402
from flowrl.rewards_api import build_reward, score  # noqa: E402
from rewards import checklist as ck  # noqa: E402
from rewards.vlm_common import (images_to_pil, single_token_id, text_log_likelihood,  # noqa: E402
                                yes_no_token_ids, yes_probability)
from tests import REPO  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["user assistant Yes No Yes No Does this image match the description Answer Yes or No.",
          "Describe this image. Is there a red cat on a blue mat? a dog", "Yes", "No"] * 5


def tiny_processor():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:], chat_template=TEMPLATE)
    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 4)  # 1-4 image tokens
    return Qwen2VLProcessor(image_processor=images, video_processor=Qwen2VLVideoProcessor(), tokenizer=tok,
                            chat_template=TEMPLATE)


def tiny_model(tok):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         initializer_range=0.2, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def vlm():
    processor = tiny_processor()
    return tiny_model(processor.tokenizer), processor


def images(n=4, seed=0):
    """n images of different sizes (so rows carry different numbers of image tokens)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [(28, 28), (56, 28), (40, 52), (56, 56)]
    return [torch.rand(3, *sizes[i % 4], generator=g) for i in range(n)]


def pils(n=4, seed=0):
    return [images_to_pil(x[None])[0][0] for x in images(n, seed)]


# ------------------------------------------------------------------------------ vlm_common

def test_yes_no_tokens_prefer_spelling_without_space(vlm):
    tok = vlm[1].tokenizer
    yes, no = yes_no_token_ids(tok)
    assert yes == tok.encode("Yes", add_special_tokens=False)[0] != tok.encode(" Yes", add_special_tokens=False)[0]
    assert no == single_token_id(tok, "No")
    with pytest.raises(ValueError, match="not a single token"):
        single_token_id(tok, "Absolutely")


def test_yes_probability_shape_range_and_batching(vlm):
    model, processor = vlm
    qs = ["Is there a red cat?", "Is there a dog on a blue mat? Answer Yes or No.", "a", "Describe this image."]
    batched = yes_probability(model, processor, pils(), qs, batch_size=2)
    alone = torch.cat([yes_probability(model, processor, [p], [q], batch_size=1) for p, q in zip(pils(), qs)])
    assert batched.shape == (4,) and batched.dtype == torch.float32
    assert ((batched >= 0) & (batched <= 1)).all()
    assert batched.std() > 1e-3  # inputs matter, so the equality below is not vacuous
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)  # batch 2 vs 1: GEMM rounding differs


def test_text_log_likelihood_batching_and_hand_computation(vlm):
    model, processor = vlm
    texts = ["a red cat", "Yes", "a dog on a blue mat and a red cat", "No No"]
    batched = text_log_likelihood(model, processor, pils(), texts, "Describe this image.", batch_size=2)
    alone = torch.cat([text_log_likelihood(model, processor, [p], [t], batch_size=1) for p, t in zip(pils(), texts)])
    assert batched.shape == (4,) and torch.isfinite(batched).all() and (batched < 0).all()
    # Batch 2 vs 1 (GEMM rounding differs) on log-likelihoods of several nats: relative 1e-5 too.
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    # by hand: one unpadded row, full logits, mean log-softmax over the answer's own tokens
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    prompt = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    for i in (0, 2):
        enc = processor(text=[prompt + texts[i]], images=[pils()[i]], add_special_tokens=False, return_tensors="pt")
        k = len(processor.tokenizer.encode(texts[i], add_special_tokens=False))
        with torch.no_grad():
            logp = model(**enc).logits[0].float().log_softmax(-1)  # [L, V]
        ids = enc["input_ids"][0]
        want = torch.stack([logp[j - 1, ids[j]] for j in range(len(ids) - k, len(ids))]).mean()
        assert batched[i].item() == pytest.approx(want.item(), abs=1e-5)
    assert math.isnan(text_log_likelihood(model, processor, pils(1), [""])[0])


def test_load_from_local_path_matches_injected(vlm, tmp_path):
    from rewards.vlm_likelihood import VlmYes
    model, processor = vlm
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    x, prompts = torch.rand(2, 3, 28, 28), ["a red cat.", "a dog"]
    loaded = VlmYes(model=str(tmp_path), device="cpu")(x, prompts, [{}, {}])["vlm_yes"]
    injected = VlmYes(model=model, processor=processor)(x, prompts, [{}, {}])["vlm_yes"]
    torch.testing.assert_close(loaded, injected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot load VLM") as err:
        VlmYes(model=str(tmp_path / "missing"))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ VLM rewards

def test_vlm_yes_and_prompt_echo_through_score(vlm):
    model, processor = vlm
    rewards = [build_reward("rewards.vlm_likelihood:VlmYes", model=model, processor=processor, batch_size=2),
               build_reward("rewards.vlm_likelihood:PromptEcho", model=model, processor=processor, batch_size=3)]
    x = torch.rand(3, 3, 32, 32)
    x[1, 0, 0, 0] = math.nan  # a diverged sample: NaN, never 0
    out = score(rewards, x, ["a red cat", "a dog", "a blue mat"], [{}] * 3)
    for key in ("vlm_yes", "prompt_echo"):
        assert out[key].shape == (3,) and math.isnan(out[key][1]) and torch.isfinite(out[key][[0, 2]]).all()
    assert (out["vlm_yes"][[0, 2]] <= 1).all() and (out["prompt_echo"][[0, 2]] < 0).all()
    # PromptEcho is text_log_likelihood of the prompt after the instruction
    want = text_log_likelihood(model, processor, x[[2]], ["a blue mat"], "Describe this image.")
    assert out["prompt_echo"][2].item() == pytest.approx(want.item(), abs=1e-5)


def test_checklist_with_tiny_vlm_batches_all_nodes(vlm):
    model, processor = vlm
    meta = [{"checklist": [{"id": "a", "question": "Is there a cat?", "category": "object"},
                           {"id": "b", "question": "Is the cat red?", "category": "attribute", "parents": ["a"]}]},
            {"checklist": [{"id": "a", "question": "Is there a dog?", "category": "object"}]}]
    x = torch.rand(2, 3, 28, 28)
    reward = ck.Checklist(model=model, processor=processor, batch_size=2, threshold=0.0)  # every node passes
    out = reward(x, ["a red cat", "a dog"], meta)
    p = yes_probability(model, processor, x[[0, 0, 1]],
                        ["Is there a cat? Answer Yes or No.", "Is the cat red? Answer Yes or No.",
                         "Is there a dog? Answer Yes or No."])
    torch.testing.assert_close(out["checklist"], torch.stack([p[:2].mean(), p[2]]), atol=1e-5, rtol=0)
    assert math.isnan(out["checklist/attribute"][1]) and set(out) == {"checklist", "checklist/object",
                                                                       "checklist/attribute"}


# ------------------------------------------------------------------------------ checklist logic

def node(id, cat="object", parents=(), question=None):
    return {"id": id, "question": question or f"q {id}?", "category": cat, "parents": list(parents)}


def fake(values):
    """A scorer answering P(yes) by question text, as a VLM would."""
    return lambda images, questions: torch.tensor([values[q] for q in questions])


def test_chain_root_failure_zeroes_all_descendants():
    nodes = [node("a"), node("b", parents=["a"]), node("c", parents=["b"])]
    s = ck.node_scores(nodes, [0.4, 0.9, 0.9])
    assert s.tolist() == pytest.approx([0.4, 0.0, 0.0])
    s = ck.node_scores(nodes, [0.6, 0.3, 0.9])  # middle fails: only c is zeroed
    assert s.tolist() == pytest.approx([0.6, 0.3, 0.0])
    assert ck.aggregate(nodes, s)[0] == pytest.approx(0.3)


def test_diamond_dag_needs_every_parent():
    # a -> b, a -> c, (b, c) -> d; listed children-first to exercise the topological order
    nodes = [node("d", parents=["b", "c"]), node("c", parents=["a"]), node("b", parents=["a"]), node("a")]
    assert ck.node_scores(nodes, [0.8, 0.7, 0.9, 0.6]).tolist() == pytest.approx([0.8, 0.7, 0.9, 0.6])
    assert ck.node_scores(nodes, [0.8, 0.2, 0.9, 0.6]).tolist() == pytest.approx([0.0, 0.2, 0.9, 0.6])
    assert ck.node_scores(nodes, [0.8, 0.7, 0.9, 0.1]).tolist() == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert ck.node_scores(nodes, [0.8, 0.7, 0.9, 0.6], hard=True).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert ck.node_scores(nodes, [0.8, 0.2, 0.9, 0.6], hard=True).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert ck.node_scores(nodes, [0.8, 0.7, 0.9, 0.6], threshold=0.65).tolist() == pytest.approx(
        [0.0, 0.0, 0.0, 0.6])  # a (0.6) now fails, zeroing b, c and d


def test_reward_per_category_subscores_and_hard_mode():
    meta = [{"checklist": [node("cat", "object", question="cat?"), node("red", "attribute", ["cat"], "red?"),
                           node("two", "count", ["cat"], "two?")]},
            {"checklist": [node("dog", "object", question="dog?"), node("big", "attribute", ["dog"], "big?")]}]
    values = {"cat?": 0.9, "red?": 0.4, "two?": 0.8, "dog?": 0.2, "big?": 1.0}
    q = {k + " Answer Yes or No.": v for k, v in values.items()}
    out = ck.Checklist(scorer=fake(q))(torch.rand(2, 3, 8, 8), ["p0", "p1"], meta)
    assert set(out) == {"checklist", "checklist/object", "checklist/attribute", "checklist/count"}
    assert out["checklist"].tolist() == pytest.approx([(0.9 + 0.4 + 0.8) / 3, (0.2 + 0.0) / 2])
    assert out["checklist/object"].tolist() == pytest.approx([0.9, 0.2])
    assert out["checklist/attribute"].tolist() == pytest.approx([0.4, 0.0])
    assert out["checklist/count"][0].item() == pytest.approx(0.8) and math.isnan(out["checklist/count"][1])
    hard = ck.Checklist(scorer=fake(q), hard=True)(torch.rand(2, 3, 8, 8), ["p0", "p1"], meta)
    assert hard["checklist"].tolist() == pytest.approx([2 / 3, 0.0])


def test_reward_nan_image_and_missing_policy():
    meta = [{"checklist": [node("a", question="a?")]}, {}, {"checklist": [node("a", question="a?")]}]
    x = torch.rand(3, 3, 8, 8)
    x[2] = math.nan
    with pytest.raises(ValueError, match=r"^prompt 'p1' has no checklist in metadata; add metadata\['checklist'\]"):
        ck.Checklist(scorer=fake({"a? Answer Yes or No.": 0.7}))(x, ["p0", "p1", "p2"], meta)
    out = ck.Checklist(scorer=fake({"a? Answer Yes or No.": 0.7}), missing="nan")(x, ["p0", "p1", "p2"], meta)
    assert out["checklist"][0].item() == pytest.approx(0.7)
    assert math.isnan(out["checklist"][1]) and math.isnan(out["checklist"][2])


def test_cycle_and_unknown_parent_rejected_in_one_line():
    cyc = [node("root"), node("a", parents=["root", "c"]), node("b", parents=["a"]), node("c", parents=["b"])]
    with pytest.raises(ValueError, match=r"^checklist for prompt 'my prompt' has a cycle through node '[abc]'$"):
        ck.node_scores(cyc, [0.9] * 4, prompt="my prompt")
    with pytest.raises(ValueError, match="has a cycle through node 'x'"):
        ck.validate_checklist([node("x", parents=["x"])], "p")
    with pytest.raises(ValueError, match="node 'b' has unknown parent 'zz'") as err:
        ck.validate_checklist([node("a"), node("b", parents=["zz"])], "p")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="duplicate node id 'a'"):
        ck.validate_checklist([node("a"), node("a")], "p")


# ------------------------------------------------------------------------------ schema

BAD = [
    ([{"id": "a", "question": "q?", "category": "object"}, {"id": "b", "category": "object"}],
     "node 'b'", "'question' is a required property"),
    ([{"id": "a", "question": "q?", "category": "object", "parent": ["x"]}], "node 'a'", "parent"),
    ([{"id": "a", "question": "q?", "category": 3}], "node 'a' field 'category'", "is not of type 'string'"),
    ([], "checklist", ""),
    ({"id": "a"}, "checklist", "is not of type 'array'"),
]


@pytest.mark.parametrize("nodes,where,what", BAD)
def test_schema_errors_are_one_line_naming_prompt_and_node(nodes, where, what):
    with pytest.raises(ValueError) as err:
        ck.validate_checklist(nodes, "a red\ncat")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"checklist for prompt 'a red cat': {where}") and what in msg


@pytest.mark.parametrize("nodes,where,what", BAD)
def test_hand_validator_agrees_on_bad_checklists(nodes, where, what):
    errors = ck.hand_validate(nodes, ck.load_schema())
    assert errors and what in errors[0][1]


def test_shipped_example_validates_and_scores():
    prompts = load_prompts(REPO / "assets/prompts/checklist_example.jsonl")
    assert len(prompts) >= 5
    for p, m in zip(prompts.prompts, prompts.metadata):
        assert not ck.hand_validate(m["checklist"], ck.load_schema())
        nodes = ck.validate_checklist(m["checklist"], p)
        assert 3 <= len(nodes) <= 8
    n = len(prompts)
    out = ck.Checklist(scorer=lambda ims, qs: torch.full((len(qs),), 0.75))(
        torch.rand(n, 3, 8, 8), prompts.prompts, prompts.metadata)
    assert out["checklist"].tolist() == pytest.approx([0.75] * n)


def test_schema_file_is_valid_json_schema():
    schema = json.loads((REPO / "assets/schemas/checklist.schema.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validators.validator_for(schema).check_schema(schema)
