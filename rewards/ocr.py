"""OCR reward: does the image spell the text the prompt asks for? (Flow-GRPO's text-rendering task.)

``OcrReward`` reads each image with PP-OCRv4 (detector + recogniser) through ``rapidocr_onnxruntime``,
whose wheel ships the ONNX models, so it runs offline on CPU. The score of one image is
``ocr_score(recognised, target)``:

    1 - Levenshtein(recognised, target) / len(target), clamped to [0, 1],

after normalising both strings (Unicode NFKC, so full-width punctuation the Chinese-trained
recogniser emits matches ASCII; lower case; every whitespace character removed). If the normalised
target occurs inside the normalised recognised text the score is 1. The recognised text is all
detected boxes joined in the engine's reading order (top to bottom, left to right).

Target text: ``metadata["text"]`` when present, else the first quoted span of the prompt
("double", 'single', “curly”, ‘curly single’, «guillemets», 「corner」, 『white corner』).
A prompt with neither is a user error: ValueError naming the prompt (``missing_target="nan"``
scores it NaN with a warning instead).

Scores: 0 for an image where nothing is read (a valid score: nothing was written); NaN for an
image holding NaN/inf pixels or one the engine failed on (logged on logger "flowrl.rewards.ocr",
naming the prompt; the rest of the batch is scored). Sub-scores:

    ocr/exact           1 if the normalised target occurs in the normalised recognised text, else 0
    ocr/recognised_len  characters of normalised recognised text: watch it for a policy that
                        floods the image with text to hit the substring rule

Engine settings, and why they differ from rapidocr's defaults:

* Detector resize ``det_limit_side_len=960`` with limit type "max" (PaddleOCR's usual det setting):
  rapidocr's default ("min", 736) upscales the *short* side to 736, so a 384x128 image is detected
  at 2208x736, ~20x slower for no gain on generated images.
* No angle classifier (``use_cls=False``): on small crops it flips upright text by 180 degrees
  ("diffusion" read as "uoisnp"); upside-down text is a failure of the image anyway, and should
  not be read back as correct.
* Images whose short side is below ``min_side`` (default 256) are upscaled (bicubic) before OCR:
  the detector and recogniser are trained on larger text (the recogniser sees 48 px high lines) and
  read small text with much lower confidence. ``min_side=0`` turns this off. The upscale stops
  where the long side reaches 2000 px, rapidocr's own cap.

Batching: rapidocr reads one image per call, so a batch runs over a thread pool of ``num_workers``
(onnxruntime releases the GIL in ``Run``). ONNX Runtime sessions are safe to run concurrently, but
rapidocr's Python wrapper is not: each call reassigns ``text_det.preprocess_op`` (and call kwargs
overwrite thresholds on the shared object). So each worker checks an engine out of a small pool
(at most ``num_workers`` engines, built lazily under a lock, each running ``num_threads`` ONNX
threads): no engine is ever used by two threads at once.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import threading
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from rapidfuzz.distance import Levenshtein
from rapidocr_onnxruntime import RapidOCR

logger = logging.getLogger("flowrl.rewards.ocr")

_ENGINE_MAX_SIDE = 2000  # rapidocr downsizes any image whose long side exceeds this (max_side_len)

# First quoted span, leftmost over all styles. Straight and curly single quotes need a non-word
# character (or an edge) outside them, so apostrophes ("cat's", "don't") are not taken as quotes.
_QUOTE = re.compile(
    r'"([^"]+)"'
    r"|“([^”]+)”"
    r"|(?<!\w)'(.+?)'(?!\w)"
    r"|(?<!\w)‘(.+?)’(?!\w)"
    r"|«([^»]+)»"
    r"|「([^」]+)」"
    r"|『([^』]+)』"
)


def normalise(text: str) -> str:
    """NFKC, lower case, all whitespace removed: the form both sides are compared in."""
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


def quoted_text(prompt: str) -> str | None:
    """The first quoted span of ``prompt`` (any supported quote style), or None."""
    match = _QUOTE.search(prompt)
    if match is None:
        return None
    return next(g for g in match.groups() if g is not None)


def ocr_score(recognised: str, target: str) -> float:
    """1 - edit distance / target length in [0, 1], on normalised text; 1 if target is contained.

    ValueError if the target is empty after normalisation.
    """
    rec, tgt = normalise(recognised), normalise(target)
    if not tgt:
        raise ValueError(f"empty OCR target {target!r}")
    if tgt in rec:
        return 1.0
    return max(0.0, 1.0 - Levenshtein.distance(rec, tgt) / len(tgt))


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _EnginePool:
    """Up to ``size`` RapidOCR engines, built on first demand; one engine serves one thread at a time."""

    def __init__(self, size: int, engine_kwargs: Mapping[str, Any]) -> None:
        self.size, self.engine_kwargs = size, dict(engine_kwargs)
        self._free: queue.LifoQueue = queue.LifoQueue()
        self._built = 0
        self._lock = threading.Lock()

    def acquire(self) -> RapidOCR:
        while True:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._built < self.size:
                    self._built += 1
                    break
            try:  # all engines busy: wait for one (re-check now and then, in case a build failed)
                return self._free.get(timeout=1.0)
            except queue.Empty:
                continue
        try:
            return RapidOCR(**self.engine_kwargs)
        except BaseException:
            with self._lock:
                self._built -= 1
            raise

    def release(self, engine: RapidOCR) -> None:
        self._free.put(engine)


class OcrReward:
    """Text-rendering accuracy of each image against its target text, by PP-OCRv4 (see module doc).

    num_workers: images read concurrently (thread pool and engine count); None -> min(4, CPUs).
    num_threads: ONNX Runtime intra-op threads per engine (inter-op is 1).
    min_side: upscale images whose short side is below this before OCR (0: never).
    missing_target: "raise" (ValueError naming the prompt) or "nan" (score NaN, log a warning).
    det_limit_side_len: the detector sees the image with its long side at most this.
    use_cls: run PP-OCR's 180-degree text-angle classifier.
    text_score: recognition confidence below which a detected box is dropped.
    """

    name = "ocr"

    def __init__(self, num_workers: int | None = None, num_threads: int = 1, min_side: int = 256,
                 missing_target: str = "raise", det_limit_side_len: int = 960, use_cls: bool = False,
                 text_score: float = 0.5) -> None:
        cpus = os.cpu_count() or 1
        if num_workers is None:
            num_workers = min(4, cpus)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if min_side < 0:
            raise ValueError(f"min_side must be >= 0, got {min_side}")
        if missing_target not in ("raise", "nan"):
            raise ValueError(f"missing_target must be 'raise' or 'nan', got {missing_target!r}")
        if det_limit_side_len < 32:
            raise ValueError(f"det_limit_side_len must be >= 32, got {det_limit_side_len}")
        if not 0.0 <= text_score <= 1.0:
            raise ValueError(f"text_score must be in [0, 1], got {text_score}")
        self.num_workers, self.num_threads, self.min_side = num_workers, num_threads, min_side
        self.missing_target = missing_target
        # rapidocr ignores a thread count above the CPU count and then uses every core: clamp instead
        threads = min(num_threads, cpus)
        self._engines = _EnginePool(num_workers, dict(
            intra_op_num_threads=threads, inter_op_num_threads=1, use_cls=use_cls,
            det_limit_type="max", det_limit_side_len=det_limit_side_len, text_score=text_score,
            print_verbose=False))

    # ------------------------------------------------------------------------------ targets

    def target_for(self, prompt: str, meta: Mapping[str, Any] | None) -> str | None:
        """metadata["text"] when present, else the prompt's first quoted span; None when neither
        (or the target is blank), in which case ``missing_target`` decides."""
        text = meta.get("text") if isinstance(meta, Mapping) else None
        if text is not None and not isinstance(text, str):
            raise ValueError(f"ocr: metadata['text'] must be a string, got {type(text).__name__} "
                             f"for prompt {_short(prompt)!r}")
        if text is None:
            text = quoted_text(prompt)
        return text if text is not None and normalise(text) else None

    # ------------------------------------------------------------------------------ reading

    def _prepare(self, img: np.ndarray) -> np.ndarray:
        """RGB uint8 HWC -> BGR uint8 HWC (rapidocr takes ndarrays as BGR), upscaled to min_side."""
        h, w = img.shape[:2]
        # never past rapidocr's max side: it would shrink the image straight back (and fail on
        # extreme aspect ratios)
        s = min(self.min_side / min(h, w), _ENGINE_MAX_SIDE / max(h, w)) if self.min_side else 1.0
        if s > 1.0:
            img = np.asarray(Image.fromarray(img).resize((round(w * s), round(h * s)), Image.BICUBIC))
        return np.ascontiguousarray(img[..., ::-1])

    def read(self, img: np.ndarray) -> str:
        """Text in one RGB uint8 HWC image: all boxes in reading order joined by spaces ("" if none)."""
        bgr = self._prepare(img)
        engine = self._engines.acquire()
        try:
            result, _ = engine(bgr)
        finally:
            self._engines.release(engine)
        return " ".join(str(box[1]) for box in result or ())

    # ------------------------------------------------------------------------------ scoring

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        n = images.shape[0]
        targets: list[str | None] = []
        for prompt, meta in zip(prompts, metadata):
            target = self.target_for(prompt, meta)
            if target is None:
                if self.missing_target == "raise":
                    raise ValueError(f"ocr: no target text for prompt {_short(prompt)!r}: quote the text "
                                     "in the prompt or set metadata['text'] (or missing_target='nan')")
                logger.warning("ocr: no target text for prompt %r; scoring it NaN", _short(prompt))
            targets.append(target)

        x = images.detach().to("cpu", torch.float32)  # [N, 3, H, W]
        finite = torch.isfinite(x).flatten(1).all(1).tolist() if n else []  # [N]
        u8 = (torch.nan_to_num(x).clamp(0, 1) * 255).round().to(torch.uint8)
        arrs = u8.permute(0, 2, 3, 1).contiguous().numpy()  # [N, H, W, 3] RGB, one conversion

        todo = []
        for i in range(n):
            if targets[i] is None:
                continue
            if not finite[i]:
                logger.warning("ocr: image for prompt %r has NaN/inf pixels; scoring it NaN",
                               _short(prompts[i]))
                continue
            todo.append(i)

        if todo:  # a broken install (engine cannot be built) raises, rather than scoring all NaN
            self._engines.release(self._engines.acquire())

        def read_one(i: int) -> str | None:
            try:
                return self.read(arrs[i])
            except Exception as err:  # one bad image must not sink the batch
                logger.warning("ocr: engine failed on prompt %r: %s: %s; scoring it NaN", _short(prompts[i]),
                               type(err).__name__, _short(str(err), 300) or "(no message)")
                return None

        if self.num_workers > 1 and len(todo) > 1:
            workers = min(self.num_workers, len(todo))
            with ThreadPoolExecutor(workers, thread_name_prefix="flowrl-ocr") as pool:
                texts = list(pool.map(read_one, todo))  # in order
        else:
            texts = [read_one(i) for i in todo]

        main = torch.full((n,), math.nan)
        exact = torch.full((n,), math.nan)
        length = torch.full((n,), math.nan)
        for i, text in zip(todo, texts):
            if text is None:
                continue
            rec, tgt = normalise(text), normalise(targets[i])
            main[i] = ocr_score(text, targets[i])
            exact[i] = float(tgt in rec)
            length[i] = float(len(rec))
        return {self.name: main, f"{self.name}/exact": exact, f"{self.name}/recognised_len": length}
