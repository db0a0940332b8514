"""LoRA weights in and out: one diffusers-key file every loader reads at the trained scale, a kohya file, peft dirs.

Loaders disagree on the LoRA scale. diffusers/peft read ``lora_alpha`` from the safetensors metadata; ComfyUI
ignores metadata and uses ``alpha / rank`` only where a ``<module>.alpha`` tensor exists, else 1.0; kohya
sd-scripts treat a missing alpha as ``alpha = rank``, i.e. 1.0 too. ``.alpha`` tensors break diffusers' SD3 loader,
and a file without them loses ``alpha / r`` (2.0 in every shipped config) in ComfyUI. So every export **folds the
scale into lora_B** (``B' = B * alpha / r``) and stores ``lora_alpha = r``: each loader then applies
``B' A = (alpha / r) B A``, the trained update, whatever its scale rule.

- ``pytorch_lora_weights.safetensors``: peft keys ``transformer.<diffusers module>.lora_A/lora_B.weight``, no
  ``.alpha`` tensors. diffusers ``load_lora_weights``, ComfyUI (its ``transformer.`` key map for SD3 and Flux) and
  flowrl (``lora.init_from``, ``sample --lora``, eval) load it.
- ``pytorch_lora_weights_kohya.safetensors``: ``lora_unet_<native module>`` keys (MMDiT / BFL Flux / Wan names), with
  ``lora_down``/``lora_up``/``alpha`` (= rank: scale 1). The native model fuses q/k/v (and FLUX's single-block
  MLP input) into one linear; their LoRAs are fused exactly into one of rank ``sum r``: ``down = [Aq; Ak; Av]``,
  ``up = block-diag(Bq, Bk, Bv)`` placed at each piece's rows. For kohya sd-scripts-style loaders.
- flowrl reads a folded file back **unfolded** (``B = B' r / alpha``, adapter alpha = trained alpha), so an
  adapter loaded from an export is the trained one: same outputs, and continued training keeps its LR scale.
- The metadata records the base model, rank, alpha (trained, stored), targets, flowrl version, config hash.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flowrl.core.safe_io import shared_mode
from flowrl.models.wan_experts import EXPERTS

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
COMFYUI_WEIGHT_NAME = "pytorch_lora_weights_comfyui.safetensors"
KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"
TRANSFORMER_2_WEIGHT_NAME = "pytorch_lora_weights_transformer_2.safetensors"
EXPERT_WEIGHT_NAMES = {"transformer": DIFFUSERS_WEIGHT_NAME, "transformer_2": TRANSFORMER_2_WEIGHT_NAME}
"""A two-expert model's diffusers files (Wan2.2 A14B): one per pipeline component, each with ``transformer.*`` keys,
as ``WanPipeline.load_lora_weights`` takes them (the second with ``load_into_transformer_2=True``)."""


def expert_states(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]] | None:
    """A two-expert adapter state (keys ``transformer.*`` and ``transformer_2.*``, the submodules of
    :class:`~flowrl.models.wan_experts.WanExperts`) split per component, keys relative to its transformer; None for
    one transformer's state (whose keys start with its own modules: ``blocks.``, ``transformer_blocks.``, ...)."""
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        component, _, rest = key.partition(".")
        if component not in EXPERT_WEIGHT_NAMES:
            return None
        experts.setdefault(component, {})[rest] = value
    return experts or None


