"""The reward seam: the Protocol rewards implement, how configs name them, and how they are scored.

Why here: core (`flowrl`) defines the contract and never imports the `rewards/` package at import
time. Configs name a reward by a short name (`REWARD_REGISTRY`) or a dotted path
"package.module:Class"; `build_reward` imports the module only when a run builds the reward, so
a missing optional dependency of one reward family never breaks `import flowrl`; building a reward
whose package (the `flowrl[rewards]` extra) is missing is one line naming the extra.

`score` is the single place where reward outputs are checked (shapes, dtype, keys) and where a
failing reward either stops the run or marks its batch NaN. NaN always means "could not score",
never zero: advantage code excludes NaN rows rather than learning from a fake score.
`AsyncScorer` overlaps scoring batch i with sampling batch i+1 (as Flow-GRPO does).
A group-wise reward (``scores_groups = True``: a rank within the group, a VLM comparing the group's images) is
called once per group of the batch (:func:`group_rows`); pointwise rewards see the whole batch in one call.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import math
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

logger = logging.getLogger("flowrl.rewards")

IMAGE_TOLERANCE = 1e-4  # slack on [0, 1]: decoders may overshoot by a rounding error


@runtime_checkable
class Reward(Protocol):
    """A batched, gradient-free scorer.

    ``reward(images [N,3,H,W] float in [0,1], prompts [N], metadata [N]) -> {key: Tensor[N]}``
    holding ``name`` (the main score) plus optional sub-scores ``"<name>/<sub>"``.
    NaN marks an image that could not be scored.

    Video (a family like Wan yields ``[N,T,3,H,W]``): a reward whose class sets ``takes_video = True`` gets
    the clips as they are; any other (an image reward) gets the first, middle and last frame of each clip as
    images (:func:`frame_indices`) and ``score`` averages its outputs per clip.

    Group-wise rewards: a reward whose class (or instance) sets ``scores_groups = True`` scores a group at once,
    each row's score depending on the group's other rows (PickScore's rank within the group, a VLM comparing the
    group's images; Flow-Factory's GroupwiseRewardModel). ``score`` calls it once per group, with exactly that
    group's rows, ``reward(images [G,3,H,W], prompts [G], metadata [G]) -> {key: Tensor[G]}`` (a video group:
    its clips' frames, averaged per clip as above), and puts its outputs back in row order. The groups are
    ``score``'s ``groups`` ids (training's prompt groups), or the rows of one prompt text when none are given.
    """

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str],
                 metadata: list[dict]) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class TrainableReward(Protocol):
    """A reward trained during the run (Adv-GRPO's discriminator). The run extra of
    :mod:`flowrl.recipes.reward_updates` calls ``update(images [N,3,H,W], prompts [N], metadata [N]) -> {metric:
    float}`` with the rollouts of each epoch for which ``updates_on(epoch)`` holds, skips the policy's update on
    epochs for which ``policy_updates_on(epoch)`` does not (Adv-GRPO alternates: the discriminator trains on 9 of
    every 10 epochs, the policy on the 10th), and saves ``state_dict()`` (JSON-safe) in the checkpoint, restored
    by ``load_state_dict`` on resume, so a resumed run scores as the uninterrupted one."""

    def updates_on(self, epoch: int) -> bool: ...

    def policy_updates_on(self, epoch: int) -> bool: ...

    def update(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, float]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


REWARD_REGISTRY: dict[str, str] = {
    "brightness": "rewards.simple:Brightness",
    "jpeg_compressibility": "rewards.simple:JpegCompressibility",
    "jpeg_incompressibility": "rewards.simple:JpegIncompressibility",
    "color_target": "rewards.simple:ColorTarget",
    "toyeval": "rewards.toyeval:ToyEval",
    "geneval": "rewards.geneval:GenEval",
    "remote": "rewards.remote:RemoteReward",
    "ocr": "rewards.ocr:OcrReward",
    "clipscore": "rewards.clip_scores:ClipScore",
    "pickscore": "rewards.clip_scores:PickScore",
    "pickscore_rank": "rewards.clip_scores:PickScoreRank",
    "hpsv2": "rewards.clip_scores:HPSv2",
    "aesthetic": "rewards.aesthetic:Aesthetic",
    "checklist": "rewards.checklist:Checklist",
    "vlm_yes": "rewards.vlm_likelihood:VlmYes",
    "prompt_echo": "rewards.vlm_likelihood:PromptEcho",
    "toy_proxy": "rewards.toy_proxy:ToyProxy",
    "toy_clip": "rewards.toy_clip:ToyClip",
    "d2align": "rewards.directional:DirectionalCorrection",
    "edit_preservation": "rewards.edit:EditPreservation",
    "motion_direction": "rewards.video:MotionDirection",
    "temporal_consistency": "rewards.video:TemporalConsistency",
    "fitted": "rewards.fitted:FittedReward",
    "adversarial": "rewards.adversarial:AdversarialReward",
    "reference_similarity": "rewards.adversarial:ReferenceSimilarity",
}
"""Short name -> dotted path. Strings only: nothing is imported until `build_reward`."""

REWARDS_EXTRA: dict[str, str] = {
    "open_clip": "open_clip_torch", "rapidocr_onnxruntime": "rapidocr-onnxruntime", "rapidfuzz": "rapidfuzz",
    "scipy": "scipy"}
"""Import name -> package of the ``flowrl[rewards]`` extra: a bare ``pip install flowrl`` leaves these out."""


def missing_extra(error: BaseException) -> str | None:
    """One line naming the extra when ``error`` is the ImportError of a ``flowrl[rewards]`` package, else None."""
    package = REWARDS_EXTRA.get((getattr(error, "name", None) or "").partition(".")[0])
    if not isinstance(error, ImportError) or package is None:
        return None
    return f"{package} is not installed: pip install 'flowrl[rewards]'"


class RewardError(RuntimeError):
    """A reward raised, or returned something that breaks the Protocol."""


def _one_line(text: Any, limit: int = 500) -> str:
    s = re.sub(r"\s+", " ", str(text)).strip()
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ----------------------------------------------------------------------------------- building

def _split_path(path: str) -> tuple[str, str]:
    """'pkg.mod:Class' or 'pkg.mod.Class' -> ('pkg.mod', 'Class')."""
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr or not sep:
        raise ValueError(f"bad reward path {path!r}; expected package.module:Class")
    return module, attr


def _unknown(name: str) -> ValueError:
    known = sorted(REWARD_REGISTRY)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ValueError(f"unknown reward '{name}'; {hint}known: {', '.join(known)} "
                      "(or give a dotted path package.module:Class)")


def check_reward_kwargs(label: str, cls: Any, kwargs: Mapping[str, Any]) -> None:
    """Reject bad constructor kwargs before calling, naming the reward and the kwarg."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in kwargs:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ValueError(f"reward '{label}' got unexpected keyword argument '{key}'; {hint}"
                                 f"accepts: {', '.join(accepted) or '(none)'}")
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        raise ValueError(f"reward '{label}': bad arguments {sorted(kwargs)}: {_one_line(err)}") from None


