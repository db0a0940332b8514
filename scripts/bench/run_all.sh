#!/usr/bin/env bash
# Every flowrl benchmark in one go, and one ratio table of what they measured (docs/performance.md).
#
#   scripts/bench/run_all.sh [OUT_DIR]          # default OUT_DIR: runs/bench; ~3-4 min on 2 CPU cores
#
# Runs, with small settings, offline (HF_HUB_OFFLINE=1):
#   1. scripts/bench/rollout.py   flowrl's SDE rollout vs the diffusers pipeline __call__ (tiny SD3 + FLUX)
#   2. scripts/bench/train.py     a GRPO epoch's stage times and one train step vs the bare forward+backward
#                                 (configs/smoke/sd3_tiny.yaml and flux_tiny.yaml)
#   3. scripts/bench/bench_rewards.py   reward throughput, one batched call vs one call per image (tiny CLIP-family
#                                 models of the real architectures, and OCR)
#   4. scripts/bench/gpu_full_size.py   full-size SD3.5-M and FLUX.1-dev (--family all: every family) when
#                                 `nvidia-smi` sees a GPU; otherwise
#                                 its --quick --device cpu smoke run (tiny configs: checks the logic only)
# Each benchmark's output goes to OUT_DIR/<name>.log, its wall time and peak RSS (the benchmark process, from
# getrusage) to OUT_DIR/<name>.usage; the summary table is printed and written to OUT_DIR/summary.md.
# PYTHON overrides the interpreter (default .venv/bin/python, else python). A failing benchmark is reported in
# the table and the others still run; the exit status is the number of failures.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
OUT=${1:-runs/bench}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
FAILED=0