def lora_state_dict(transformer, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """A copy of the adapter's tensors, keys relative to the transformer (``blocks.0.attn.to_q.lora_A.weight``),
    and of a ParetoSlider preference embedding where one is attached (``flowrl_preference.*``, trained with it;
    :func:`load_adapter_state` puts both back, :func:`write_lora_files` writes it to its own file).

    Always a copy: float32 CPU parameters would otherwise be returned as themselves, and a caller that
    reads the state inside ``ema_weights(...)`` would see it revert to the raw weights on leaving.
    Under FSDP2 the sharded (DTensor) weights are gathered whole: every process must call this (``keep=False``:
    a process that writes nothing takes part and gets ``{}``)."""
    from peft.utils import get_peft_model_state_dict

    from flowrl.core.sharded import full_state

    from flowrl.models.preference import preference_state

    return full_state({**get_peft_model_state_dict(transformer), **preference_state(transformer)}, keep=keep)


def load_adapter_state(transformer, state: dict[str, torch.Tensor]) -> None:
    """Put a :func:`lora_state_dict` back: the LoRA tensors through peft, the preference embedding's into it."""
    from peft.utils import set_peft_model_state_dict

    from flowrl.models.preference import load_preference_state, split_preference

    lora, preference = split_preference(state)
    set_peft_model_state_dict(transformer, lora)
    if preference:
        load_preference_state(transformer, preference)


def lora_config_dict(transformer) -> dict:
    """JSON-safe peft config of the active adapter (rank, alpha, target modules, ...)."""
    config = transformer.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


# --- metadata ------------------------------------------------------------------------------------
def flowrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flowrl")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown"


def export_metadata(config: dict, *, family: str, base_model: str | None, config_text: str | None) -> dict[str, str]:
    """The ``flowrl.*`` safetensors header of an export: what it was trained on and how its scale is stored."""
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    return {
        "flowrl.base_model": f"{family}:{base_model or 'unknown'}",
        "flowrl.model_family": family,
        "flowrl.model_path": base_model or "unknown",
        "flowrl.rank": str(rank),
        "flowrl.alpha_trained": _num(alpha),
        "flowrl.alpha_stored": str(rank),
        "flowrl.scale_trained": _num(alpha / rank),
        "flowrl.scale_folded": "true",  # lora_B holds B * alpha / r; every loader applies scale 1
        "flowrl.target_modules": json.dumps(sorted(config.get("target_modules") or [])),
        "flowrl.version": flowrl_version(),
        "flowrl.config_sha256": hashlib.sha256(config_text.encode()).hexdigest()[:16] if config_text else "unknown",
        "base_model_name_or_path": base_model or "",
    }


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def fold_scale(state: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """``(B * alpha / r, A)`` and the config with ``lora_alpha = r``: the same update at scale 1 in any loader."""
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("LoRAs with per-module rank_pattern / alpha_pattern cannot be exported; use one rank and alpha")
    scale = float(config["lora_alpha"]) / int(config["r"])
    folded = {k: v * scale if ".lora_B." in k else v for k, v in state.items()}
    return folded, {**config, "lora_alpha": int(config["r"])}


# --- writers -------------------------------------------------------------------------------------
def save_diffusers_lora(pipeline_class, out_dir: str | Path, state: dict[str, torch.Tensor], config: dict, *,
                        metadata: dict[str, str] | None = None, weight_name: str = DIFFUSERS_WEIGHT_NAME) -> Path:
    """Write ``out_dir/<weight_name>``: peft keys, scale folded, the header diffusers' ``load_lora_weights`` reads.

    Written directly (not by ``pipeline_class.save_lora_weights``, which keeps no extra header) so the ``flowrl.*``
    metadata rides along; ``pipeline_class`` names the family when ``metadata`` is not given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if metadata is None:
        from flowrl.models.families import PIPELINE_FAMILIES

        family = PIPELINE_FAMILIES.get(getattr(pipeline_class, "__name__", ""), "unknown")
        metadata = export_metadata(config, family=family, base_model=None, config_text=None)
    folded, stored = fold_scale(state, config)
    stored["base_model_name_or_path"] = metadata.get("base_model_name_or_path") or None
    header = {"format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in stored.items()},
                                                                  sort_keys=True), **metadata}
    file = out_dir / weight_name
    save_file({f"transformer.{k}": v.contiguous() for k, v in folded.items()}, str(file), metadata=header)
    return file


def save_kohya_lora(out_file: str | Path, state: dict[str, torch.Tensor], config: dict, *, family: str,
                    metadata: dict[str, str]) -> Path:
    """``lora_unet_<native module>`` keys with ``lora_down``/``lora_up``/``alpha`` (= rank), scale folded."""
    folded, _ = fold_scale(state, config)
    tensors = {}
    for native, pieces in native_lora_modules(folded, family).items():
        down, up = fuse_pieces(pieces)
        name = "lora_unet_" + native.replace(".", "_")
        tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                        f"{name}.alpha": torch.tensor(float(down.shape[0]))})
    header = {**metadata, "ss_network_module": f"networks.lora_{family}", "ss_network_dim": str(config["r"]),
              "ss_network_alpha": str(config["r"]), "ss_base_model_version": {"sd3": "sd3", "wan": "wan2.1"}.get(family, "flux1")}
    save_file(tensors, str(out_file), metadata=header)
    return Path(out_file)


# --- native (MMDiT / BFL Flux) module names, as ComfyUI and sd-scripts name them --------------------------------
# (diffusers module regex, native module, slot in the fused linear or None). Slot sizes: q/k/v = hidden, mlp = 4x.
_BLOCK = r"^transformer_blocks\.(\d+)\."
NATIVE_NAMES = {
    "sd3": [
        (_BLOCK + r"attn\.to_([qkv])$", r"joint_blocks.\1.x_block.attn.qkv", "qkv"),
        (_BLOCK + r"attn\.add_([qkv])_proj$", r"joint_blocks.\1.context_block.attn.qkv", "qkv"),
        (_BLOCK + r"attn\.to_out\.0$", r"joint_blocks.\1.x_block.attn.proj", None),
        (_BLOCK + r"attn\.to_add_out$", r"joint_blocks.\1.context_block.attn.proj", None),
        (_BLOCK + r"ff\.net\.0\.proj$", r"joint_blocks.\1.x_block.mlp.fc1", None),
        (_BLOCK + r"ff\.net\.2$", r"joint_blocks.\1.x_block.mlp.fc2", None),
        (_BLOCK + r"ff_context\.net\.0\.proj$", r"joint_blocks.\1.context_block.mlp.fc1", None),
        (_BLOCK + r"ff_context\.net\.2$", r"joint_blocks.\1.context_block.mlp.fc2", None),
        (r"^context_embedder$", "context_embedder", None),
        (r"^proj_out$", "final_layer.linear", None),
    ],
    "flux": [
        (_BLOCK + r"attn\.to_([qkv])$", r"double_blocks.\1.img_attn.qkv", "qkv"),
        (_BLOCK + r"attn\.add_([qkv])_proj$", r"double_blocks.\1.txt_attn.qkv", "qkv"),
        (_BLOCK + r"attn\.to_out\.0$", r"double_blocks.\1.img_attn.proj", None),
        (_BLOCK + r"attn\.to_add_out$", r"double_blocks.\1.txt_attn.proj", None),
        (_BLOCK + r"ff\.net\.0\.proj$", r"double_blocks.\1.img_mlp.0", None),
        (_BLOCK + r"ff\.net\.2$", r"double_blocks.\1.img_mlp.2", None),
        (_BLOCK + r"ff_context\.net\.0\.proj$", r"double_blocks.\1.txt_mlp.0", None),
        (_BLOCK + r"ff_context\.net\.2$", r"double_blocks.\1.txt_mlp.2", None),
        (_BLOCK + r"norm1\.linear$", r"double_blocks.\1.img_mod.lin", None),
        (_BLOCK + r"norm1_context\.linear$", r"double_blocks.\1.txt_mod.lin", None),
        (r"^single_transformer_blocks\.(\d+)\.attn\.to_([qkv])$", r"single_blocks.\1.linear1", "qkvm"),
        (r"^single_transformer_blocks\.(\d+)\.proj_(mlp)$", r"single_blocks.\1.linear1", "qkvm"),
        (r"^single_transformer_blocks\.(\d+)\.proj_out$", r"single_blocks.\1.linear2", None),
        (r"^single_transformer_blocks\.(\d+)\.norm\.linear$", r"single_blocks.\1.modulation.lin", None),
        (r"^x_embedder$", "img_in", None),
        (r"^context_embedder$", "txt_in", None),
        (r"^proj_out$", "final_layer.linear", None),
    ],
}
NATIVE_NAMES["flux_kontext"] = NATIVE_NAMES["flux"]  # the same FluxTransformer2DModel
# Wan2.1's original module names (the ones ComfyUI's native Wan model keeps): separate q/k/v/o linears, so no slots.
_WAN_BLOCK = r"^blocks\.(\d+)\."
NATIVE_NAMES["wan"] = [
    (_WAN_BLOCK + r"attn1\.to_([qkv])$", r"blocks.\1.self_attn.\2", None),
    (_WAN_BLOCK + r"attn1\.to_out\.0$", r"blocks.\1.self_attn.o", None),
    (_WAN_BLOCK + r"attn2\.to_([qkv])$", r"blocks.\1.cross_attn.\2", None),
    (_WAN_BLOCK + r"attn2\.to_out\.0$", r"blocks.\1.cross_attn.o", None),
    (_WAN_BLOCK + r"ffn\.net\.0\.proj$", r"blocks.\1.ffn.0", None),
    (_WAN_BLOCK + r"ffn\.net\.2$", r"blocks.\1.ffn.2", None),
    (r"^proj_out$", "head.head", None),
]
SLOTS = {"qkv": ("q", "k", "v"), "qkvm": ("q", "k", "v", "mlp")}


def native_name(module: str, family: str) -> tuple[str, str | None, str | None]:
    """diffusers module -> (native module, slot layout, slot); ValueError for a module with no native LoRA name."""
    if family not in NATIVE_NAMES:
        raise ValueError(f"flowrl knows no native (kohya) module names for the {family} family; "
                         "export it with --format diffusers")
    for pattern, native, layout in NATIVE_NAMES[family]:
        match = re.search(pattern, module)
        if match:
            slot = match.groups()[-1] if layout else None
            return match.expand(native), layout, slot
    raise ValueError(f"LoRA module {module!r} has no native {family} name; export it with --format diffusers")


def native_lora_modules(state: dict[str, torch.Tensor], family: str) -> dict[str, dict]:
    """{native module: {"layout", "pieces": {slot or None: (A, B)}}} from a state with plain peft keys."""
    modules: dict[str, dict] = {}
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        module = key[: -len(".lora_A.weight")]
        native, layout, slot = native_name(module, family)
        entry = modules.setdefault(native, {"layout": layout, "pieces": {}})
        entry["pieces"][slot] = (state[key], state[f"{module}.lora_B.weight"])
    return modules


def fuse_pieces(entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) of one native linear: the pieces' A stacked, their B placed at the pieces' output rows.

    Exact: ``up @ down`` restricted to a piece's rows is that piece's ``B A``; rows of absent pieces are zero."""
    pieces, layout = entry["pieces"], entry["layout"]
    if layout is None:
        (a, b), = pieces.values()
        return a.contiguous(), b.contiguous()
    hidden = next(b.shape[0] // (4 if slot == "mlp" else 1) for slot, (_, b) in pieces.items())
    sizes = {slot: 4 * hidden if slot == "mlp" else hidden for slot in SLOTS[layout]}
    offsets, row = {}, 0
    for slot in SLOTS[layout]:
        offsets[slot], row = row, row + sizes[slot]
    present = [s for s in SLOTS[layout] if s in pieces]
    down = torch.cat([pieces[s][0] for s in present], dim=0)
    up = torch.zeros(row, down.shape[0], dtype=down.dtype)
    col = 0
    for slot in present:
        b = pieces[slot][1]
        up[offsets[slot]: offsets[slot] + b.shape[0], col: col + b.shape[1]] = b
        col += b.shape[1]
    return down.contiguous(), up


# --- readers -------------------------------------------------------------------------------------
def read_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read any supported LoRA -> (state relative to the transformer, {"r", "lora_alpha", "target_modules"}).

    A flowrl export (``flowrl.scale_folded``) comes back unfolded: the trained B and alpha, the same adapter."""
    path = Path(path)
    if path.is_dir():
        if (path / DIFFUSERS_WEIGHT_NAME).is_file():
            return read_lora(path / DIFFUSERS_WEIGHT_NAME)
        if (path / TRANSFORMER_2_WEIGHT_NAME).is_file():  # a two-expert export of the low-noise expert alone
            return read_lora(path / TRANSFORMER_2_WEIGHT_NAME)
        if (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
            config = json.loads((path / "adapter_config.json").read_text())
            raw = load_file(str(path / "adapter_model.safetensors"))
            state = {k.removeprefix("base_model.model."): v for k, v in raw.items()}
            return _plain_keys(state), config
        raise FileNotFoundError(f"no LoRA in {path}: expected {DIFFUSERS_WEIGHT_NAME} or a peft adapter directory")
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    if path.suffix != ".safetensors":
        raise ValueError(f"unsupported LoRA file {path}: use .safetensors")
    from flowrl.core.safe_io import check_safetensors

    check_safetensors(path, "LoRA file")
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    raw = load_file(str(path))
    if any(k.startswith("lora_unet_") for k in raw):
        raise ValueError(f"{path} is a kohya-format LoRA (lora_unet_ keys); give flowrl the {DIFFUSERS_WEIGHT_NAME} "
                         "file of the same export")
    alphas = {k[: -len(".alpha")]: float(v) for k, v in raw.items() if k.endswith(".alpha")}
    state = _plain_keys({k.removeprefix("transformer."): v for k, v in raw.items() if not k.endswith(".alpha")})
    flat = json.loads(header.get("lora_adapter_metadata") or "{}")  # diffusers: {"transformer.r": 32, ...}
    config = {k.removeprefix("transformer."): v for k, v in flat.items() if k.startswith("transformer.")}
    rank = next(v.shape[0] for k, v in state.items() if k.endswith("lora_A.weight"))
    config.setdefault("r", rank)
    config.setdefault("lora_alpha", next(iter(alphas.values()), float(rank)))
    config.setdefault("target_modules", sorted({k.rsplit(".lora_", 1)[0] for k in state}))
    if header.get("flowrl.scale_folded") == "true":
        alpha = float(header["flowrl.alpha_trained"])
        unfold = int(config["r"]) / alpha
        state = {k: v * unfold if ".lora_B." in k else v for k, v in state.items()}
        config["lora_alpha"] = alpha
    expert = header.get("flowrl.expert")  # one file of a two-expert export: keys under its component again
    if expert:
        state = {f"{expert}.{k}": v for k, v in state.items()}
        sibling = path.with_name(TRANSFORMER_2_WEIGHT_NAME)
        if expert == "transformer" and sibling.is_file():  # the export is both files
            state.update(read_lora(sibling)[0])
    return state, config


def _plain_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop peft's adapter-name infix (``lora_A.default.weight`` -> ``lora_A.weight``)."""
    return {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in state.items()}


def load_lora_into(policy, path: str | Path) -> None:
    """Load a LoRA into ``policy``; attaches an adapter shaped like the file's if none is attached.

    A flowrl export is read unfolded (see ``read_lora``): the adapter gets the trained alpha and B, so
    ``lora.init_from`` and ``sample --lora`` of an export reproduce the trained adapter's outputs."""
    from peft.utils import set_peft_model_state_dict

    state, config = read_lora(path)
    if not policy.has_lora:
        experts = expert_states(state)  # a two-expert LoRA: the adapter goes on the experts it holds
        chosen = {"experts": [n for n, c in EXPERTS.items() if c in experts]} if experts else {}
        policy.add_lora(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                        target_modules=list(config["target_modules"]), **chosen)
    try:
        result = set_peft_model_state_dict(policy.transformer, state)
    except RuntimeError as error:  # torch's "size mismatch for ...": a LoRA trained on another model
        detail = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), str(error))
        raise ValueError(f"LoRA {path} does not fit this model (trained on another one?): {detail}") from None
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"LoRA {path} does not fit this model: unexpected key {unexpected[0]!r}")
    for param in policy.trainable_parameters():
        param.data = param.data.float()


