"""ParetoSlider's preference conditioning: one model for the whole trade-off between several rewards.

ParetoSlider (see ``../shared/PAPERS.md``) trains a single policy on continuously varying preference weights w
(a point of the simplex, one entry per reward) given to the model as a conditioning signal, so that the user
moves along the Pareto front at inference time. The abstract names no architecture and no public code was found,
so these are flowrl's choices:

- **The embedding.** A 2-layer MLP ``w [B, K] -> SiLU(W1 w + b1) [B, H] -> W2 . + b2 [B, D]`` whose output layer
  starts at zero, so a freshly conditioned policy is exactly the unconditioned one (ControlNet's zero
  convolution, for the same reason: training starts from the base model, and w gains an effect only as it
  learns one). Its first layer is drawn from the run's seed under a forked RNG, so attaching it changes no
  other random draw of the run.
- **Where it enters.** Its output is added to the output of the transformer's timestep embedding (``where:
  timestep``, every family has one: the vector that modulates every block's norms) or to that of the pooled
  text projection (``where: pooled``; SD3 and FLUX.1 sum it into the same vector). A forward hook on that
  submodule adds it; the family names the submodule (``PolicyBase.preference_sites``).
- **How rows get their w.** A batch's weights travel in ``TextCond.preference`` ``[B, K]`` (one row per
  prompt, indexed with the rest of the conditioning), and the policy's ``velocity`` sets them on the module for
  the duration of the call. Without rows the module adds the embedding of its ``default`` w (uniform until
  :func:`set_preference` moves the slider). A forward of M = r B rows (classifier-free guidance stacks the
  negative and the positive batch) repeats the B rows r times, in that order.
- **Where it lives.** The module is a submodule of the transformer named ``flowrl_preference``: its
  parameters are the transformer's trainable parameters, so the optimizer, the EMA, the distributed wrapper
  and the checkpoint (``lora_state_dict`` keys ``flowrl_preference.*``) carry it without naming it. The
  reference model (``policy.reference()``) switches it off with the LoRA.
- **Export.** ``export-lora`` and a run's ``lora/`` write it beside the LoRA as ``preference_embedding.safetensors``
  (keys ``preference.*``, metadata naming the rewards, the hooked submodule and the sizes); the diffusers LoRA
  file itself is unchanged, so every loader still reads it. :func:`load_preference` installs it into a plain
  diffusers pipeline and :func:`set_preference` moves the slider::

      pipe = StableDiffusion3Pipeline.from_pretrained(BASE)
      pipe.load_lora_weights("runs/pareto/lora")
      load_preference(pipe, "runs/pareto/lora")
      set_preference(pipe, [0.3, 0.7])     # the order of the rewards in the file's metadata
      image = pipe(prompt).images[0]

A preference on input is refused rather than normalised (wrong length, a negative entry, or entries that do not
sum to 1 within ``TOLERANCE``): a silently rescaled slider would sample another trade-off than the one asked for.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

PREFERENCE_ATTRIBUTE = "flowrl_preference"  # the submodule's name on the transformer: its checkpoint key prefix
EXPORT_PREFIX = "preference."  # the key prefix of the exported file
PREFERENCE_WEIGHT_NAME = "preference_embedding.safetensors"
TOLERANCE = 1e-6  # how far from 1 the entries of a preference may sum
WHERE = ("timestep", "pooled")


class PreferenceEmbedding(nn.Module):
    """``w [B, K] -> [B, D]``, added to the output of the transformer submodule it is hooked on.

    ``rewards``: the K reward names, in the order of w's entries; ``dim``: D, the hooked embedding's width;
    ``hidden``: H; ``site``: the hooked submodule's path in the transformer; ``where``: timestep or pooled."""

    def __init__(self, rewards: Sequence[str], dim: int, *, hidden: int = 64, site: str = "", where: str = "timestep",
                 seed: int = 0):
        super().__init__()
        self.rewards, self.site, self.where = list(rewards), site, where
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hidden = nn.Linear(len(self.rewards), hidden)
            self.out = nn.Linear(hidden, dim)
        nn.init.zeros_(self.out.weight)  # zero output: w has no effect at the start
        nn.init.zeros_(self.out.bias)
        self.default = torch.full((len(self.rewards),), 1.0 / len(self.rewards))  # [K] without rows: the centre
        self.rows: torch.Tensor | None = None  # [B, K] the current batch's weights (set by conditioned())
        self.enabled = True  # False: the reference model
        self.handle = None  # the forward hook's handle

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """``[B, K] -> [B, D]`` in float32."""
        return self.out(nn.functional.silu(self.hidden(w.float())))

    def add_to(self, embedding: torch.Tensor) -> torch.Tensor:
        """``embedding [M, ..., D]`` plus the embedding of the current rows (repeated M / B times) or of ``default``."""
        if not self.enabled:
            return embedding
        w = (self.rows if self.rows is not None else self.default[None]).to(embedding.device)  # [B, K]
        m, b = embedding.shape[0], w.shape[0]
        if m % b:
            raise ValueError(f"the preference has {b} rows, the transformer's batch {m}: not a multiple")
        delta = self(w).repeat(m // b, 1)  # [M, D]
        if delta.shape[-1] != embedding.shape[-1]:
            raise ValueError(f"the preference embedding has width {delta.shape[-1]}, but {self.site} gives "
                             f"{embedding.shape[-1]}: it was made for another model")
        return embedding + delta.view(m, *[1] * (embedding.dim() - 2), -1).to(embedding.dtype)

    @contextlib.contextmanager
    def conditioned(self, rows: torch.Tensor | None) -> Iterator[None]:
        """The forwards in this block take ``rows`` ``[B, K]`` (None: ``default``)."""
        previous, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = previous

    def describe(self) -> dict[str, str]:
        """The safetensors metadata of an export: what :func:`load_preference` needs to rebuild it."""
        return {"flowrl.preference.rewards": json.dumps(self.rewards), "flowrl.preference.site": self.site,
                "flowrl.preference.where": self.where, "flowrl.preference.hidden": str(self.hidden.out_features),
                "flowrl.preference.dim": str(self.out.out_features)}


# --- installing it -----------------------------------------------------------------------------------
def transformer_of(target) -> nn.Module:
    """The transformer of a diffusers pipeline, a flowrl policy, or the transformer itself."""
    return getattr(target, "transformer", target)


def preference_of(target) -> PreferenceEmbedding | None:
    """The preference embedding installed on ``target``'s transformer, or None."""
    return getattr(transformer_of(target), PREFERENCE_ATTRIBUTE, None)


def embedding_width(module: nn.Module) -> int:
    """D of an embedding submodule: the output width of its last linear layer (diffusers' timestep, guidance and
    text projections all end in one)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(module).__name__} has no linear layer to take the preference embedding's width from")
    return linears[-1].out_features


def install(transformer: nn.Module, embedding: PreferenceEmbedding) -> PreferenceEmbedding:
    """Make ``embedding`` a submodule of ``transformer`` and hook it on ``embedding.site``; replaces an earlier one."""
    old = getattr(transformer, PREFERENCE_ATTRIBUTE, None)
    if old is not None and old.handle is not None:
        old.handle.remove()
    site = transformer.get_submodule(embedding.site)
    parameter = next(transformer.parameters())
    embedding.to(parameter.device)  # float32, as the LoRA weights
    transformer.add_module(PREFERENCE_ATTRIBUTE, embedding)
    embedding.handle = site.register_forward_hook(lambda _module, _args, output: embedding.add_to(output))
    return embedding


def attach_preference(policy, rewards: Sequence[str], *, hidden: int = 64, where: str = "timestep",
                      seed: int = 0) -> PreferenceEmbedding:
    """A fresh (zero-output) trainable preference embedding on ``policy``: hooked on the family's ``where`` site, its
    parameters trainable, the policy's ``velocity`` reading each batch's rows from ``cond.preference``."""
    sites = getattr(policy, "preference_sites", {})
    if where not in WHERE:
        raise ValueError(f"model.preference.where must be one of {', '.join(WHERE)}, got {where!r}")
    if where not in sites:
        raise ValueError(f"model.preference.where={where}: the {policy.family} family has no such embedding "
                         f"(it has {', '.join(sites) or 'none'}); use where: timestep")
    if len(rewards) < 2:
        raise ValueError(f"model.preference.rewards needs at least 2 rewards to trade off, got {list(rewards)}")
    site = sites[where]
    dim = embedding_width(policy.transformer.get_submodule(site))
    embedding = install(policy.transformer, PreferenceEmbedding(rewards, dim, hidden=hidden, site=site, where=where,
                                                                seed=seed))
    embedding.requires_grad_(True)
    wire_policy(policy, embedding)
    return embedding


def wire_policy(policy, embedding: PreferenceEmbedding) -> None:
    """``policy.velocity`` conditions each call on ``cond.preference`` (None: the default w); ``policy.preference``
    lets ``reference()`` switch it off."""
    if getattr(policy, "preference", None) is None:
        inner = policy.velocity

        def velocity(x, sigma, cond, guidance_scale, *args, **kwargs):
            module = policy.preference
            with module.conditioned(getattr(cond, "preference", None)):
                return inner(x, sigma, cond, guidance_scale, *args, **kwargs)

        policy.velocity = velocity
    policy.preference = embedding


# --- checkpoint keys -----------------------------------------------------------------------------------
def preference_state(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """``{flowrl_preference.<param>: copy}`` of the installed embedding (empty without one): the names of
    ``transformer.named_parameters()``, so the EMA and the checkpoint share them."""
    embedding = getattr(transformer, PREFERENCE_ATTRIBUTE, None)
    if embedding is None:
        return {}
    return {f"{PREFERENCE_ATTRIBUTE}.{k}": v.detach().clone() for k, v in embedding.state_dict().items()}


def split_preference(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An adapter state -> (its LoRA tensors, its preference tensors keyed without the prefix)."""
    prefix = f"{PREFERENCE_ATTRIBUTE}."
    lora = {k: v for k, v in state.items() if not k.startswith(prefix)}
    return lora, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@torch.no_grad()
def load_preference_state(transformer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (keys without the prefix) into the installed embedding; a one-line error without one."""
    embedding = getattr(transformer, PREFERENCE_ATTRIBUTE, None)
    if embedding is None:
        raise ValueError("this adapter carries a preference embedding, but the model has none: set model.preference "
                         "as in the run that trained it")
    own = embedding.state_dict()
    bad = [k for k in own if k not in tensors or tensors[k].shape != own[k].shape]
    if bad or set(tensors) - set(own):
        key = (bad or sorted(set(tensors) - set(own)))[0]
        raise ValueError(f"the preference embedding does not fit this model's (rewards, hidden size or width differ): "
                         f"{key!r}")
    for key, param in own.items():
        param.copy_(tensors[key].to(param.device, param.dtype))


# --- the exported file ------------------------------------------------------------------------------
def save_preference(out_dir: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write ``out_dir/preference_embedding.safetensors``: ``preference.<param>`` keys, ``metadata`` (from
    :meth:`PreferenceEmbedding.describe`) in the header."""
    from safetensors.torch import save_file

    file = Path(out_dir) / PREFERENCE_WEIGHT_NAME
    save_file({f"{EXPORT_PREFIX}{k}": v.detach().float().cpu().contiguous() for k, v in tensors.items()}, str(file),
              metadata={"format": "pt", **metadata})
    return file


def preference_file(path: str | Path) -> Path | None:
    """The preference file of an export (its directory, the LoRA file in it, or the file itself), or None."""
    path = Path(path)
    for candidate in (path, path / PREFERENCE_WEIGHT_NAME, path.parent / PREFERENCE_WEIGHT_NAME):
        if candidate.name == PREFERENCE_WEIGHT_NAME and candidate.is_file():
            return candidate
    return None


def read_preference_header(path: str | Path) -> dict[str, str]:
    """The header of an export's preference file (its rewards: ``json.loads(h["flowrl.preference.rewards"])``)."""
    from safetensors import safe_open

    file = preference_file(path)
    if file is None:
        raise FileNotFoundError(f"{path} carries no preference embedding ({PREFERENCE_WEIGHT_NAME}): it was not "
                                "trained with model.preference")
    with safe_open(str(file), framework="pt") as handle:
        return dict(handle.metadata() or {})


def read_preference(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An export's preference embedding: (tensors keyed without the prefix, header)."""
    from safetensors.torch import load_file

    header = read_preference_header(path)
    tensors = {k[len(EXPORT_PREFIX):]: v for k, v in load_file(str(preference_file(path))).items()
               if k.startswith(EXPORT_PREFIX)}
    return tensors, header


def checkpoint_preference(state: dict[str, torch.Tensor], family: str, preference: dict
                          ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """A checkpoint's preference embedding, as :func:`read_preference` gives an export's: its tensors out of the
    adapter ``state`` and a header rebuilt from the run's ``model.preference`` (``preference``) and ``family``;
    None where the state has none."""
    from flowrl.models.families import policy_class

    _, tensors = split_preference(state)
    if not tensors:
        return None
    where = preference.get("where", "timestep")
    width, hidden = tensors["out.weight"].shape  # [D, H]
    return tensors, {"flowrl.preference.rewards": json.dumps(list(preference.get("rewards") or [])),
                     "flowrl.preference.site": policy_class(family).preference_sites[where],
                     "flowrl.preference.where": where, "flowrl.preference.hidden": str(hidden),
                     "flowrl.preference.dim": str(width)}


def install_preference(target, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> PreferenceEmbedding:
    """Install a trained (frozen) preference embedding from its ``tensors`` and ``header`` into ``target``: a
    diffusers pipeline, its transformer, or a flowrl policy (whose ``velocity`` and ``reference()`` then know it)."""
    transformer = transformer_of(target)
    embedding = PreferenceEmbedding(json.loads(header["flowrl.preference.rewards"]), int(header["flowrl.preference.dim"]),
                                    hidden=int(header["flowrl.preference.hidden"]), site=header["flowrl.preference.site"],
                                    where=header.get("flowrl.preference.where", "timestep"))
    try:
        transformer.get_submodule(embedding.site)
    except AttributeError:
        raise ValueError(f"this model has no {embedding.site!r} to take the preference embedding (trained on another "
                         "model family?)") from None
    install(transformer, embedding)
    load_preference_state(transformer, tensors)
    embedding.requires_grad_(False)
    if hasattr(target, "preference_sites"):  # a flowrl policy
        wire_policy(target, embedding)
    return embedding


def remove_preference(target) -> None:
    """Take an installed preference embedding off ``target`` (nothing installed: nothing to do)."""
    transformer = transformer_of(target)
    embedding = getattr(transformer, PREFERENCE_ATTRIBUTE, None)
    if embedding is None:
        return
    if embedding.handle is not None:
        embedding.handle.remove()
    delattr(transformer, PREFERENCE_ATTRIBUTE)
    if hasattr(target, "preference_sites"):
        target.preference = None
        target.__dict__.pop("velocity", None)  # the class's own velocity again


def load_preference(target, path: str | Path) -> PreferenceEmbedding:
    """Install the exported preference embedding at ``path`` (an export directory or its
    ``preference_embedding.safetensors``) into ``target``: a plain diffusers pipeline, its transformer, or a flowrl
    policy. Load the LoRA as usual (``pipe.load_lora_weights(DIR)``), then this, then :func:`set_preference`."""
    tensors, header = read_preference(path)
    return install_preference(target, tensors, header)


# --- the slider --------------------------------------------------------------------------------------
def parse_preference(text: str) -> list[float]:
    """``"0.3,0.7"`` -> [0.3, 0.7]; a one-line error for anything else."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--preference {text!r}: give comma-separated numbers, e.g. 0.3,0.7") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"--preference {text!r}: every entry must be a finite number")
    return values


def check_preference(values: Sequence[float], rewards: Sequence[str] | None = None) -> torch.Tensor:
    """``values`` as a ``[K]`` float32 tensor on the simplex, or a one-line ValueError: a wrong length (when
    ``rewards`` is given), a negative entry, or a sum off 1 by more than ``TOLERANCE`` (refused, not normalised)."""
    values = [float(v) for v in values]
    if rewards is not None and len(values) != len(rewards):
        raise ValueError(f"the preference has {len(values)} entries, but the model was trained on {len(rewards)} "
                         f"rewards ({', '.join(rewards)}): give one weight per reward, in that order")
    negative = [v for v in values if v < 0]
    if negative:
        raise ValueError(f"the preference has a negative entry ({negative[0]:g}): weights must be >= 0")
    total = math.fsum(values)
    if abs(total - 1.0) > TOLERANCE:
        raise ValueError(f"the preference's entries sum to {total:.6g}, not 1: give a point of the simplex "
                         f"(within {TOLERANCE:g}; it is not normalised for you)")
    return torch.tensor(values, dtype=torch.float32)


def set_preference(target, values: Sequence[float]) -> torch.Tensor:
    """Move the slider: every later forward of ``target`` (pipeline, transformer or policy) without per-row
    weights is conditioned on ``values`` (checked with :func:`check_preference`); returns it as a tensor."""
    embedding = preference_of(target)
    if embedding is None:
        raise ValueError("this model has no preference embedding: it was not trained with model.preference "
                         "(or load_preference was not called)")
    w = check_preference(values, embedding.rewards)
    embedding.default = w
    return w


__all__ = ["PREFERENCE_WEIGHT_NAME", "PreferenceEmbedding", "attach_preference", "check_preference",
           "install_preference", "load_preference", "parse_preference", "preference_of", "remove_preference",
           "set_preference"]
