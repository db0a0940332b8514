"""ParetoSlider's preference conditioning: one model for the whole trade-off between several rewards.

ParetoSlider (see ``../shared/PAPERS.md``) trains a single policy on continuously varying preference weights w
(a point of the simplex, one entry per reward) given to the model as a conditioning signal, so that the user
moves along the Pareto front at inference time. The authors' code (github.com/Shelley-Golan/ParetoSlider at
e56e5024a3e996944119ef7cb910d314900b3fc1, ``T2I/flow_grpo/diffusers_patch/transformer_sd3.py``, an SD3
transformer subclass) conditions in two places, and flowrl does both, by forward hooks instead of a subclass:

- **The timestep embedding** (the reference's ``pref_mlp``, lines 295-302 and 377-378). A 2-layer MLP
  ``w [B, K] -> SiLU(W1 w + b1) [B, H] -> W2 . + b2 [B, D]`` added to the output of the transformer's timestep
  embedding (``where: timestep``, every family has one: the vector that modulates every block's norms) or to that
  of the pooled text projection (``where: pooled``; SD3 and FLUX.1 sum it into the same vector).
- **The block modulation** (``model.preference.blocks``; the reference's ``SliderProjector`` and
  ``ImageOnlyModulationBlock`` with ``block_mod_form: residual``, its default and its configs', lines 20-59,
  66-204 and 304-323). One vector ``m = P(w) [B, D]`` shared by every transformer block: sinusoidal features
  ``(sin(pi w_k), cos(pi w_k))`` (one frequency, ``num_freqs: 1``) -> a linear layer to 768 -> three linear
  layers of width D with ReLU -> a linear layer to D. Each block adds it to its image stream after its
  feed-forward residual, gated by the block's own MLP gate: ``h <- h + gate_mlp[:, None, :] * m[:, None, :]``
  (line 178); the text stream is untouched. Every block (``mod_block_fraction: 1``). A hook on the block's
  ``norm1`` takes ``gate_mlp`` (its fifth output, in both AdaLayerNormZero and SD3.5's dual-attention variant)
  and a hook on the block adds the term to its image output (the block's last operation on it, so adding after
  the block is adding inside it). The m of a forward rides on the timestep embedding's output tensor that the
  blocks receive, so gradient checkpointing's recomputation of a block in the backward pass finds the m of that
  forward. Families with ``preference_sites["blocks"]``: sd3, flux, flux_kontext (FLUX.1's double-stream blocks;
  its single-stream blocks, one gate over text and image tokens together, are not modulated); the others refuse
  ``blocks`` in one line.

What still differs from the reference, and why:

- **Initialisation.** flowrl zero-initialises both output layers, so a freshly conditioned policy is exactly the
  unconditioned one (ControlNet's zero convolution, for the same reason: training starts from the base model, and
  w gains an effect only as it learns one). The reference draws its ``pref_mlp`` output from N(0, 1e-3) (near
  zero) but leaves the projector's last layer at PyTorch's default init, so its conditioned model starts off
  the base model's outputs. The first layers are drawn from the run's seed under a forked RNG, so attaching the
  embedding changes no other random draw of the run.
- **Sizes.** The timestep MLP's hidden width is ``model.preference.hidden`` (64); the reference's is the model
  width D. The projector's widths are the reference's (768, then D).
- **Pooled text.** The reference can feed the pooled text embedding into the projector (``use_pooled_text``);
  its configs leave it off, and flowrl does not offer it.

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


MODULATION = "_flowrl_preference_modulation"  # the attribute of the temb tensor that carries a forward's m [M, D]
PROJECTOR_WIDTH = 768  # the reference's pe_extender_dim


class BlockModulation(nn.Module):
    """``w [B, K] -> m [B, D]``: the shared residual modulation of every block's image stream (the reference's
    ``SliderProjector`` with one frequency and no pooled text). Its last layer starts at zero."""

    def __init__(self, num_rewards: int, dim: int):
        super().__init__()
        self.features = nn.Linear(2 * num_rewards, PROJECTOR_WIDTH)  # (sin, cos) of pi w_k -> 768, no activation
        self.layers = nn.Sequential(nn.Linear(PROJECTOR_WIDTH, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(),
                                    nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        nn.init.zeros_(self.layers[-1].weight)  # zero output: the blocks are unchanged at the start
        nn.init.zeros_(self.layers[-1].bias)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """``[B, K] -> [B, D]`` in float32."""
        angles = w.float() * math.pi  # [B, K]
        return self.layers(self.features(torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)))


class PreferenceEmbedding(nn.Module):
    """``w [B, K] -> [B, D]``, added to the output of the transformer submodule it is hooked on, and with
    ``blocks`` the :class:`BlockModulation` of every block's image stream.

    ``rewards``: the K reward names, in the order of w's entries; ``dim``: D, the hooked embedding's width;
    ``hidden``: H; ``site``: the hooked submodule's path in the transformer; ``where``: timestep or pooled;
    ``blocks``: the path of the modulated blocks' list ("" for none); ``temb``: the path of the embedding whose
    output the blocks take as their temb (the family's timestep site)."""

    def __init__(self, rewards: Sequence[str], dim: int, *, hidden: int = 64, site: str = "", where: str = "timestep",
                 seed: int = 0, blocks: str = "", temb: str = ""):
        super().__init__()
        self.rewards, self.site, self.where = list(rewards), site, where
        self.blocks_site, self.temb_site = blocks, temb
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hidden = nn.Linear(len(self.rewards), hidden)
            self.out = nn.Linear(hidden, dim)
            self.blocks = BlockModulation(len(self.rewards), dim) if blocks else None  # drawn after: hidden unchanged
        nn.init.zeros_(self.out.weight)  # zero output: w has no effect at the start
        nn.init.zeros_(self.out.bias)
        self.default = torch.full((len(self.rewards),), 1.0 / len(self.rewards))  # [K] without rows: the centre
        self.rows: torch.Tensor | None = None  # [B, K] the current batch's weights (set by conditioned())
        self.enabled = True  # False: the reference model
        self.handles: list = []  # the forward hooks' handles
        self.pending: dict[int, torch.Tensor | None] = {}  # block index -> its gated term, from norm1 to the block

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """``[B, K] -> [B, D]`` in float32."""
        return self.out(nn.functional.silu(self.hidden(w.float())))

    def batch_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """``[M, K]``: the current rows (or ``default``) repeated to the M rows of ``batch`` ``[M, ...]``."""
        w = (self.rows if self.rows is not None else self.default[None]).to(batch.device)  # [B, K]
        m, b = batch.shape[0], w.shape[0]
        if m % b:
            raise ValueError(f"the preference has {b} rows, the transformer's batch {m}: not a multiple")
        return w.repeat(m // b, 1)

    def add_to(self, embedding: torch.Tensor) -> torch.Tensor:
        """``embedding [M, ..., D]`` plus the embedding of the current rows (repeated M / B times) or of ``default``."""
        if not self.enabled:
            return embedding
        m = embedding.shape[0]
        delta = self(self.batch_rows(embedding))  # [M, D]
        if delta.shape[-1] != embedding.shape[-1]:
            raise ValueError(f"the preference embedding has width {delta.shape[-1]}, but {self.site} gives "
                             f"{embedding.shape[-1]}: it was made for another model")
        return embedding + delta.view(m, *[1] * (embedding.dim() - 2), -1).to(embedding.dtype)

    def carry_modulation(self, temb: torch.Tensor) -> torch.Tensor:
        """The blocks' ``temb`` [M, D], carrying this forward's m [M, D] (nothing when switched off)."""
        if self.enabled and self.blocks is not None:
            temb = temb.view_as(temb)  # a tensor of this forward's own, for the attribute
            setattr(temb, MODULATION, self.blocks(self.batch_rows(temb)))
        return temb

    def gate_block(self, index: int, kwargs: dict, args: tuple, outputs: tuple) -> None:
        """Block ``index``'s norm1 hook: keep ``gate_mlp [M, D] * m`` for the block's image output."""
        temb = kwargs.get("emb", args[1] if len(args) > 1 else None)
        modulation = getattr(temb, MODULATION, None)  # [M, D]
        self.pending[index] = None if modulation is None else outputs[4][:, None, :] * modulation[:, None, :].to(
            outputs[4].dtype)  # [M, 1, D]

    def modulate_block(self, index: int, outputs):
        """Block ``index``'s hook: its (text, image) outputs with the gated term added to the image stream."""
        term = self.pending.pop(index, None)
        if term is None:
            return outputs
        return (*outputs[:-1], outputs[-1] + term)

    def detach_hooks(self) -> None:
        """Remove every hook this embedding installed."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

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
                "flowrl.preference.dim": str(self.out.out_features), "flowrl.preference.blocks": self.blocks_site,
                "flowrl.preference.temb": self.temb_site}


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
    if old is not None:
        old.detach_hooks()
    site = transformer.get_submodule(embedding.site)
    parameter = next(transformer.parameters())
    embedding.to(parameter.device)  # float32, as the LoRA weights
    transformer.add_module(PREFERENCE_ATTRIBUTE, embedding)
    embedding.handles = [site.register_forward_hook(lambda _module, _args, output: embedding.add_to(output))]
    if embedding.blocks is not None:  # after the embedding's own hook: m rides on the final temb
        embedding.handles.append(transformer.get_submodule(embedding.temb_site).register_forward_hook(
            lambda _module, _args, output: embedding.carry_modulation(output)))
        for index, block in enumerate(transformer.get_submodule(embedding.blocks_site)):
            embedding.handles += [
                block.norm1.register_forward_hook(
                    lambda _m, args, kwargs, out, i=index: embedding.gate_block(i, kwargs, args, out), with_kwargs=True),
                block.register_forward_hook(lambda _m, _args, out, i=index: embedding.modulate_block(i, out))]
    return embedding


def attach_preference(policy, rewards: Sequence[str], *, hidden: int = 64, where: str = "timestep",
                      seed: int = 0, blocks: bool = True) -> PreferenceEmbedding:
    """A fresh (zero-output) trainable preference embedding on ``policy``: hooked on the family's ``where`` site (and
    with ``blocks`` on its blocks), its parameters trainable, the policy's ``velocity`` reading each batch's rows
    from ``cond.preference``."""
    sites = getattr(policy, "preference_sites", {})
    if where not in WHERE:
        raise ValueError(f"model.preference.where must be one of {', '.join(WHERE)}, got {where!r}")
    if not sites:
        raise ValueError(f"model.preference: the {policy.family} family takes no preference embedding yet (ParetoSlider "
                         "runs on every other family); remove model.preference")
    if where not in sites:
        raise ValueError(f"model.preference.where={where}: the {policy.family} family has no such embedding "
                         f"(it has {', '.join(w for w in WHERE if w in sites) or 'none'}); use where: timestep")
    if blocks and "blocks" not in sites:
        raise ValueError(f"model.preference.blocks: the {policy.family} family's blocks take no preference modulation "
                         "(sd3, flux and flux_kontext do); set model.preference.blocks=false")
    if len(rewards) < 2:
        raise ValueError(f"model.preference.rewards needs at least 2 rewards to trade off, got {list(rewards)}")
    site = sites[where]
    dim = embedding_width(policy.transformer.get_submodule(site))
    embedding = install(policy.transformer, PreferenceEmbedding(
        rewards, dim, hidden=hidden, site=site, where=where, seed=seed, blocks=sites["blocks"] if blocks else "",
        temb=sites["timestep"] if blocks else ""))
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
    where, sites = preference.get("where", "timestep"), policy_class(family).preference_sites
    width, hidden = tensors["out.weight"].shape  # [D, H]
    blocks = any(k.startswith("blocks.") for k in tensors)  # adapters trained before the block modulation have none
    return tensors, {"flowrl.preference.rewards": json.dumps(list(preference.get("rewards") or [])),
                     "flowrl.preference.site": sites[where], "flowrl.preference.where": where,
                     "flowrl.preference.hidden": str(hidden), "flowrl.preference.dim": str(width),
                     "flowrl.preference.blocks": sites.get("blocks", "") if blocks else "",
                     "flowrl.preference.temb": sites["timestep"] if blocks else ""}


def install_preference(target, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> PreferenceEmbedding:
    """Install a trained (frozen) preference embedding from its ``tensors`` and ``header`` into ``target``: a
    diffusers pipeline, its transformer, or a flowrl policy (whose ``velocity`` and ``reference()`` then know it)."""
    transformer = transformer_of(target)
    embedding = PreferenceEmbedding(json.loads(header["flowrl.preference.rewards"]), int(header["flowrl.preference.dim"]),
                                    hidden=int(header["flowrl.preference.hidden"]), site=header["flowrl.preference.site"],
                                    where=header.get("flowrl.preference.where", "timestep"),
                                    blocks=header.get("flowrl.preference.blocks", ""),
                                    temb=header.get("flowrl.preference.temb", ""))
    try:
        for path in (embedding.site, embedding.blocks_site, embedding.temb_site):
            if path:
                transformer.get_submodule(path)
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
    embedding.detach_hooks()
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