def accepts_keyword(reward_name: str, keyword: str) -> bool:
    """Whether the reward class behind ``reward_name`` takes ``keyword`` (imports it, builds nothing)."""
    try:
        return keyword in inspect.signature(resolve_reward_class(reward_name)).parameters
    except (TypeError, ValueError):
        return False


def resolve_reward_class(name: str) -> Any:
    """The class (or factory) behind a short name or dotted path, imported but not built."""
    if name in REWARD_REGISTRY:
        path = REWARD_REGISTRY[name]
    elif ":" in name or "." in name:
        path = name
    else:
        raise _unknown(name)
    module_name, attr = _split_path(path)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself failing at import
        if missing_extra(err):
            raise ValueError(f"reward '{name}': {missing_extra(err)}") from err
        raise ValueError(f"reward '{name}': cannot import module '{module_name}': "
                         f"{type(err).__name__}: {_one_line(err)}") from err
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"reward '{name}': module '{module_name}' has no attribute '{attr}'")
    return cls


def build_reward(name: str, /, **kwargs: Any) -> Reward:
    """Build a reward from a short name or dotted path with flat constructor kwargs.

    Every failure is a one-line ValueError naming the reward (and module or kwarg).
    """
    cls = resolve_reward_class(name)
    check_reward_kwargs(name, cls, kwargs)
    try:
        reward = cls(**kwargs)
    except (TypeError, ValueError) as err:  # a bad kwarg value, or a signature we could not inspect
        raise ValueError(f"reward '{name}': {type(err).__name__}: {_one_line(err)}") from err
    except OSError as err:  # its model files: not downloaded (offline), not found, not readable
        raise ValueError(f"reward '{name}': {_one_line(err)}") from err
    except ImportError as err:  # a reward that imports its model package when built (open_clip)
        if not missing_extra(err):
            raise
        raise ValueError(f"reward '{name}': {missing_extra(err)}") from err
    if not isinstance(reward, Reward) or not isinstance(getattr(reward, "name", None), str):
        raise ValueError(f"reward '{name}': {cls!r} does not build a Reward (needs a str `name` and __call__)")
    return reward


