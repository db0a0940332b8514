"""flowrl.eval.metrics and flowrl.features, held to numbers worked out by hand or by a plain loop here."""

from __future__ import annotations

import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch

from flowrl.algorithms.advantages import zero_std_fraction
from flowrl.features import FEATURE_NETWORKS, build_feature_network
from flowrl.eval.metrics import fid_kid, group_vendi, latent_gmd, pairwise_cosine_distance, reward_means, vendi_score

# ------------------------------------------------------------------------------------------------ diversity


def test_identical_features_have_no_diversity():
    features = torch.tensor([[0.3, -1.0, 2.0]]).repeat(6, 1)  # [6, 3]
    assert pairwise_cosine_distance(features).item() == pytest.approx(0.0, abs=1e-12)
    for q in (0.0, 1.0, 2.0, float("inf")):
        assert vendi_score(features, q) == pytest.approx(1.0, abs=1e-9)
    latents = torch.randn(1, 4, 8, 8).repeat(5, 1, 1, 1)  # [5, 4, 8, 8]
    assert latent_gmd(latents, p=1.0).item() == 0.0
    assert latent_gmd(latents, p=0.0).item() == pytest.approx(1e-12)  # the clamp, i.e. ~0


def test_pairwise_cosine_distance_hand_case():
    # Group 5: a=(1,0), b=(0,1), c=(1,1): cosines 0, 1/√2, 1/√2, so the distances are 1, 1-1/√2, 1-1/√2 and
    # their mean (the same over ordered and unordered pairs) is (3 - √2)/3. Group 2: opposite vectors, distance
    # 2. Group 9: one row, no pairs. Rows are interleaved; results come in sorted-id order 2, 5, 9.
    features = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [-1.0, 0.0], [1.0, 1.0], [4.0, 5.0]])
    group_ids = torch.tensor([5, 2, 5, 2, 5, 9])
    out = pairwise_cosine_distance(features, group_ids)
    assert out.shape == (3,)
    assert out[0].item() == pytest.approx(2.0)
    assert out[1].item() == pytest.approx((3 - math.sqrt(2)) / 3)
    assert math.isnan(out[2].item())
    with pytest.raises(ValueError, match="zero vectors"):
        pairwise_cosine_distance(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("dim", [3, 40])  # D < n takes the D x D Gram matrix, D > n the n x n one
@pytest.mark.parametrize("q", [0.0, 1.0, 2.0, float("inf")])
def test_vendi_of_orthogonal_directions_is_their_number(dim, q):
    k, m = 3, 5  # three orthogonal directions, each repeated five times with different positive scales
    features = torch.zeros(k * m, dim)
    for i in range(k * m):
        features[i, i % k] = 0.5 + i
    assert vendi_score(features, q) == pytest.approx(k, rel=1e-9)


def test_vendi_hand_two_by_two():
    # Two unit vectors at cos = 1/2: K = [[1, .5], [.5, 1]], K/2 has eigenvalues 3/4 and 1/4.
    features = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2]], dtype=torch.float64)  # float32 is off by 4e-9
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert vendi_score(features, 1.0) == pytest.approx(math.exp(entropy), rel=1e-12)  # 1.7548...
    assert vendi_score(features, 2.0) == pytest.approx(1 / (0.75**2 + 0.25**2), rel=1e-12)  # 1.6
    assert vendi_score(features, float("inf")) == pytest.approx(4 / 3, rel=1e-12)
    assert vendi_score(features, 0.0) == 2.0


def _vendi_reference(features: np.ndarray) -> float:
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    lam = np.clip(np.linalg.eigvalsh(unit @ unit.T / len(unit)), 0, None)
    lam = lam[lam > 1e-12]
    return float(np.exp(-(lam * np.log(lam)).sum()))


@pytest.mark.parametrize("dim", [4, 64])
def test_vendi_small_gram_matches_the_n_by_n_reference(dim):
    features = torch.randn(20, dim, generator=torch.Generator().manual_seed(1))
    assert vendi_score(features) == pytest.approx(_vendi_reference(features.double().numpy()), rel=1e-9)