# --- one export directory: a file per target and a README that says which is which -----------------------
FORMATS = ("all", "diffusers", "comfyui", "kohya")
README = """# LoRA exported by flowrl {version}

Base model: {family} `{path}` (config sha256 {config_hash}). Rank {rank}, trained alpha {alpha} (scale {scale}).
The scale is folded into lora_B (B' = B * alpha / r, stored alpha = rank), so every loader below applies the
trained update at its default strength 1.0.

| file | load it with |
| --- | --- |
{rows}
"""
ROWS = {
    DIFFUSERS_WEIGHT_NAME: "diffusers `pipe.load_lora_weights(DIR)`; ComfyUI (LoraLoader, `transformer.` keys); "
                           "flowrl `lora.init_from` / `sample --lora` / eval",
    COMFYUI_WEIGHT_NAME: f"the same tensors as {DIFFUSERS_WEIGHT_NAME} (ComfyUI, diffusers with weight_name=...)",
    "preference_embedding.safetensors": "ParetoSlider's preference embedding (keys `preference.*`, its rewards in "
                                        "the metadata): `flowrl.models.preference.load_preference(pipe, DIR)`, then "
                                        "`set_preference(pipe, w)`",
    TRANSFORMER_2_WEIGHT_NAME: "the low-noise expert of a two-expert model: diffusers `pipe.load_lora_weights(DIR, "
                               f"weight_name=\"{TRANSFORMER_2_WEIGHT_NAME}\", load_into_transformer_2=True)`",
    KOHYA_WEIGHT_NAME: "kohya sd-scripts-style loaders (Forge, A1111-style UIs) and ComfyUI (native `lora_unet_` "
                       f"names, q/k/v fused); not for diffusers: use {DIFFUSERS_WEIGHT_NAME} there",
}


