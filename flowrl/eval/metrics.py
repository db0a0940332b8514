"""Diversity and distribution metrics over feature tensors: what preference mode collapse looks like in numbers.

RL fine-tuning on a reward tends to make a model answer every seed of a prompt the same way. The metrics here
measure that from several sides:

- ``pairwise_cosine_distance``: in-group mean pairwise cosine distance of image features (GARDO's diversity);
- ``vendi_score`` / ``group_vendi``: the effective number of distinct samples (Friedman & Dieng's Vendi score);
- ``latent_gmd``: a power mean of pairwise latent distances (the latent-space diversity TMPO reports);
- ``fid_kid``: FID and KID against a reference set, through torchmetrics, with any feature network;
- ``reward_means``: trained versus held-out reward means, the first check for reward hacking.

Group ids are explicit (``[N]`` ints, as in the rest of flowrl) and per-group results come in the order of
the sorted unique ids. The functions compute on the device of their input and return float64 per-group
tensors there, or Python floats.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn


def _unit_rows(features: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> the rows L2-normalised, in float64; a zero row has no direction, so it is an error."""
    if features.ndim != 2:
        raise ValueError(f"features must be [N, D], got shape {tuple(features.shape)}")
    features = features.double()
    norms = features.norm(dim=1, keepdim=True)  # [N, 1]
    if bool((norms == 0).any()):
        rows = (norms[:, 0] == 0).nonzero()[:, 0].tolist()
        raise ValueError(f"features has zero vectors (rows {rows[:10]}); the cosine of a zero vector is undefined")
    return features / norms