def test_group_vendi_scores_each_group():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [2.0, 2.0], [1.0, 0.0]])
    out = group_vendi(features, torch.tensor([1, 1, 0, 0, 3]))
    assert out.tolist() == pytest.approx([1.0, 2.0, 1.0])  # identical pair, orthogonal pair, a single row


def _gmd_reference(latents: torch.Tensor, group_ids: list[int], p: float) -> list[float]:
    flat = latents.reshape(len(latents), -1).double()
    out = []
    for g in sorted(set(group_ids)):
        rows = [i for i, gid in enumerate(group_ids) if gid == g]
        d = [max(float((flat[i] - flat[j]).norm()) / math.sqrt(flat.shape[1]), 1e-12)
             for a, i in enumerate(rows) for j in rows[a + 1:]]
        if not d:
            out.append(math.nan)
        elif p == 0:
            out.append(math.exp(sum(math.log(x) for x in d) / len(d)))
        else:
            out.append((sum(x**p for x in d) / len(d)) ** (1 / p))
    return out


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0])
def test_latent_gmd_matches_a_loop_over_pairs(p):
    latents = torch.randn(12, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    latents[7] = latents[1]  # an exact duplicate in group 0: the geometric mean drops toward 0
    group_ids = [0, 0, 1, 2, 1, 0, 1, 0, 2, 2, 1, 3]
    out = latent_gmd(latents, torch.tensor(group_ids), p=p)
    expected = _gmd_reference(latents, group_ids, p)
    assert out[:3].tolist() == pytest.approx(expected[:3], rel=1e-9)
    assert math.isnan(out[3].item()) and math.isnan(expected[3])
    if p == 0:
        assert out[0] < 0.1 * latent_gmd(latents[[0, 1, 5]], p=0.0)[0]  # without the duplicate it is far higher


def test_zero_std_fraction_hand_case():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, math.nan, 3.0, math.nan, 0.5, 0.5 + 1e-8, 0.0, 1.0],
                           dtype=torch.float64)  # float32 would round 0.5 + 1e-8 to 0.5
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4])
    # group 0 flat; group 1 std 0.5 (NaN ignored); group 2 has one finite reward, not counted; group 3 flat
    # within tol; group 4 std 0.5: two flat groups of four counted.
    assert zero_std_fraction(rewards, group_ids, tol=1e-6) == pytest.approx(0.5)  # flowrl eval's rule
    assert zero_std_fraction(rewards, group_ids, tol=1e-9) == pytest.approx(0.25)
    # training's rule: exact ties only, and a group with fewer than two finite rewards is flat (it teaches nothing)
    assert zero_std_fraction(rewards, group_ids) == pytest.approx(2 / 5)


def test_reward_means_split_trained_and_held_out():
    scores = {"clip": torch.tensor([1.0, math.nan, 3.0]), "aesthetic": torch.tensor([0.5, 1.5, 1.0])}
    assert reward_means(scores, trained={"clip"}) == pytest.approx({"reward/clip": 2.0, "held_out/aesthetic": 1.0})


# ------------------------------------------------------------------------------------------------ FID / KID


def _images(n: int, size: int, seed: int, high: float = 0.75) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * high  # [n, 3, s, s]


def test_fid_against_itself_is_zero_and_grows_as_D_delta_squared_under_a_brightness_shift():
    # pixels at 4x4 are linear in the image and a constant shift survives the (weights-sum-to-one) resize, so
    # the shifted set has the same covariance and its mean moves by δ in each of the 48 dimensions:
    # FID = |Δμ|² = 48 δ². Images stay in [0, 0.95], so nothing clips.
    network = build_feature_network("pixels", size=4)
    images = _images(200, 8, seed=3)
    fids = [fid_kid(images, images + delta, network, kid_subsets=2)["fid"] for delta in (0.0, 0.05, 0.1, 0.2)]
    assert abs(fids[0]) < 1e-6
    assert fids == pytest.approx([48 * d**2 for d in (0.0, 0.05, 0.1, 0.2)], abs=1e-6)
    assert fids[0] < fids[1] < fids[2] < fids[3]