def build_rewards(specs: Sequence[Any], device) -> tuple[list[Reward], dict[str, float]]:
    """Instantiate the configured rewards -> (rewards, {training signal key: weight}).

    ``specs``: the config's ``rewards`` entries (``flowrl.config.schema.RewardSpec``: name, kwargs, key, weight).

    The signal key is the reward's main score unless the spec names one of its sub-scores (a dense
    partial score trains better than a sparse strict one when the base model rarely succeeds)."""
    rewards, weights, built = [], {}, {}
    for spec in specs:
        kwargs = dict(spec.kwargs)
        if device is not None and accepts_keyword(spec.name, "device"):
            kwargs.setdefault("device", str(device))  # each process scores on its own accelerator
        identity = (spec.name, repr(sorted(kwargs.items())))  # one instance scores every sub-score it is named for
        if identity not in built:
            built[identity] = build_reward(spec.name, **kwargs)
            rewards.append(built[identity])
        reward = built[identity]
        key = spec.key or reward.name
        if key != reward.name and not key.startswith(f"{reward.name}/"):
            raise ValueError(f"reward '{spec.name}': key {key!r} is not one of its outputs "
                             f"(use '{reward.name}' or '{reward.name}/<sub-score>')")
        weights[key] = spec.weight
    return rewards, weights


# ------------------------------------------------------------------------------------ scoring

def check_batch(images: Any, prompts: Sequence[str], metadata: Sequence[Any], *, video: bool = False) -> int:
    """The structural checks of a scoring batch (type, shape, lengths) -> N; no pass over pixels.

    ``video=True`` also accepts clips ``[N,T,3,H,W]`` (``score``'s own check; an image reward keeps the default)."""
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        kind = f"{images.dtype} tensor" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a float tensor [N,3,H,W] in [0,1], got {kind}")
    is_video = video and images.ndim == 5 and images.shape[1] > 0
    if not is_video and (images.ndim != 4 or images.shape[1] != 3):
        raise ValueError(f"images must have shape [N,3,H,W]{' or [N,T,3,H,W]' if video else ''}, "
                         f"got {tuple(images.shape)}")
    if is_video and images.shape[2] != 3:
        raise ValueError(f"videos must have shape [N,T,3,H,W], got {tuple(images.shape)}")
    n = images.shape[0]
    if len(prompts) != n or len(metadata) != n:
        raise ValueError(f"got {n} images but {len(prompts)} prompts and {len(metadata)} metadata")
    return n


