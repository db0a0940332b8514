"""CLIP-family rewards (CLIPScore, PickScore, HPSv2) and the aesthetic predictor, on tiny random models.

The models are the real classes (transformers CLIPModel, open_clip CLIP) shrunk to a few
thousand parameters plus CLIP's 49408-token embedding table, so every code path runs offline on
a CPU in seconds. The scores are noise; what is checked is the plumbing: shapes, keys, batching
invariance, preprocessing against torchvision, weight loading, errors and dtypes.
"""

import copy
import math
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import save_file

from flowrl.rewards_api import build_reward, score
from rewards.aesthetic import Aesthetic, AestheticMLP
from flowrl.models.clip import (ImageSpec, _features, load_hf_clip, preprocess, resolve_file, tiny_hf_clip,
                                tiny_open_clip)
from rewards.clip_scores import HPSv2, ClipScore, PickScore

N = 5
PROMPTS = ["a red cat", "a dog on a mat", "a red cat", "", "two apples " * 30]  # repeat, empty, > 77 tokens
META = [{}] * N
TINY_ARCH = "flowrl-test-tiny-vit"  # registered with open_clip by the `open_clip_arch` fixture


def images(n=N, h=48, w=40, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_clip():
    return tiny_hf_clip()  # (model, tokenizer)


@pytest.fixture(scope="module")
def oc_clip():
    return tiny_open_clip()


@pytest.fixture(scope="module")
def oc_clip_768():
    """The aesthetic head reads 768-d embeddings, as ViT-L/14's."""
    return tiny_open_clip(embed_dim=768, quick_gelu=True)


def make(kind, hf_clip, oc_clip, oc_clip_768, tmp_path, **kw):
    """A reward of `kind` on a private copy of the tiny model (loading casts the model in place)."""
    kw.setdefault("device", "cpu")
    if kind == "clipscore":
        return ClipScore(model=copy.deepcopy(hf_clip[0]), tokenizer=hf_clip[1], **kw)
    if kind == "pickscore":
        return PickScore(model=copy.deepcopy(hf_clip[0]), tokenizer=hf_clip[1], **kw)
    if kind == "hpsv2":
        return HPSv2(model=copy.deepcopy(oc_clip[0]), tokenizer=oc_clip[1], **kw)
    path = tmp_path / "mlp.safetensors"
    if not path.exists():
        save_file(random_mlp().state_dict(), str(path))
    return Aesthetic(weights=str(path), model=copy.deepcopy(oc_clip_768[0]), **kw)


def random_mlp(seed=1):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AestheticMLP(768).eval()


KINDS = {"clipscore": ["clipscore/cosine"], "pickscore": ["pickscore/cosine"], "hpsv2": [], "aesthetic": []}


# --------------------------------------------------------------------------- outputs, batching

@pytest.mark.parametrize("kind", KINDS)
def test_outputs_and_batching(kind, hf_clip, oc_clip, oc_clip_768, tmp_path):
    reward = make(kind, hf_clip, oc_clip, oc_clip_768, tmp_path, batch_size=2)
    x = images()
    out = reward(x, PROMPTS, META)
    assert list(out) == [kind, *KINDS[kind]]
    for value in out.values():
        assert value.shape == (N,) and value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.isfinite(value).all()
    one_by_one = [reward(x[i:i + 1], PROMPTS[i:i + 1], META[i:i + 1]) for i in range(N)]
    for key, value in out.items():
        # Batch 2 vs batch 1 round differently (GEMM kernels follow shape and CPU); PickScore's ~100x logit scale
        # makes an absolute 1e-5 a few ulps, hence the relative part too.
        torch.testing.assert_close(value, torch.cat([o[key] for o in one_by_one]), atol=1e-5, rtol=1e-5)
    merged = score([reward], x, PROMPTS, META)  # the Protocol checks of the reward seam pass
    torch.testing.assert_close(merged[kind], out[kind])
    empty = reward(x[:0], [], [])
    assert all(v.shape == (0,) for v in empty.values()) and set(empty) == set(out)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_image_scores_nan_and_bad_range_raises(kind, hf_clip, oc_clip, oc_clip_768, tmp_path):
    reward = make(kind, hf_clip, oc_clip, oc_clip_768, tmp_path, batch_size=8)
    x = images()
    clean = reward(x, PROMPTS, META)[kind]
    x[1, 0, 3, 3], x[3, 2, 0, 1] = float("nan"), float("inf")
    out = reward(x, PROMPTS, META)[kind]
    assert torch.isnan(out[[1, 3]]).all() and torch.isfinite(out[[0, 2, 4]]).all()
    torch.testing.assert_close(out[[0, 2, 4]], clean[[0, 2, 4]], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"\[0,1\]"):
        reward(images() * 2.0, PROMPTS, META)
    with pytest.raises(ValueError, match=r"\[0,1\]"):
        reward(images() - 0.5, PROMPTS, META)
    with pytest.raises(ValueError, match="prompts"):
        reward(images(), PROMPTS[:-1], META)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_runs_close_to_fp32(kind, hf_clip, oc_clip, oc_clip_768, tmp_path):
    x = images()
    fp32 = make(kind, hf_clip, oc_clip, oc_clip_768, tmp_path)(x, PROMPTS, META)
    bf16 = make(kind, hf_clip, oc_clip, oc_clip_768, tmp_path, dtype="bf16")(x, PROMPTS, META)
    assert bf16[kind].dtype == torch.float32
    scale = fp32[kind].abs().max().clamp_min(1e-3)
    assert ((bf16[kind] - fp32[kind]).abs().max() / scale) < 0.05


def test_scores_follow_their_definitions(hf_clip, oc_clip, tmp_path):
    """clipscore = 2.5 max(cos, 0); pickscore = scale exp(logit_scale) cos; hpsv2 = cos."""
    x = images()
    model, tok = hf_clip
    cos = make("clipscore", hf_clip, oc_clip, None, tmp_path)(x, PROMPTS, META)["clipscore/cosine"]
    backbone = load_hf_clip("unused", model=copy.deepcopy(model), tokenizer=tok, device="cpu")
    img, txt = backbone.embed_images(x), backbone.embed_texts(PROMPTS)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(N))
    torch.testing.assert_close(cos, (img * txt).sum(-1))
    clip = ClipScore(model=copy.deepcopy(model), tokenizer=tok, device="cpu", weight=1.0)(x, PROMPTS, META)
    torch.testing.assert_close(clip["clipscore"], cos.clamp_min(0))
    pick = PickScore(model=copy.deepcopy(model), tokenizer=tok, device="cpu", scale=0.5)(x, PROMPTS, META)
    torch.testing.assert_close(pick["pickscore"], 0.5 * model.logit_scale.exp() * cos)

    oc_model, oc_tok = oc_clip
    pix = preprocess(x, ImageSpec(32, (32, 32)))
    ref = torch.nn.functional.cosine_similarity(oc_model.encode_image(pix), oc_model.encode_text(oc_tok(PROMPTS)))
    hps = make("hpsv2", hf_clip, oc_clip, None, tmp_path)(x, PROMPTS, META)["hpsv2"]
    torch.testing.assert_close(hps, ref, atol=1e-5, rtol=0)