def _poly_mmd_reference(x: np.ndarray, y: np.ndarray) -> float:
    # Unbiased MMD² (off-diagonal within-set means, full cross mean) with k(a, b) = (a·b/d + 1)^3.
    m, d = x.shape
    kernel = lambda a, b: (a @ b.T / d + 1.0) ** 3  # noqa: E731
    kxx, kyy, kxy = kernel(x, x), kernel(y, y), kernel(x, y)
    within = (kxx.sum() - np.trace(kxx) + kyy.sum() - np.trace(kyy)) / (m * (m - 1))
    return float(within - 2 * kxy.sum() / m**2)


def test_kid_with_one_full_subset_is_the_unbiased_poly_mmd():
    network = build_feature_network("pixels", size=2)
    reference, images = _images(40, 2, seed=4), _images(40, 2, seed=5, high=0.9)
    assert torch.equal(network(images), images.flatten(1))  # 2x2 input: the features are the pixels
    out = fid_kid(reference, images, network, kid_subset_size=40, kid_subsets=1)
    expected = _poly_mmd_reference(reference.flatten(1).double().numpy(), images.flatten(1).double().numpy())
    assert out["kid"] == pytest.approx(expected, rel=1e-9)
    assert out["kid_std"] == 0.0
    assert (out["n_reference"], out["n_images"], out["feature_dim"], out["unreliable"]) == (40, 40, 12, [])


