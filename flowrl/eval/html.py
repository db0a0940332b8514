"""Self-contained HTML pages for the reports of :mod:`flowrl.eval.report` (``flowrl eval`` and the end of a
run): the pieces both pages are made of.

One file, images and plots inlined as base64 PNG, no scripts and no network: it opens from a laptop,
a cluster's scratch disk or a CI artifact alike. The pieces are plain functions returning HTML strings:
a metric table with deltas against a baseline column, an image grid per prompt with the prompt text
and one labelled row per model (and which prompts get one), and a matplotlib figure.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Sequence

import torch

from flowrl.data.prompts import round_robin

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f5f5f7; }
.up { color: #1a7f37; } .down { color: #c62828; } .note { color: #555; font-size: 0.9em; }
.prompt { margin: 1.2em 0; } .prompt h3 { font-size: 1em; margin: 0.3em 0; font-weight: 600; }
.row { display: flex; align-items: center; gap: 0.6em; margin: 0.2em 0; }
.row .label { flex: none; width: 9em; font-size: 0.85em; color: #444; text-align: right; overflow-wrap: anywhere; }
.row img { image-rendering: pixelated; width: calc(100% - 10em); max-width: 720px; height: auto; }
.grids { columns: 2 560px; }
.grids .prompt { break-inside: avoid; }
"""


def escape(text: object) -> str:
    return html.escape(str(text))


def png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def image_strip(images: torch.Tensor) -> bytes:
    """One row of images ``[n, 3, H, W]`` (or videos ``[n, T, 3, H, W]``, as film strips) in [0, 1] as PNG bytes."""
    from torchvision.utils import make_grid
    from PIL import Image

    from flowrl.core.media import stills

    images = stills(images)
    grid = make_grid(images.detach().float().cpu().clamp(0, 1), nrow=len(images), padding=2, pad_value=1.0)
    array = (grid * 255 + 0.5).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def figure_png(figure, **savefig) -> bytes:
    """A matplotlib figure as PNG bytes; ``savefig`` adds options (``bbox_inches="tight"``)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, **savefig)
    return buffer.getvalue()


def img(data: bytes, alt: str, css_class: str = "") -> str:
    extra = f' class="{css_class}"' if css_class else ""
    return f'<img{extra} alt="{escape(alt)}" src="{png_uri(data)}">'


def prompt_grid(prompt: str, rows: Sequence[tuple[str, torch.Tensor]], note: str = "") -> str:
    """The prompt text, then one labelled strip of images per model (same seeds in every row)."""
    strips = "".join(f'<div class="row"><span class="label">{escape(label)}</span>'
                     f'{img(image_strip(images), f"{label}: {prompt}")}</div>' for label, images in rows)
    caption = f' <span class="note">{escape(note)}</span>' if note else ""
    return f'<div class="prompt"><h3>{escape(prompt)}{caption}</h3>{strips}</div>'


def grid_order(tasks: list, count: int) -> list[int]:
    """The prompts shown as grids: ``count`` of them, an equal share per task (round-robin)."""
    labels = [t if t is not None else "" for t in tasks]
    return round_robin(labels)[:count]


def prompt_grids(prompts: Sequence[str], tasks: Sequence, shown: Sequence[int], rows) -> str:
    """The grids of the prompts ``shown`` (indices into ``prompts``), in columns: ``rows(i)`` gives prompt i's
    ``(label, images)`` rows, its task (if any) is the note beside the prompt."""
    grids = "".join(prompt_grid(prompts[i], rows(i), note=str(tasks[i] or "")) for i in shown)
    return f"<div class='grids'>{grids}</div>"


def number(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def delta(value: float | None, base: float | None, higher_is_better: bool | None = True) -> str:
    """``+0.0123`` coloured by whether the change is good, or empty when either side is missing."""
    if value is None or base is None or math.isnan(value) or math.isnan(base):
        return ""
    change = value - base
    good = None if higher_is_better is None or change == 0 else (change > 0) == higher_is_better
    css = "" if good is None else (' class="up"' if good else ' class="down"')
    return f"<span{css}>{change:+.4f}</span>"


def metric_table(metrics: dict[str, dict[str, float]], keys: Sequence[str], *, base: str | None,
                 directions: dict[str, bool | None] | None = None, caption: str = "",
                 errors: dict[str, dict[str, dict[str, float]]] | None = None) -> str:
    """Rows are metric keys, columns the models (``metrics[label][key]``), each beside its change from ``base``;
    ``errors[label][key]``, where given, adds the change's paired standard error and how many it spans."""
    labels = list(metrics)
    directions = directions or {}
    head = "<tr><th>metric</th>" + "".join(
        f"<th>{escape(label)}</th>" + ("" if label == base or base is None else f"<th>&Delta; {escape(label)}</th>")
        for label in labels) + "</tr>"
    body = []
    for key in keys:
        cells = [f"<td>{escape(key)}</td>"]
        for label in labels:
            value = metrics[label].get(key)
            cells.append(f"<td>{number(value)}</td>")
            if base is not None and label != base:
                pair = (errors or {}).get(label, {}).get(key)
                spread = "" if not pair or not math.isfinite(pair["standard_errors"]) else \
                    f" ± {number(pair['standard_error'])} ({pair['standard_errors']:.1f} s.e.)"
                cells.append(f"<td>{delta(value, metrics[base].get(key), directions.get(key, True))}{spread}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    title = f"<caption class='note'>{escape(caption)}</caption>" if caption else ""
    return f"<table>{title}{head}{''.join(body)}</table>"


def page(title: str, sections: Sequence[tuple[str, str]], intro: str = "") -> str:
    """A whole HTML document: the title, an intro paragraph, then ``(heading, html)`` sections."""
    parts = [f"<h2>{escape(heading)}</h2>{content}" for heading, content in sections]
    lead = f"<p class='note'>{intro}</p>" if intro else ""
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{lead}{''.join(parts)}</body></html>\n")