def check_images(images: Any, prompts: Sequence[str], metadata: Sequence[Any]) -> int:
    """Validate a scoring batch and return N. One-line ValueError otherwise.

    Non-finite pixels pass (a diverged sample): rewards score those images NaN. Video ``[N,T,3,H,W]`` passes.
    """
    n = check_batch(images, prompts, metadata, video=True)
    if images.numel():
        lo, hi = torch.where(torch.isfinite(images), images, 0.5).aminmax()  # ignore NaN/inf
        if lo.item() < -IMAGE_TOLERANCE or hi.item() > 1 + IMAGE_TOLERANCE:
            raise ValueError(f"image values must lie in [0,1], got [{lo.item():.4g}, {hi.item():.4g}]")
    return n


def _check_output(name: str, out: Any, n: int) -> dict[str, torch.Tensor]:
    """Reward output -> {key: CPU float32 [N]}; RewardError if it breaks the Protocol."""
    if not isinstance(out, Mapping):
        raise RewardError(f"reward '{name}' returned {type(out).__name__}, expected dict[str, Tensor[N]]")
    if name not in out:
        raise RewardError(f"reward '{name}' returned no main key '{name}' (got {sorted(out)})")
    checked = {}
    for key, value in out.items():
        if key != name and not str(key).startswith(f"{name}/"):
            raise RewardError(f"reward '{name}' returned key {key!r}; keys must be '{name}' or '{name}/<sub>'")
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise RewardError(f"reward '{name}' key {key!r} is {kind}, expected a float Tensor[N]")
        if value.shape != (n,):
            raise RewardError(f"reward '{name}' key {key!r} has shape {tuple(value.shape)}, expected ({n},)")
        checked[key] = value.detach().to("cpu", torch.float32)
    return {name: checked.pop(name), **checked}  # main key first


def frame_indices(num_frames: int) -> list[int]:
    """Frames an image reward scores of a ``num_frames`` clip: first, middle and last (fewer for a short clip).

    Three frames see the start, the middle and the end of the motion at 3x an image's cost; their scores are
    averaged per clip, so a still clip scores exactly what its frame scores as an image."""
    return sorted({0, num_frames // 2, num_frames - 1})


def _reward_input(reward: Reward, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any]):
    """What ``reward`` is called with -> (images, prompts, metadata, frames per item): the batch itself, or for
    video and a reward without ``takes_video`` the sampled frames as ``[N*k,3,H,W]`` images, prompts and
    metadata repeated per frame."""
    if images.ndim == 4 or getattr(reward, "takes_video", False):
        return images, list(prompts), list(metadata), 1
    index = frame_indices(images.shape[1])
    k = len(index)
    frames = images[:, index].flatten(0, 1)  # [N*k, 3, H, W]
    return frames, [p for p in prompts for _ in range(k)], [m for m in metadata for _ in range(k)], k


def _failure(name: str, prompts: Sequence[str], err: BaseException) -> str:
    first = prompts[0] if prompts else ""
    first = first if len(first) <= 80 else first[:77] + "..."
    more = f" (+{len(prompts) - 1} more)" if len(prompts) > 1 else ""
    return _one_line(f"reward '{name}' failed on prompt {first!r}{more}: {type(err).__name__}: {err}", 800)


def with_source_pixels(images: torch.Tensor, metadata: Sequence[Any]) -> list[Any]:
    """Editing: each row whose metadata names a ``source_image`` gets a copy with ``source_pixels``, that source
    (the first, where a prompt has several) as a float tensor [3, H, W] in [0, 1] at the images' size (for edit
    rewards). The caller's dicts are left as they are, so nothing that writes metadata (reports, JSON) ever sees a
    tensor."""
    if not any(isinstance(m, Mapping) and m.get("source_image") and "source_pixels" not in m for m in metadata):
        return list(metadata)
    from flowrl.data.edit_sources import first_source, source_pixels  # only editing runs pay for the import

    height, width = images.shape[-2:]
    return [{**m, "source_pixels": source_pixels(first_source(m["source_image"]), height, width)}
            if isinstance(m, Mapping) and m.get("source_image") and "source_pixels" not in m else m for m in metadata]


def scores_groups(reward: Any) -> bool:
    """Whether ``reward`` (a class or an instance) scores a whole group per call (``scores_groups = True``)."""
    return bool(getattr(reward, "scores_groups", False))


GROUP_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_groups(groups: Any, n: int) -> None:
    """``groups`` is None or an integer tensor ``[N]`` of group ids; one-line ValueError otherwise."""
    if groups is None:
        return
    if not isinstance(groups, torch.Tensor) or groups.dtype not in GROUP_ID_DTYPES:
        kind = f"{groups.dtype} tensor" if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"groups must be an integer tensor [N] of group ids, got {kind}")
    if groups.shape != (n,):
        raise ValueError(f"groups has shape {tuple(groups.shape)}, expected ({n},): one group id per image")