measure() {  # NAME CMD...: run CMD, tee its output to OUT/NAME.log, write "wall_s peak_rss_kib rc" to OUT/NAME.usage
  local name=$1
  shift
  echo "== $name: $*"
  "$PY" -c '
import resource, subprocess, sys, time
start = time.time()
rc = subprocess.call(sys.argv[2:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(f"{time.time() - start:.1f} {usage.ru_maxrss} {rc}\n")
sys.exit(rc)' "$OUT/$name.usage" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (exit $rc)"
    FAILED=$((FAILED + 1))
  fi
}

measure rollout "$PY" scripts/bench/rollout.py --threads 1 --repeats 9
measure train_sd3 "$PY" scripts/bench/train.py configs/smoke/sd3_tiny.yaml --epochs 4 --repeats 20
measure train_flux "$PY" scripts/bench/train.py configs/smoke/flux_tiny.yaml --epochs 4 --repeats 20
measure rewards "$PY" scripts/bench/bench_rewards.py --n 32 --repeats 3 --threads 1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  measure gpu "$PY" scripts/bench/gpu_full_size.py --out "$OUT/gpu.json"
else
  echo "== no GPU (nvidia-smi missing or sees none): gpu_full_size.py as a CPU smoke run only"
  measure gpu_smoke "$PY" scripts/bench/gpu_full_size.py --quick --device cpu --out "$OUT/gpu_smoke.json"
fi

"$PY" - "$OUT" <<'PYTHON' | tee "$OUT/summary.md"
"""Collect the benchmarks' printed results into one ratio table (markdown)."""
import json
import os
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []  # (metric, setting, flowrl, reference, ratio)


def text(name):
    path = out / f"{name}.log"
    return path.read_text() if path.exists() else ""


def usage(name):
    path = out / f"{name}.usage"
    if not path.exists():
        return None
    wall, rss_kib, rc = path.read_text().split()
    return float(wall), int(rss_kib) * 1024, int(rc)


def failed(name):
    u = usage(name)
    return u is None or u[2] != 0


# 1. Rollout overhead: flowrl rollout / diffusers __call__ (rollout.py's table lines).
line = re.compile(r"^(sd3|flux)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s*$")
for m in (line.match(l) for l in text("rollout").splitlines()):
    if m:
        family, model, device, dtype, steps, batch, ours, theirs, ratio, extra = m.groups()
        rows.append(("rollout overhead (flowrl rollout / diffusers `__call__`)",
                     f"{family} {model}, {device} {dtype}, {batch} images x {steps} steps; {extra} ms/step extra",
                     f"{float(ours):.3f} s", f"{float(theirs):.3f} s", f"{float(ratio):.3f}"))
if failed("rollout"):
    rows.append(("rollout overhead", "rollout.py FAILED: see rollout.log", "-", "-", "-"))

# 2. Train-step overhead and epoch stage times (train.py).
for name, family in (("train_sd3", "sd3"), ("train_flux", "flux")):
    log = text(name)
    step = re.search(r"train step: flowrl ([\d.]+) ms, bare forward\+backward ([\d.]+) ms, KL reference pass \+(-?[\d.]+) ms", log)
    ratio = re.search(r"framework overhead \(flowrl step / bare step\): ([\d.]+)", log)
    if step and ratio:
        ours, bare, kl = step.groups()
        rows.append(("train-step overhead (flowrl step / bare forward+backward)",
                     f"{family} tiny smoke config, 1 micro-batch, beta=0 (KL reference pass: +{kl} ms)",
                     f"{ours} ms", f"{bare} ms", ratio.group(1)))
    stages = dict(re.findall(r"^(sample|reward wait|train|other|epoch)\s+([\d.]+)", log, flags=re.M))
    if stages:
        rows.append(("epoch stage times (s/epoch, mean of epochs 2-4)", f"{family} tiny smoke config",
                     ", ".join(f"{k} {v}" for k, v in stages.items() if k != "epoch"), f"epoch {stages.get('epoch')}",
                     f"sample share {float(stages['sample']) / float(stages['epoch']):.0%}" if "epoch" in stages else "-"))
    if failed(name):
        rows.append(("train-step overhead", f"train.py ({family}) FAILED: see {name}.log", "-", "-", "-"))

# 3. Reward throughput: batched vs one-by-one (bench_rewards' final table).
for m in re.finditer(r"^(\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x$", text("rewards"), flags=re.M):
    reward, batched, single, speedup = m.groups()
    rows.append(("reward throughput (batched / one-by-one, images/s)", f"{reward} (tiny model, CPU)" if reward != "ocr"
                 else "ocr (rapidocr, CPU)", f"{batched} img/s", f"{single} img/s", f"{speedup}"))
if failed("rewards"):
    rows.append(("reward throughput", "bench_rewards.py FAILED: see rewards.log", "-", "-", "-"))

# 4. Full-size GPU figures; the CPU smoke run of the same script only says that its logic ran (tiny configs,
#    2 repeats on a busy CPU: its timings are not figures).
smoke = out / "gpu_smoke.json"
if smoke.exists():
    data = json.loads(smoke.read_text())
    rows.append(("gpu_full_size.py --quick --device cpu (smoke)", "tiny configs: logic check, not a measurement",
                 f"ran: {len(data['rows'])} rows", "-", "-"))
elif (out / "gpu_smoke.usage").exists():
    rows.append(("gpu_full_size.py --quick --device cpu (smoke)", "FAILED: see gpu_smoke.log", "-", "-", "-"))
gpu = out / "gpu.json"
if gpu.exists():
    data = json.loads(gpu.read_text())
    fmt = lambda s: "-" if s is None else (f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms")  # noqa: E731
    for r in data["rows"]:
        if r["ratio"] is not None and r["stage"] not in ("model load", "attention sdpa"):
            rows.append((f"full-size GPU: {r['stage']} (flowrl / baseline)", f"{r['family']} on {data['meta']['device']}",
                         fmt(r["flowrl_s"]), fmt(r["baseline_s"]), f"{r['ratio']:.3f}"))
        elif r["ratio"] is None and r["stage"] != "model load":
            rows.append((f"full-size GPU: {r['stage']}", f"{r['family']}: {r['note']}", "-", "-", "-"))
    for r in data["rows"]:
        if r["peak_bytes"] is not None and r["stage"] in ("model load", "rollout", "train step (checkpointing off)",
                                                          "train step (checkpointing on)"):
            rows.append(("peak GPU memory per stage (max_memory_allocated)", f"{r['family']}: {r['stage']}",
                         f"{r['peak_bytes'] / 2**30:.2f} GiB", "-", "-"))
elif (out / "gpu.usage").exists():
    rows.append(("full-size GPU", "gpu_full_size.py FAILED: see gpu.log", "-", "-", "-"))

# 5. Peak memory: on the CPU, each benchmark process's peak RSS (per process, not per stage within it).
for name, stage in (("rollout", "rollout (rollout.py, both tiny families)"),
                    ("train_sd3", "GRPO epochs + train step (train.py, sd3 tiny)"),
                    ("train_flux", "GRPO epochs + train step (train.py, flux tiny)"),
                    ("rewards", "reward scoring (bench_rewards.py, 4 tiny CLIP models + OCR)")):
    u = usage(name)
    if u is not None:
        rows.append(("peak memory per stage (process peak RSS)", f"{stage}; wall {u[0]:.0f} s",
                     f"{u[1] / 2**30:.2f} GiB", "-", "-"))

print("| metric | setting | flowrl | reference | ratio |")
print("|---|---|---|---|---|")
for row in rows:
    print("| " + " | ".join(str(cell) for cell in row) + " |")
PYTHON
exit "$FAILED"