def _group_index(group_ids: torch.Tensor | None, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each row's position among the sorted unique group ids (``[N]``) and the number of groups."""
    if group_ids is None:
        return torch.zeros(n, dtype=torch.long, device=device), 1
    group_ids = torch.as_tensor(group_ids, device=device)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape [{n}], got {tuple(group_ids.shape)}")
    unique, index = torch.unique(group_ids, sorted=True, return_inverse=True)
    return index, len(unique)


def _group_rows(group_ids: torch.Tensor | None, n: int, device: torch.device) -> list[torch.Tensor]:
    """The row indices of each group, in the order of the sorted unique ids."""
    index, count = _group_index(group_ids, n, device)
    return [(index == g).nonzero()[:, 0] for g in range(count)]


def per_group(values: torch.Tensor, group_ids: torch.Tensor | None, statistic) -> torch.Tensor:
    """``statistic(rows)`` (a 0-d tensor) of each group's rows of ``values`` ``[N, ...]`` -> ``[G]``, in the order of
    the sorted unique ids (None: all rows are one group): how every in-group score here is taken."""
    return torch.stack([statistic(values[rows]) for rows in _group_rows(group_ids, len(values), values.device)])


def pairwise_cosine_distance(features: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per group, the mean of ``1 - cos(f_i, f_j)`` over ordered pairs ``i != j`` (GARDO's in-group diversity).

    features ``[N, D]``, group_ids ``[N]`` (None: all rows are one group). Returns float64 ``[G]``.
    Range [0, 2], higher = more diverse: 0 when a group's features all point the same way, 1 for mutually
    orthogonal features. NaN for a group of one (it has no pairs). A zero feature vector raises ValueError."""
    unit = _unit_rows(features)  # [N, D]
    index, count = _group_index(group_ids, len(unit), unit.device)
    distance = 1.0 - unit @ unit.T  # [N, N]
    same = (index[:, None] == index[None, :]) & ~torch.eye(len(unit), dtype=torch.bool, device=unit.device)
    row_sums = (distance * same).sum(dim=1)  # [N]: each row's distances to the rest of its group
    sums = torch.zeros(count, dtype=torch.float64, device=unit.device).index_add_(0, index, row_sums)  # [G]
    sizes = torch.bincount(index, minlength=count).double()  # [G]
    return sums / (sizes * (sizes - 1))  # 0 / 0 = NaN for a group of one


def _vendi_from_eigenvalues(eigenvalues: torch.Tensor, q: float) -> float:
    """The Vendi score of order q from the eigenvalues of K/n (``[M]``, summing to 1)."""
    lam = eigenvalues.clamp_min(0.0)  # eigvalsh returns tiny negatives for a PSD matrix
    positive = lam[lam > 1e-10 * lam.max()]  # [M'], the rest are rounding noise around zero
    if q == 0:
        return float(len(positive))
    if math.isinf(q):
        return float(1.0 / positive.max())
    if q == 1:
        return float(torch.exp(-(positive * positive.log()).sum()))  # 0 log 0 = 0: zeros are left out
    return float(positive.pow(q).sum().pow(1.0 / (1.0 - q)))


def vendi_score(features: torch.Tensor, q: float = 1.0) -> float:
    """The Vendi score of order q with the cosine kernel ``K_ij = cos(f_i, f_j)``: the effective number of
    distinct samples.

    features ``[N, D]``. With λ the eigenvalues of K/n: q=1 gives ``exp(-Σ λ log λ)``, q=inf ``1 / max λ``,
    q=0 the number of nonzero eigenvalues, any other q ``(Σ λ^q)^(1/(1-q))``. Range [1, n], higher = more
    diverse: 1 when all features point the same way, k for k mutually orthogonal directions equally
    represented. A zero feature vector raises ValueError.

    K/n = U Uᵀ/n and Uᵀ U/n share their nonzero eigenvalues, so the smaller of the two (n x n or D x D) is
    decomposed: the score is the same, and many samples of small features stay cheap."""
    if q < 0:
        raise ValueError(f"the Vendi order q must be >= 0, got {q}")
    unit = _unit_rows(features)  # [N, D]
    n, d = unit.shape
    gram = unit @ unit.T if n <= d else unit.T @ unit  # [min(N, D), min(N, D)]
    return _vendi_from_eigenvalues(torch.linalg.eigvalsh(gram / n), q)


def group_vendi(features: torch.Tensor, group_ids: torch.Tensor, q: float = 1.0) -> torch.Tensor:
    """The Vendi score of each group (see :func:`vendi_score`): features ``[N, D]``, group_ids ``[N]``.

    Returns float64 ``[G]`` in the order of the sorted unique ids; each entry is in [1, group size]."""
    rows = _group_rows(group_ids, len(features), features.device)
    return torch.tensor([vendi_score(features[r], q) for r in rows], dtype=torch.float64, device=features.device)


def latent_gmd(latents: torch.Tensor, group_ids: torch.Tensor | None = None, p: float = 0.0) -> torch.Tensor:
    """Latent generalised mean distance: per group, the power mean of pairwise latent distances.

    The exact formula TMPO publishes for its latent-space diversity was not available to us, so flowrl defines
    it this way: latents ``[N, ...]`` are flattened to ``[N, D]``, ``d_ij = ||z_i - z_j||_2 / sqrt(D)`` (an RMS
    distance, so it does not grow with resolution), and each group reports the power mean of d_ij over its
    unordered pairs i < j: ``p=1`` the arithmetic mean (the plain mean pairwise latent distance), ``p=0`` the
    geometric mean ``exp(mean log d_ij)``, any other p ``(mean d^p)^(1/p)``. For p <= 0 distances are clamped at
    1e-12 first, so an exact duplicate pulls the mean toward 0: the geometric mean is sensitive to the
    near-duplicates that collapse creates, where the arithmetic mean can hide them behind a few far pairs.

    Returns float64 ``[G]``. Range [0, inf), higher = more diverse, 0 for identical latents (1e-12 for p <= 0).
    NaN for a group of one."""
    flat = latents.reshape(len(latents), -1).double()  # [N, D]
    scale = math.sqrt(flat.shape[1])
    out = []
    for rows in _group_rows(group_ids, len(flat), flat.device):
        z = flat[rows]  # [n, D]
        # Direct differences (not the |a|²+|b|²-2ab shortcut) keep an exact duplicate at exactly 0.
        pairs = torch.triu_indices(len(z), len(z), offset=1, device=z.device)  # [2, n(n-1)/2]
        d = torch.cdist(z[None], z[None], compute_mode="donot_use_mm_for_euclid_dist")[0][pairs[0], pairs[1]] / scale
        out.append(_power_mean(d, p))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64, device=flat.device)


def _power_mean(d: torch.Tensor, p: float) -> torch.Tensor:
    """Power mean of order p of the distances ``[M]``; NaN when there are none."""
    if len(d) == 0:
        return torch.tensor(math.nan, dtype=torch.float64, device=d.device)
    if p <= 0:
        d = d.clamp_min(1e-12)
    if p == 0:
        return d.log().mean().exp()
    return d.pow(p).mean().pow(1.0 / p)


def reward_means(scores: dict[str, torch.Tensor], trained: set[str]) -> dict[str, float]:
    """``{"reward/<k>": nanmean}`` for the rewards trained on, ``{"held_out/<k>": nanmean}`` for the others.

    A reward the policy optimised can rise by hacking it; a held-out reward of the same quality that does not
    rise with it is the cheapest sign of that, so the two are kept in separate namespaces."""
    out = {}
    for key, values in scores.items():
        prefix = "reward" if key in trained else "held_out"
        out[f"{prefix}/{key}"] = float(torch.nanmean(values.detach().double()))
    return out


class _SharedFeatures(nn.Module):
    """Wraps a feature network for two torchmetrics metrics fed the same batches: a batch's features are
    computed once and handed to both, in float64 (KID's MMD subtracts large kernel sums)."""

    def __init__(self, network: nn.Module, num_features: int):
        super().__init__()
        self.network = network
        self.num_features = num_features
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self._last is None or self._last[0] is not images:
            self._last = (images, self.network(images).double())  # [B, num_features]
        return self._last[1]


def _network_device(network: nn.Module, fallback: torch.device) -> torch.device:
    tensor = next(iter(network.parameters()), None)
    if tensor is None:
        tensor = next(iter(network.buffers()), None)
    return tensor.device if tensor is not None else fallback


def _singular_warning(sizes: dict[str, int], feature_dim: int) -> list[str]:
    """Warn once when a set has no more images than feature dimensions: its covariance is then singular."""
    small = {name: n for name, n in sizes.items() if n <= feature_dim}
    if not small:
        return []
    which = " and ".join(f"the {name} set has {n} images" for name, n in small.items())
    warnings.warn(f"FID: {which}, no more than the {feature_dim} feature dimensions; the covariance is singular "
                  f"and FID is unreliable (KID is not affected): use more than {feature_dim} images per set or a "
                  "smaller feature network", UserWarning, stacklevel=3)
    return ["fid"]


def fid_kid(reference_images: torch.Tensor, images: torch.Tensor, feature_network: nn.Module, *,
            batch_size: int = 64, kid_subset_size: int | None = None, kid_subsets: int = 100,
            seed: int = 0) -> dict:
    """FID and KID of ``images`` against ``reference_images`` through torchmetrics, with any feature network.

    Images ``[N, 3, H, W]`` float in [0, 1]; the network maps them to ``[N, num_features]`` (it needs an int
    ``num_features``; see :mod:`flowrl.features`). Both metrics run where the network's weights are and
    images move there one batch at a time; each batch's features are computed once and shared.

    FID: range [0, inf), lower = closer; it needs more images per set than feature dimensions (else a
    warning, and "fid" in ``unreliable``). KID (unbiased MMD² with the polynomial kernel, mean and std over
    ``kid_subsets`` random subsets of ``kid_subset_size``, default ``min(1000, n_reference, n_images)``): lower =
    closer, about 0 for the same distribution, can be slightly negative. torchmetrics draws KID's subsets
    from the global CPU generator and takes no generator of its own, so they are drawn inside
    ``torch.random.fork_rng`` seeded with ``seed``: the result is reproducible and the caller's RNG state is
    untouched. The metrics do not sync across processes: gather the images first to score a distributed run."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    sizes = {"reference": len(reference_images), "generated": len(images)}
    for name, n in sizes.items():
        if n < 2:
            raise ValueError(f"fid_kid: the {name} set has {n} image(s); FID and KID need at least 2 per set")
    feature_dim = getattr(feature_network, "num_features", None)
    if not isinstance(feature_dim, int):
        raise TypeError(f"fid_kid: {type(feature_network).__name__} needs an int attribute num_features")
    subset = kid_subset_size or min(1000, *sizes.values())
    if subset < 2 or subset > min(sizes.values()):
        raise ValueError(f"fid_kid: kid_subset_size={subset} must be in [2, {min(sizes.values())}] (the smaller set)")
    unreliable = _singular_warning(sizes, feature_dim)

    shared = _SharedFeatures(feature_network, feature_dim)
    device = _network_device(feature_network, images.device)
    with warnings.catch_warnings():  # KID warns on construction that it keeps all features in memory
        warnings.simplefilter("ignore", UserWarning)
        fid = FrechetInceptionDistance(feature=shared, normalize=True, sync_on_compute=False).to(device)
        kid = KernelInceptionDistance(feature=shared, normalize=True, subsets=kid_subsets, subset_size=subset,
                                      sync_on_compute=False).to(device)
    for real, batch_source in ((True, reference_images), (False, images)):
        for start in range(0, len(batch_source), batch_size):
            batch = batch_source[start:start + batch_size].to(device)  # [B, 3, H, W]
            fid.update(batch, real=real)
            kid.update(batch, real=real)
    shared._last = None
    with torch.random.fork_rng(devices=[]):  # torchmetrics draws KID's subsets with the global CPU generator
        torch.manual_seed(seed)
        kid_mean, kid_std = kid.compute()
    return {"fid": float(fid.compute()), "kid": float(kid_mean), "kid_std": float(kid_std),
            "n_reference": sizes["reference"], "n_images": sizes["generated"], "feature_dim": feature_dim,
            "unreliable": unreliable}