def write_lora_files(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict, *, family: str,
                     base_model: str | None, config_text: str | None, format: str = "all",
                     force: bool = False, preference: dict[str, str] | None = None) -> list[Path]:
    """Write the ``format`` files of one adapter to ``out_dir`` (``all``: diffusers + kohya + README.md).

    Refuses (ValueError) to overwrite an existing file unless ``force``. Under ``all`` a target list with no
    native names (custom modules) skips the kohya file and says so in the README. A preference embedding in
    ``state`` (``flowrl_preference.*``) goes to ``preference_embedding.safetensors`` beside them, with
    ``preference`` (its ``describe()``: rewards, hooked submodule, sizes) as metadata; the LoRA files stay plain."""
    from flowrl.models.preference import PREFERENCE_WEIGHT_NAME, save_preference, split_preference

    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    state, embedding = split_preference(state)
    if embedding and preference is None:
        raise ValueError("the adapter carries a preference embedding but no description of it (its rewards): pass "
                         "preference=embedding.describe()")
    names = {"all": [DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME, "README.md"], "diffusers": [DIFFUSERS_WEIGHT_NAME],
             "comfyui": [COMFYUI_WEIGHT_NAME], "kohya": [KOHYA_WEIGHT_NAME]}[format]
    names = [*names[:-1], PREFERENCE_WEIGHT_NAME, names[-1]] if embedding and format == "all" else \
        [*names, PREFERENCE_WEIGHT_NAME] if embedding else names
    experts = expert_states(state)  # two experts: a diffusers file per expert in place of the one
    if experts:
        names = [m for n in names for m in ([EXPERT_WEIGHT_NAMES[c] for c in experts] if n == DIFFUSERS_WEIGHT_NAME
                                             else [n])]
    existing = [n for n in names if (out_dir / n).exists()]
    if existing and not force:
        raise ValueError(f"{out_dir / existing[0]} already exists; pass --force to overwrite")
    metadata = export_metadata(config, family=family, base_model=base_model, config_text=config_text)
    written, notes = [], []
    for name in names:
        if name == KOHYA_WEIGHT_NAME:
            try:
                written.append(save_kohya_lora(out_dir / name, state, config, family=family, metadata=metadata))
            except ValueError as error:
                if format == "kohya":
                    raise
                notes.append(f"No {KOHYA_WEIGHT_NAME}: {error}.")
        elif name == "README.md":
            rows = "\n".join(f"| `{p.name}` | {ROWS[p.name]} |" for p in written)
            text = README.format(version=metadata["flowrl.version"], family=family, path=metadata["flowrl.model_path"],
                                 config_hash=metadata["flowrl.config_sha256"], rank=metadata["flowrl.rank"],
                                 alpha=metadata["flowrl.alpha_trained"], scale=metadata["flowrl.scale_trained"],
                                 rows=rows)
            (out_dir / name).write_text(text + "".join(f"\n{note}\n" for note in notes))
            written.append(out_dir / name)
        elif name == PREFERENCE_WEIGHT_NAME:
            written.append(save_preference(out_dir, embedding, preference))
        elif experts and name in EXPERT_WEIGHT_NAMES.values():
            component = next(c for c, n in EXPERT_WEIGHT_NAMES.items() if n == name)
            written.append(save_diffusers_lora(None, out_dir, experts[component], config, weight_name=name,
                                               metadata={**metadata, "flowrl.expert": component}))
        elif experts:
            raise ValueError(f"a two-expert LoRA exports as {DIFFUSERS_WEIGHT_NAME} and {TRANSFORMER_2_WEIGHT_NAME}: "
                             "use --format diffusers or all")
        else:
            written.append(save_diffusers_lora(None, out_dir, state, config, metadata=metadata, weight_name=name))
    shared_mode(*written)
    return written