def test_kid_subsets_are_seeded_and_leave_the_global_rng_alone():
    network = build_feature_network("pixels", size=4)
    reference, images = _images(60, 4, seed=6), _images(50, 4, seed=7, high=0.9)
    state = torch.get_rng_state()
    first = fid_kid(reference, images, network, kid_subset_size=20, kid_subsets=5, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert fid_kid(reference, images, network, kid_subset_size=20, kid_subsets=5, seed=1) == first
    assert fid_kid(reference, images, network, kid_subset_size=20, kid_subsets=5, seed=2)["kid"] != first["kid"]
    assert first["kid_std"] > 0


def test_each_image_goes_through_the_network_once():
    class Counting(torch.nn.Module):
        num_features = 48

        def __init__(self):
            super().__init__()
            self.seen = 0

        def forward(self, images):
            self.seen += len(images)
            return images.flatten(1)

    network = Counting()
    fid_kid(_images(70, 4, seed=8), _images(60, 4, seed=9), network, batch_size=32, kid_subsets=2)
    assert network.seen == 130  # FID and KID share each batch's features


def test_small_reference_set_warns_once_and_marks_fid_unreliable():
    network = build_feature_network("toy")  # 64 features
    with pytest.warns(UserWarning, match="unreliable") as record:
        out = fid_kid(_images(10, 64, seed=10), _images(100, 64, seed=11), network, kid_subsets=3)
    assert sum("FID:" in str(w.message) for w in record) == 1
    assert "reference set has 10 images" in str(record[0].message)
    assert out["unreliable"] == ["fid"]
    assert math.isfinite(out["kid"])


def test_fewer_than_two_images_is_an_error():
    network = build_feature_network("pixels", size=4)
    with pytest.raises(ValueError, match="at least 2"):
        fid_kid(_images(1, 4, seed=0), _images(10, 4, seed=1), network)
    with pytest.raises(ValueError, match="at least 2"):
        fid_kid(_images(10, 4, seed=0), _images(1, 4, seed=1), network)


# ------------------------------------------------------------------------------------------- feature networks


def test_toy_network_is_fixed_by_its_seed_alone():
    images = _images(4, 64, seed=12)
    torch.manual_seed(0)
    a = build_feature_network("toy")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    b = build_feature_network("toy")
    assert torch.equal(torch.get_rng_state(), state)  # building draws nothing from the global RNG
    assert torch.equal(a(images), b(images))
    assert a(images).shape == (4, a.num_features) == (4, 64)
    assert a(images).dtype == torch.float32
    assert not torch.equal(build_feature_network("toy", seed=1)(images), a(images))
    assert build_feature_network("toy", num_features=16)(_images(2, 20, seed=0)).shape == (2, 16)
    a.train()
    assert not a.training and not any(p.requires_grad for p in a.parameters())


def test_toy_network_stats_pooling_by_a_plain_loop():
    images = _images(3, 32, seed=14)
    stats = build_feature_network("toy", pool="stats")
    assert stats.num_features == 2 * (16 + 32 + 64)
    out = stats(images)  # [3, 224]
    x, expected = images * 2 - 1, []
    for i, weight in enumerate(stats.weights):  # each layer's channel mean and population std, layer by layer
        x = torch.nn.functional.conv2d(x, weight, stride=2, padding=1)
        x = x.relu() if i < 2 else x
        flat = x.flatten(2)  # [3, C, h*w]
        mean = flat.sum(2) / flat.shape[2]
        expected += [mean, ((flat - mean[..., None]) ** 2).mean(2).sqrt()]
    torch.testing.assert_close(out, torch.cat(expected, 1))
    # the default pooling is the last layer's means: the same network, the same numbers
    torch.testing.assert_close(build_feature_network("toy")(images), out[:, 2 * (16 + 32):2 * (16 + 32) + 64])
    with pytest.raises(ValueError, match="pool must be"):
        build_feature_network("toy", pool="max")


def test_pixel_network_shape():
    network = build_feature_network("pixels")
    assert network(_images(3, 64, seed=13)).shape == (3, network.num_features) == (3, 768)


def test_clip_network_returns_unit_rows():
    network = build_feature_network("clip", model="ViT-S-32", pretrained=None)  # random weights: tests only
    out = network(_images(2, 48, seed=14))
    assert out.shape == (2, network.num_features) == (2, 384)
    assert torch.allclose(out.norm(dim=1), torch.ones(2), atol=1e-5)
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint file nor an open_clip tag"):
        build_feature_network("clip", model="ViT-S-32", pretrained="/no/such/clip.pt")


def test_dino_network_is_the_cls_token_of_a_saved_model(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          patch_size=14, image_size=28)
    torch.manual_seed(0)
    Dinov2Model(config).save_pretrained(tmp_path)
    network = build_feature_network("dino", path=str(tmp_path), size=28)
    images = _images(3, 28, seed=15)
    out = network(images)
    assert out.shape == (3, network.num_features) == (3, 32)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)  # ImageNet's, by hand
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    reloaded = Dinov2Model.from_pretrained(tmp_path).eval()
    expected = reloaded(pixel_values=(images - mean) / std).last_hidden_state[:, 0]  # [3, 32], the CLS token
    assert torch.allclose(out, expected, atol=1e-5)
    assert network(_images(2, 56, seed=16)).shape == (2, 32)  # other sizes are resized to 28
    with pytest.raises(FileNotFoundError, match="dino"):
        build_feature_network("dino", path=str(tmp_path / "missing"))


def test_inception_network_needs_torch_fidelity_and_its_weights(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_fidelity", None)  # import fails whether it is installed or not
    with pytest.raises(ImportError, match=r"pip install 'flowrl\[fid\]'"):
        build_feature_network("inception", weights_path=str(tmp_path / "pt_inception.pth"))
    monkeypatch.setitem(sys.modules, "torch_fidelity", types.ModuleType("torch_fidelity"))
    with pytest.raises(FileNotFoundError, match="weights_path"):
        build_feature_network("inception", weights_path=str(tmp_path / "pt_inception.pth"))


def test_unknown_feature_network_lists_the_choices():
    with pytest.raises(ValueError, match="choose one of") as err:
        build_feature_network("resnet")
    assert all(name in str(err.value) for name in FEATURE_NETWORKS)


def test_metrics_do_not_warn_on_ordinary_input():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fid_kid(_images(60, 4, seed=17), _images(60, 4, seed=18), build_feature_network("pixels", size=2),
                kid_subsets=2)