def test_repeated_prompts_are_embedded_once_with_the_same_result(hf_clip):
    model, tok = hf_clip
    backbone = load_hf_clip("unused", model=copy.deepcopy(model), tokenizer=tok, device="cpu")
    calls = []
    original = backbone.model.get_text_features
    backbone.model.get_text_features = lambda **kw: calls.append(kw["input_ids"].shape[0]) or original(**kw)
    feats = backbone.embed_texts(PROMPTS)
    assert calls == [4]  # 5 prompts, 4 distinct
    alone = torch.cat([backbone.embed_texts([p]) for p in PROMPTS])
    torch.testing.assert_close(feats, alone, atol=1e-6, rtol=1e-5)  # batch 4 vs 1: GEMM rounding differs


def test_feature_outputs_of_both_transformers_generations():
    t = torch.randn(2, 4)
    assert _features(t, "image_embeds") is t  # transformers < 5: a tensor
    assert _features(type("Out", (), {"pooler_output": t})(), "image_embeds") is t  # >= 5: an output
    assert _features(type("Out", (), {"text_embeds": t, "pooler_output": None})(), "text_embeds") is t
    with pytest.raises(TypeError):
        _features(object(), "image_embeds")


# ------------------------------------------------------------------------------ preprocessing

@pytest.mark.parametrize("hw,spec", [((61, 97), ImageSpec(32, (32, 32))),   # downscale, landscape
                                     ((90, 50), ImageSpec(36, (32, 32))),   # resize > crop (CLIP processors)
                                     ((20, 24), ImageSpec(32, (32, 32))),   # upscale
                                     ((32, 32), ImageSpec(32, (32, 32), (0.5, 0.4, 0.3), (0.2, 0.3, 0.4)))])
def test_preprocess_matches_torchvision(hw, spec):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import v2

    x = torch.rand(3, 3, *hw, generator=torch.Generator().manual_seed(3))
    resize = v2.Resize(spec.resize, interpolation=InterpolationMode.BICUBIC, antialias=True)
    crop, norm = v2.CenterCrop(spec.crop), v2.Normalize(spec.mean, spec.std)
    expected = norm(crop(resize(x).clamp(0, 1)))
    got = preprocess(x, spec)
    assert got.shape == (3, 3, *spec.crop) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert preprocess(x.double(), spec, torch.bfloat16).dtype == torch.bfloat16


