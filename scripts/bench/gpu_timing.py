"""Generic measurement helpers of ``scripts/bench/gpu_full_size.py``: CUDA-event timing, peak memory, FLOP
counting, out-of-memory handling, the bare-transformer baseline (the model calls a policy adapter makes,
recorded and replayed) and the markdown table / JSON output. Nothing here knows a model family."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


class Clock:
    """Seconds of one call: CUDA events on a GPU (synchronised after), perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1000


class Memory:
    """Peak memory of a stage: CUDA's max_memory_allocated (reset per stage), else the RSS high-water mark."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.kind = "max_memory_allocated" if self.cuda else "process RSS high-water mark (not resettable)"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None


def timed(functions: dict[str, Callable[[], object]], repeats: int, clock: Clock, memory: Memory,
          warmups: dict[str, Callable[[], object]] | None = None) -> dict[str, tuple[float, int, list[float]]]:
    """{name: (median seconds, peak bytes of its first timed call, all seconds)}: one warm-up call of each
    (``warmups[name]`` if given, else the function itself), then ``repeats`` rounds interleaved."""
    for name, fn in functions.items():
        (warmups or {}).get(name, fn)()
    seconds: dict[str, list[float]] = {name: [] for name in functions}
    peaks: dict[str, int] = {}
    for round_ in range(repeats):
        for name, fn in functions.items():
            if round_ == 0:
                memory.reset()
            seconds[name].append(clock(fn))
            if round_ == 0:
                peaks[name] = memory.peak()
    return {name: (statistics.median(s), peaks[name], s) for name, s in seconds.items()}


def count_flops(fn: Callable[[], object]) -> int | None:
    """FLOPs of one call (matmuls and attention, forward and backward) by torch's flop counter; None if it fails.
    Works on the meta device too (shapes only), which is how the budget in the bench's docstring was counted."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            fn()
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001  (a counter gap must not stop the benchmark)
        return None


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn: Callable[[], object]) -> tuple[object, bool]:
    """(fn(), False), or (None, True) when the device ran out of memory; then the failed call's tensors are
    released (outside the ``except`` block, whose traceback would keep them alive)."""
    try:
        return fn(), False
    except RuntimeError as error:
        if not is_oom(error):
            raise
    free_memory()
    return None, True


@contextlib.contextmanager
def created_in(device: torch.device, dtype: torch.dtype):
    """Modules built inside are born on ``device`` in ``dtype``: no fp32 copy of 20B weights, no cast after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------------------- the bare baseline

def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _moved(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value


def capture_calls(policy, x: torch.Tensor, sigma, cond, guidance: float) -> list[dict]:
    """The keyword arguments of every transformer call ``policy.velocity(x, sigma, cond, guidance)`` makes, as the
    adapter builds them (packing, ids, CFG batching or passes, trimmed text): recorded without running the model
    (each call answers zeros of its input's shape, which every family's output has)."""
    calls = []

    def record(**kwargs):
        calls.append(_detached(kwargs))
        sample = kwargs["hidden_states"] if "hidden_states" in kwargs else kwargs["x"]
        if "audio_hidden_states" in kwargs:  # LTX-2's joint transformer: a video and an audio output
            return torch.zeros_like(sample), torch.zeros_like(kwargs["audio_hidden_states"])
        return [torch.zeros_like(s) for s in sample] if isinstance(sample, list) else torch.zeros_like(sample)

    policy.run_transformer = record  # an instance attribute over the class's method, deleted below
    try:
        with torch.no_grad():
            policy.velocity(x, sigma, cond, guidance)
    finally:
        del policy.run_transformer
    return calls


def call_rows(calls: list[dict]) -> int:
    """Transformer rows (batch entries) of the calls: CFG families run 2 per trajectory."""
    return sum(len(c["hidden_states"] if "hidden_states" in c else c["x"]) for c in calls)


class Bare:
    """The transformer called directly on the recorded inputs: the baselines flowrl is compared with."""

    def __init__(self, policy):
        self.transformer = policy.transformer

    def forward(self, calls: list[dict]) -> list:
        device = next(self.transformer.parameters()).device
        return [self.transformer(return_dict=False, **{k: _moved(v, device) for k, v in kw.items()})[0]
                for kw in calls]

    @torch.no_grad()
    def loop(self, calls: list[dict], steps: int) -> None:
        for _ in range(steps):
            self.forward(calls)

    def loss(self, calls: list[dict]) -> torch.Tensor:
        outs = [o for out in self.forward(calls) for o in (out if isinstance(out, list) else [out])]
        return sum(o.float().square().mean() for o in outs)


def xformers_forward(transformer, forward, sdpa_s: float, sdpa_peak: int, repeats: int, clock: Clock,
                     memory: Memory) -> tuple:
    """(seconds, baseline seconds, peak, baseline peak, note) of ``forward`` after
    ``enable_xformers_memory_efficient_attention()``, the SDPA forward as baseline; a reason where it cannot run."""
    if importlib.util.find_spec("xformers") is None:
        return None, None, None, None, "not installed (pip install xformers matching the torch build)"
    if not clock.cuda:
        return None, None, None, None, "installed, but xformers' attention needs a CUDA device"
    try:
        transformer.enable_xformers_memory_efficient_attention()
        xf_s, xf_peak, _ = timed({"xformers": forward}, repeats, clock, memory)["xformers"]
        return xf_s, sdpa_s, xf_peak, sdpa_peak, "enable_xformers_memory_efficient_attention(); baseline = SDPA forward"
    except Exception as error:  # noqa: BLE001  (an xformers/torch mismatch is a row, not a crash)
        return None, None, None, None, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


# ------------------------------------------------------------------------------------------ output

def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def count_text(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3f}{unit}" if unit == "B" else f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def flops_text(flops: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def markdown(rows: list[dict], memory_kind: str, labels: dict[str, str]) -> str:
    """The table: one line per row dict (family, stage, flowrl_s, baseline_s, ratio, peak bytes, note)."""
    lines = ["| family | stage | flowrl | baseline | ratio | peak GiB (flowrl / baseline) | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{gib(r['peak_bytes']):.2f}"
        if r["baseline_peak_bytes"] is not None:
            peak += f" / {gib(r['baseline_peak_bytes']):.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {labels.get(r['family'], r['family'])} | {r['stage']} | {seconds_text(r['flowrl_s'])} | "
                     f"{seconds_text(r['baseline_s'])} | {ratio} | {peak} | {r['note']} |")
    lines.append(f"(memory: {memory_kind})")
    return "\n".join(lines)


def write_json(path: Path, meta: dict, rows: list[dict], table: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta=meta, rows=rows, table=table), indent=1))
