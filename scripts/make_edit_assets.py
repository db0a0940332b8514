"""Write the example source images of editing runs and the smoke prompt file that uses them.

Why: the FLUX.1 Kontext smoke run, tests and benchmarks need source images without a download. They are
simple coloured shapes (``flowrl.models.tiny_flux_kontext.EXAMPLE_SOURCES``, 64 x 64 PNG), drawn
deterministically; this writes ``assets/edit/<name>.png`` and ``assets/prompts/edit_train.jsonl`` (one edit
instruction per source, its ``source_image`` relative to the prompt file). Run once from the repository root:

    python scripts/make_edit_assets.py [--out assets]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowrl.models.tiny_flux_kontext import EXAMPLE_SOURCES, draw_example_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets", help="the assets folder (default: assets)")
    out = Path(parser.parse_args().out)
    (out / "edit").mkdir(parents=True, exist_ok=True)
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    lines = []
    for index, (stem, *_, prompt) in enumerate(EXAMPLE_SOURCES):
        draw_example_source(index).save(out / "edit" / f"{stem}.png")
        lines.append(json.dumps({"prompt": prompt, "metadata": {"source_image": f"../edit/{stem}.png"}}))
    (out / "prompts" / "edit_train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(EXAMPLE_SOURCES)} source images to {out / 'edit'} and {out / 'prompts' / 'edit_train.jsonl'}")


if __name__ == "__main__":
    main()