# ------------------------------------------------------------------------------- weight loading

@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_aesthetic_loads_original_layout_and_matches_hand_forward(suffix, oc_clip_768, tmp_path):
    mlp = random_mlp(seed=7)
    state = mlp.state_dict()
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    path = tmp_path / f"aesthetic{suffix}"
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    reward = Aesthetic(weights=str(path), model=copy.deepcopy(oc_clip_768[0]), device="cpu")
    x = images()
    emb = oc_clip_768[0].encode_image(preprocess(x, ImageSpec(32, (32, 32))))
    h = emb / emb.norm(dim=-1, keepdim=True)  # [N, 768]
    for i in (0, 2, 4, 6, 7):  # no activations in the original head
        h = h @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(reward(x, PROMPTS, META)["aesthetic"], h.squeeze(-1), atol=1e-5, rtol=1e-5)


@pytest.fixture
def open_clip_arch(tmp_path_factory):
    """Register TINY_ARCH (the shape of `tiny_open_clip(embed_dim=768)`) with open_clip."""
    import open_clip

    folder = tmp_path_factory.mktemp("oc_cfg")
    cfg = {"embed_dim": 768, "quick_gelu": True,
           "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
    (folder / f"{TINY_ARCH}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)
    return TINY_ARCH


def test_open_clip_checkpoint_files_load(open_clip_arch, oc_clip_768, tmp_path):
    """HPSv2 and the aesthetic CLIP load a checkpoint file through open_clip (weights_only)."""
    model, tok = oc_clip_768
    sf, pt = tmp_path / "clip.safetensors", tmp_path / "clip.pt"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(sf))
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, pt)  # HPSv2's checkpoint layout
    x = images()
    injected = HPSv2(model=copy.deepcopy(model), tokenizer=tok, device="cpu")(x, PROMPTS, META)["hpsv2"]
    for path in (sf, pt):
        loaded = HPSv2(checkpoint=str(path), arch=open_clip_arch, device="cpu")(x, PROMPTS, META)["hpsv2"]
        torch.testing.assert_close(loaded, injected, atol=1e-5, rtol=0)
    mlp = tmp_path / "mlp.safetensors"
    save_file(random_mlp().state_dict(), str(mlp))
    a = Aesthetic(weights=str(mlp), clip_arch=open_clip_arch, clip_pretrained=str(sf), device="cpu")
    b = Aesthetic(weights=str(mlp), model=copy.deepcopy(model), device="cpu")
    torch.testing.assert_close(a(x, PROMPTS, META)["aesthetic"], b(x, PROMPTS, META)["aesthetic"])


def test_hf_clip_loads_from_a_local_folder(hf_clip, tmp_path):
    from transformers import CLIPImageProcessor, CLIPProcessor

    model, tok = hf_clip
    model.save_pretrained(tmp_path / "clip")
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
                         tokenizer=tok)
    proc.save_pretrained(tmp_path / "clip")
    x = images()
    loaded = ClipScore(model_id=str(tmp_path / "clip"), device="cpu")(x, PROMPTS, META)
    injected = ClipScore(model=copy.deepcopy(model), tokenizer=tok, device="cpu")(x, PROMPTS, META)
    torch.testing.assert_close(loaded["clipscore/cosine"], injected["clipscore/cosine"], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------- errors

def one_line(excinfo):
    return "\n" not in str(excinfo.value)


def test_missing_files_fail_in_one_line_naming_the_kwarg(tmp_path):
    missing = str(tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError, match="weights") as err:
        Aesthetic(weights=missing, device="cpu")
    assert missing in str(err.value) and one_line(err)
    with pytest.raises(FileNotFoundError, match="checkpoint") as err:
        HPSv2(checkpoint=missing, device="cpu")
    assert missing in str(err.value) and one_line(err)
    with pytest.raises(FileNotFoundError, match="model_id") as err:
        ClipScore(model_id=str(tmp_path / "no_clip_here"), device="cpu")
    assert one_line(err)
    with pytest.raises(ValueError, match="weights="):
        Aesthetic(device="cpu")
    with pytest.raises(ValueError, match="checkpoint="):
        HPSv2(device="cpu")


def test_hub_fetches_fail_offline_in_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="weights=") as err:
        resolve_file("hf:nobody/no-such-repo/aesthetic.pth", "weights")
    assert one_line(err)
    with pytest.raises(OSError, match="model_id") as err:
        ClipScore(model_id="nobody/no-such-clip", device="cpu")
    assert one_line(err)