def group_rows(groups: torch.Tensor | None, prompts: Sequence[str]) -> list[torch.Tensor]:
    """The row indices ``[G]`` of each group of a batch, in ascending order of group id: rows with equal
    ``groups`` ids (any order in the batch), or, with ``groups`` None, the rows of one prompt text (what eval
    renders: a prompt's images)."""
    if groups is None:
        first: dict[str, int] = {}
        groups = torch.tensor([first.setdefault(p, len(first)) for p in prompts], dtype=torch.long)
    if groups.numel() == 0:
        return []
    _, inverse = torch.unique(groups.cpu(), return_inverse=True)  # [N] group index of each row
    return list(torch.argsort(inverse, stable=True).split(torch.bincount(inverse).tolist()))


def check_whole_groups(rewards: Sequence[Reward], groups: torch.Tensor, group_size: int) -> None:
    """Training's invariant where a group-wise reward scores: every group id of the scoring batch ``groups``
    ``[N]`` holds all ``group_size`` rows of its group, since a part of a group ranks (or compares) otherwise
    than the whole. RewardError in one line otherwise; nothing to check when every reward is pointwise."""
    names = [reward.name for reward in rewards if scores_groups(reward)]
    if not names or groups.numel() == 0:
        return
    ids, counts = torch.unique(groups.cpu(), return_counts=True)
    short = (counts != group_size).nonzero()[:, 0]
    if len(short):
        bad = int(short[0])
        raise RewardError(f"reward '{names[0]}' scores whole groups, but group {int(ids[bad])} has {int(counts[bad])} "
                          f"of its {group_size} rows in this scoring batch: a group-wise reward needs each group's "
                          "rows scored together")


def _score_rows(reward: Reward, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any],
                rows: torch.Tensor | None, on_error: str) -> dict[str, torch.Tensor] | None:
    """``reward`` on the batch's rows ``rows`` ``[R]`` (None: all of them) -> its checked outputs ``{key: [R]}``
    (video: per clip), or None where it raised and ``on_error`` is "nan"."""
    if rows is not None:
        index = rows.tolist()
        images, prompts, metadata = images[rows], [prompts[i] for i in index], [metadata[i] for i in index]
    n = images.shape[0]
    inputs, frame_prompts, frame_metadata, k = _reward_input(reward, images, prompts, metadata)
    try:
        with torch.no_grad():
            out = reward(inputs, frame_prompts, frame_metadata)
    except Exception as err:
        msg = _failure(reward.name, prompts, err)
        if on_error == "raise":
            raise RewardError(msg) from err
        logger.warning("%s; scoring the %s NaN", msg, "batch" if rows is None else "group")
        return None
    checked = _check_output(reward.name, out, n * k)  # Protocol violations are bugs: always raise
    return {key: value.view(n, k).mean(1) for key, value in checked.items()} if k > 1 else checked


