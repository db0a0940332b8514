"""Render a ``flowrl eval`` report.html in headless Chromium: a screenshot and what the rendered DOM holds.

Why: report.html is checked as text by the tests, but what a reader sees is the page a browser draws. This
loads it in headless Chromium (no network: the page inlines every image), dumps the DOM after rendering
and counts its parts (prompt grids with their prompt text and checkpoint rows, tables, images, the
trade-off plot), writes a screenshot, and exits non-zero with a clear message when chromium is missing,
a part is absent or the screenshot is blank. It made ``docs/eval_report.png``:

    python -m tools.render_report runs/toy_nft/eval/report.html --out docs/eval_report.png [--width 1280 --height 2400]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


def _chromium(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    binary = find_chromium()
    if binary is None:
        raise SystemExit(f"render_report: no chromium found (looked for {', '.join(CHROMIUM_NAMES)}); "
                         "install it, e.g. apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="render_report_") as profile:  # no clash with another chromium
        result = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                 "--no-first-run", f"--user-data-dir={profile}", *args],
                                capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"render_report: chromium exited with {result.returncode}:\n{tail}")
    return result


def dump_dom(report: str | Path, timeout: float = 120) -> str:
    """The report's DOM after Chromium has loaded and laid it out, as HTML."""
    return _chromium(["--dump-dom", Path(report).resolve().as_uri()], timeout).stdout


def screenshot(report: str | Path, out: str | Path, *, width: int = 1280, height: int = 2400,
               timeout: float = 120) -> Path:
    """A ``width`` x ``height`` PNG of the top of the report."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    _chromium([f"--window-size={width},{height}", f"--screenshot={out}", Path(report).resolve().as_uri()], timeout)
    if not out.is_file():
        raise SystemExit(f"render_report: chromium wrote no screenshot at {out}")
    return out


class _Summary(HTMLParser):
    VOID = {"img", "meta", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, set[str]]] = []
        self.grids: list[str] = []
        self.rows_per_grid: list[int] = []
        self.headings: list[str] = []
        self.tables = self.images = 0
        self.plot = False

    def _inside(self, tag: str, css: str | None = None) -> bool:
        return any(t == tag and (css is None or css in c) for t, c in self.stack)

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        classes = set(attrs.get("class", "").split())
        if tag == "div" and "prompt" in classes:
            self.grids.append("")
            self.rows_per_grid.append(0)
        elif tag == "div" and "row" in classes and self._inside("div", "prompt"):
            self.rows_per_grid[-1] += 1
        elif tag == "table":
            self.tables += 1
        elif tag == "h2":
            self.headings.append("")
        elif tag == "img":
            self.images += 1
            self.plot |= attrs.get("alt") == "trade-off plot" and attrs.get("src", "").startswith("data:image/png")
        if tag not in self.VOID:
            self.stack.append((tag, classes))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._inside("h3") and self._inside("div", "prompt") and not self._inside("span"):
            self.grids[-1] += data
        elif self.stack and self.stack[-1][0] == "h2":
            self.headings[-1] += data


def summarize(dom: str) -> dict:
    """``{"grids": [prompt text per grid], "rows_per_grid", "tables", "images", "plot", "headings"}``."""
    parser = _Summary()
    parser.feed(dom)
    parser.close()
    return {"grids": [g.strip() for g in parser.grids], "rows_per_grid": parser.rows_per_grid,
            "tables": parser.tables, "images": parser.images, "plot": parser.plot, "headings": parser.headings}


def _is_blank(png: Path) -> bool:
    from PIL import Image

    with Image.open(png) as image:
        low, high = zip(*image.convert("RGB").getextrema())
    return low == high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="report.html written by flowrl eval")
    parser.add_argument("--out", required=True, help="screenshot PNG")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args(argv)
    report = Path(args.report)
    if not report.is_file():
        raise SystemExit(f"render_report: {report} does not exist")
    summary = summarize(dump_dom(report))
    print(f"sections: {' | '.join(summary['headings'])}")
    print(f"prompt grids: {len(summary['grids'])}, checkpoint rows per grid: {summary['rows_per_grid']}")
    for number, prompt in enumerate(summary["grids"], start=1):
        print(f"  {number:2d}. {prompt}")
    print(f"tables: {summary['tables']}, images: {summary['images']}, trade-off plot: "
          f"{'yes' if summary['plot'] else 'no'}")
    missing = [what for what, ok in (("prompt grids", summary["grids"]), ("a prompt's text", all(summary["grids"])),
                                     ("checkpoint rows", summary["rows_per_grid"] and min(summary["rows_per_grid"]) > 0),
                                     ("tables", summary["tables"]), ("the trade-off plot", summary["plot"]),
                                     ("a Summary section", "Summary" in summary["headings"]))
               if not ok]
    if missing:
        raise SystemExit(f"render_report: the rendered report lacks {', '.join(missing)}")
    out = screenshot(report, args.out, width=args.width, height=args.height)
    if _is_blank(out):
        raise SystemExit(f"render_report: the screenshot {out} is a single colour")
    print(f"wrote {out} ({out.stat().st_size // 1024} KB, {args.width}x{args.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