def test_build_reward_by_dotted_path_with_injected_model(hf_clip):
    model, tok = hf_clip
    reward = build_reward("rewards.clip_scores:ClipScore", model=copy.deepcopy(model), tokenizer=tok,
                          device="cpu", batch_size=3)
    assert reward.name == "clipscore"
    assert score([reward], images(), PROMPTS, META)["clipscore"].shape == (N,)
    with pytest.raises(ValueError, match="batch_sise"):
        build_reward("rewards.clip_scores:PickScore", batch_sise=3)


def test_d2align_corrects_a_clip_score_along_its_image_embedding(hf_clip, tmp_path):
    from rewards.directional import save_direction

    model, tok = hf_clip
    inner = build_reward("rewards.clip_scores:ClipScore", model=copy.deepcopy(model), tokenizer=tok, device="cpu",
                         batch_size=3)
    x = images()
    embeddings = inner.embed_images(x)  # [N, D], chunks of 3
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(N))
    torch.testing.assert_close(embeddings, inner.backbone.embed_images(x).cpu(), atol=1e-5, rtol=0)  # one batch
    direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(3))
    save_direction(tmp_path / "d.safetensors", direction, reward="rewards.clip_scores:ClipScore", metadata={})
    corrected = build_reward("d2align", reward="rewards.clip_scores:ClipScore",
                             direction=str(tmp_path / "d.safetensors"), strength=0.5, model=copy.deepcopy(model),
                             tokenizer=tok, device="cpu", batch_size=3)
    out = corrected(x, PROMPTS, META)
    raw = inner(x, PROMPTS, META)["clipscore"]
    torch.testing.assert_close(out["clipscore_d2/raw"], raw)
    torch.testing.assert_close(out["clipscore_d2"], raw - 0.5 * embeddings @ direction, atol=1e-5, rtol=0)
    assert "clipscore_d2/cosine" in out  # the inner reward's sub-scores pass through


# ---------------------------------------------------------------------------- pickscore_rank

def test_pickscore_rank_is_the_rank_of_pickscore_within_each_group(hf_clip, tmp_path):
    """Flow-Factory's PickScore_Rank: rank / G, 0 for a group's lowest PickScore; ranks counted here by hand."""
    from rewards.clip_scores import PickScoreRank

    model, tok = hf_clip
    rank = build_reward("pickscore_rank", model=copy.deepcopy(model), tokenizer=tok, device="cpu", batch_size=2)
    assert isinstance(rank, PickScoreRank) and rank.scores_groups
    x, prompts = images(6), ["a red cat"] * 6
    raw = PickScore(model=copy.deepcopy(model), tokenizer=tok, device="cpu")(x, prompts, [{}] * 6)["pickscore"]
    assert len(set(raw.tolist())) == 6  # distinct scores: the hand count below is the rank

    def by_hand(scores):  # how many of the group's other images score lower, over the group size
        return torch.tensor([sum(t < s for t in scores) / len(scores) for s in scores])

    alone = rank(x, prompts, [{}] * 6)
    torch.testing.assert_close(alone["pickscore_rank"], by_hand(raw.tolist()), rtol=0, atol=0)
    torch.testing.assert_close(alone["pickscore_rank/pickscore"], raw, atol=1e-5, rtol=1e-5)

    groups = torch.tensor([1, 0, 1, 0, 1, 1])  # two groups, interleaved: each ranks on its own
    out = score([rank], x, prompts, [{}] * 6, groups=groups)
    for g in (0, 1):
        rows = (groups == g).nonzero()[:, 0]
        torch.testing.assert_close(out["pickscore_rank"][rows], by_hand(raw[rows].tolist()), rtol=0, atol=0)

    from rewards.directional import save_direction  # D²-Align around it: group-wise too, so it ranks per group

    save_direction(tmp_path / "d.safetensors", torch.zeros(rank.embed_images(x[:1]).shape[1]), reward="pickscore_rank",
                   metadata={})
    corrected = build_reward("d2align", reward="pickscore_rank", direction=str(tmp_path / "d.safetensors"),
                             model=copy.deepcopy(model), tokenizer=tok, device="cpu")
    assert corrected.scores_groups
    torch.testing.assert_close(score([corrected], x, prompts, [{}] * 6, groups=groups)["pickscore_rank_d2"],
                               out["pickscore_rank"], rtol=0, atol=0)  # a zero direction: the rank itself

    x[2, 0, 0, 0] = float("nan")  # an image PickScore cannot score: NaN, the other five rank among themselves
    holed = rank(x, prompts, [{}] * 6)["pickscore_rank"]
    kept = [0, 1, 3, 4, 5]
    assert math.isnan(holed[2]) and torch.equal(holed[kept], by_hand(raw[kept].tolist()))