def _score_checked(rewards: Sequence[Reward], images: torch.Tensor, prompts: Sequence[str],
                   metadata: Sequence[Any], n: int, on_error: str,
                   groups: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    metadata = with_source_pixels(images, metadata)
    members = None  # each group's rows, found once for every group-wise reward
    for reward in rewards:
        if not scores_groups(reward):  # the whole batch in one call; failed: its main key NaN, no sub-scores
            merged.update(_score_rows(reward, images, prompts, metadata, None, on_error)
                          or {reward.name: torch.full((n,), math.nan, dtype=torch.float32)})
            continue
        members = group_rows(groups, prompts) if members is None else members
        merged[reward.name] = torch.full((n,), math.nan, dtype=torch.float32)  # main key first; a failed group: NaN
        for rows in members:
            for key, value in (_score_rows(reward, images, prompts, metadata, rows, on_error) or {}).items():
                merged.setdefault(key, torch.full((n,), math.nan, dtype=torch.float32))[rows] = value
    return merged


def _check_rewards(rewards: Sequence[Reward], on_error: str) -> None:
    if on_error not in ("raise", "nan"):
        raise ValueError(f"on_error must be 'raise' or 'nan', got {on_error!r}")
    names = [r.name for r in rewards]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise ValueError(f"each reward may appear once; duplicated: {', '.join(dupes)}")


def score(rewards: Sequence[Reward], images: torch.Tensor, prompts: Sequence[str],
          metadata: Sequence[Any], *, groups: torch.Tensor | None = None,
          on_error: str = "raise") -> dict[str, torch.Tensor]:
    """Score one batch with every reward -> merged {key: CPU float32 [N]}.

    ``groups``: integer group ids ``[N]`` (rows with equal ids form a group, in any order); None groups the rows
    of one prompt text. Only group-wise rewards read them: each is called once per group (:class:`Reward`).

    on_error="raise": a reward that raises stops the run (RewardError, one line, naming the reward
    and the first prompt). on_error="nan": log a warning on logger "flowrl.rewards" and score that
    reward's main key NaN for the whole batch (its sub-scores are absent); a group-wise reward that fails
    on a group scores that group's rows NaN, its sub-scores included. Outputs that break the
    Protocol (missing main key, wrong shape or dtype) raise RewardError either way.
    """
    _check_rewards(rewards, on_error)
    n = check_images(images, prompts, metadata)
    check_groups(groups, n)
    return _score_checked(rewards, images, prompts, metadata, n, on_error, groups)


class AsyncScorer:
    """Score batch i in a worker thread while the caller samples batch i+1.

    One worker, so results come back in submission order and rewards never run concurrently with
    themselves (reward models need not be thread-safe). Inputs are validated at `submit` (errors
    surface at the call site) and images are detached and cloned on their device, so in-place ops
    by the caller afterwards cannot race the worker. asynchronous=False scores inside `submit` and
    returns an already-finished Future: the same `.result()` interface, simpler tracebacks.
    """

    def __init__(self, rewards: Sequence[Reward], *, on_error: str = "raise",
                 asynchronous: bool = True) -> None:
        _check_rewards(rewards, on_error)
        self.rewards, self.on_error, self.asynchronous = list(rewards), on_error, asynchronous
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flowrl-reward") if asynchronous else None
        self._closed = False

    def submit(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Any],
               groups: torch.Tensor | None = None) -> Future:
        """Queue one batch (``groups``: as :func:`score`'s); `.result()` gives `score`'s dict (or raises its error)."""
        if self._closed:
            raise RuntimeError("AsyncScorer is closed")
        n = check_images(images, prompts, metadata)
        check_groups(groups, n)
        groups = None if groups is None else groups.detach().to("cpu", copy=True)
        args = (self.rewards, images.detach().clone(), list(prompts), list(metadata), n, self.on_error, groups)
        if self._pool is not None:
            return self._pool.submit(_score_checked, *args)
        future: Future = Future()
        try:
            future.set_result(_score_checked(*args))
        except Exception as err:
            future.set_exception(err)
        return future

    def close(self) -> None:
        """Wait for queued batches, then stop the worker. Idempotent."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "AsyncScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def nan_summary(rewards: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Count of images each reward could not score -> {"reward/<name>_nan": count} for logging: NaN and infinite
    values alike, as training drops both.

    Sub-scores ("<name>/<sub>") are skipped: some are legitimately NaN (not applicable).
    """
    return {f"reward/{k}_nan": float((~torch.isfinite(v)).sum()) for k, v in rewards.items() if "/" not in k}
