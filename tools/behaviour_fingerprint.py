"""A fingerprint of what flowrl computes, to prove that a refactor changes no behaviour.

It writes one JSON file holding
- every shipped config's resolved settings (``configs/**/*.yaml`` through the loader, as ``flowrl train`` sees them);
- for a short run of every toy config (every recipe, loss, credit rule, objective, guard and regulariser the toy
  world ships) and every smoke config (every family): the SHA-256 of each epoch's metrics without the timing keys
  (``perf/*_s``), and of each tensor of the last checkpoint (adapter, optimizer state, EMA, snapshots).

Run it before and after a change on the same machine and thread count, then compare:

    OMP_NUM_THREADS=1 python -m tools.behaviour_fingerprint runs/fingerprint_before.json
    OMP_NUM_THREADS=1 python -m tools.behaviour_fingerprint runs/fingerprint_after.json
    python -m tools.behaviour_fingerprint --compare runs/fingerprint_before.json runs/fingerprint_after.json

The runs take about ten minutes on one core. Bit-equality holds only for one machine and thread count (the CPU's
GEMM kernels differ between machines), so the two files must come from the same ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

# Short runs: two epochs, no grids, held-out points or report, a checkpoint at the end.
SHORT = ["train.epochs=2", "log.progress=false", "log.eval_every=0", "log.test_every=0", "log.report_prompts=0",
         "train.checkpoint_every=0"]
# Keys that hold wall-clock time: everything else must be equal.
TIMING_SUFFIXES = ("_s",)


def resolved_configs(root: Path) -> dict[str, dict]:
    """{config path: the settings the loader resolves it to} for every shipped config."""
    from flowrl.config import Config, ConfigError, load_config, to_dict

    out = {}
    for path in sorted(root.rglob("*.yaml")):
        if path.parts[1] in {"accelerate", "provenance", "serve"}:
            continue
        try:
            out[str(path)] = to_dict(load_config(Config, path))
        except ConfigError as error:  # a fragment another config bases itself on: its error is its fingerprint
            out[str(path)] = {"error": str(error)}
    return out


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_digests(directory: Path) -> dict[str, str]:
    """{file/tensor: digest} of the checkpoint in ``directory``: every safetensors tensor, the optimizer's state
    tensors and the trainer state."""
    def tensor_digest(tensor: torch.Tensor) -> str:
        return digest(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    out = {}
    for file in sorted(directory.rglob("*.safetensors")):
        for name, tensor in sorted(load_file(file).items()):
            out[f"{file.relative_to(directory)}/{name}"] = tensor_digest(tensor)
    for file in sorted(directory.rglob("optimizer*.pt")):
        state = torch.load(file, weights_only=True, map_location="cpu")
        for index, slots in sorted(state["state"].items()):
            for slot, value in sorted(slots.items()):
                if torch.is_tensor(value):
                    out[f"{file.relative_to(directory)}/{index}/{slot}"] = tensor_digest(value)
    for file in sorted(directory.rglob("trainer_state.json")):
        state = {k: v for k, v in json.loads(file.read_text()).items() if not k.endswith(TIMING_SUFFIXES)}
        out[str(file.relative_to(directory))] = digest(json.dumps(state, sort_keys=True).encode())
    return out


def metric_digests(metrics_file: Path) -> list[str]:
    """One digest per logged row, its timing keys left out."""
    rows = []
    for line in metrics_file.read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items()
               if not (k.startswith("perf/") and k.endswith(TIMING_SUFFIXES))}
        rows.append(digest(json.dumps(row, sort_keys=True).encode()))
    return rows


def short_run(config: Path, work: Path) -> dict:
    """Train ``config`` for two epochs in a fresh directory; its metrics' and last checkpoint's digests."""
    run_dir = work / config.stem
    command = [sys.executable, "-m", "flowrl", "train", str(config), f"run_dir={run_dir}", *SHORT]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    checkpoints = sorted((run_dir / "checkpoints").glob("*"))
    return {"metrics": metric_digests(run_dir / "metrics.jsonl"),
            "checkpoint": tensor_digests(checkpoints[-1]) if checkpoints else {}}


def fingerprint(out: Path, configs: list[Path]) -> None:
    result = {"configs": resolved_configs(Path("configs")), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            run = result["runs"][str(config)] = short_run(config, Path(tmp))
            print(f"{config}: {run.get('error', 'ok')}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(before: Path, after: Path) -> int:
    """Print every difference; returns the number of differing entries."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differences = 0
    for section in ("configs", "runs"):
        for key in sorted(set(a[section]) | set(b[section])):
            if a[section].get(key) != b[section].get(key):
                differences += 1
                print(f"differs: {section} {key}")
    print(f"{differences} difference(s)")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--compare", action="store_true", help="compare two fingerprint files")
    parser.add_argument("--configs", nargs="*", type=Path, help="short runs of these configs only")
    args = parser.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.files) else 0)
    configs = args.configs if args.configs is not None else sorted(
        [*Path("configs/toy").glob("*.yaml"), *Path("configs/smoke").glob("*.yaml")])
    fingerprint(args.files[0], configs)


if __name__ == "__main__":
    main()
