"""The end-of-run report's pieces: the moving average, which series the curve draws and its wall-clock panel,
the summary line, report.md's and report.html's structure (the headline table first, the rest folded, labelled
grids with the prompt text, the curve)."""

import json
import math
from html.parser import HTMLParser

import torch

from flowrl.data.prompts import PromptSet
from flowrl.eval.report import (curve_keys, html_report, markdown_report, moving_average, plot_reward_curve,
                                summary_line, wall_clock)


def test_moving_average_by_hand():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]


def _records():
    return [{"epoch": -1, "test/toyeval": 0.3, "test/toyeval/task_mean": 0.25},
            *({"epoch": e, "reward/toyeval_mean": 0.1 * e, "reward/toyeval/partial_mean": 0.5,
               "reward/toy_proxy_mean": 0.4, "reward/combined_mean": 0.1 * e} for e in range(6))]


def test_the_curve_draws_the_trained_reward_its_held_out_score_and_the_rest_apart():
    main, held_out, others = curve_keys(_records(), ["toyeval"])
    assert (main, held_out) == ("reward/toyeval_mean", "test/toyeval/task_mean")
    assert others == ["reward/toy_proxy_mean", "reward/toyeval/partial_mean"]
    # Two trained rewards: the curve is their weighted combination, and no single held-out score stands for it.
    assert curve_keys(_records(), ["toyeval", "toy_proxy"])[:2] == ("reward/combined_mean", "test/toyeval/task_mean")


def test_plot_writes_the_curve(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert plot_reward_curve(tmp_path, ["toyeval"]).stat().st_size > 10_000
    assert plot_reward_curve(tmp_path / "elsewhere", ["toyeval"]) is None


def _timed(key: str, per_epoch: float) -> list[dict]:
    """_records with each epoch timed by ``key`` (``perf/train_wall_s`` cumulative, ``perf/epoch_s`` not) and a
    held-out point after epochs 2 and 5."""
    records = _records()
    for r in records[1:]:
        r[key] = per_epoch * (r["epoch"] + 1 if key == "perf/train_wall_s" else 1)
        if r["epoch"] in (2, 5):
            r["test/toyeval/task_mean"] = 0.1 * r["epoch"]
    return records


def test_wall_clock_takes_the_run_s_cumulative_time_else_sums_the_epochs():
    timed = {-1: 0.0, **{e: (e + 1) * 0.5 for e in range(6)}}  # 30 s an epoch: half a minute
    assert wall_clock(_timed("perf/train_wall_s", 30.0)) == {e: m for e, m in timed.items() if e >= 0}
    assert wall_clock(_timed("perf/epoch_s", 30.0)) == timed  # epoch -1 (the base model's point) starts at 0
    assert wall_clock(_records()) == {}


def test_plot_adds_the_wall_clock_panel_only_when_epochs_are_timed(tmp_path):
    from PIL import Image

    heights = {}
    for key in ("perf/epoch_s", None):
        run = tmp_path / str(key).replace("/", "_")
        run.mkdir()
        records = _timed(key, 30.0) if key else _records()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        heights[key] = Image.open(plot_reward_curve(run, ["toyeval"])).size[1]
    assert heights["perf/epoch_s"] > heights[None] * 1.3


def _toy_results() -> dict:
    """A toy run's before_after: two tasks, a sub-score that one task lacks (NaN on both sides), diversity."""
    nan = math.nan
    values = {  # key: (before, after)
        "eval/toyeval": (0.16, 0.21), "eval/toyeval/position": (0.5, 0.6),
        "eval/toyeval/task/single_object": (0.2, 0.3), "eval/toyeval/task/position": (0.1, 0.1),
        "eval/toyeval/task_mean": (0.15, 0.2), "eval/toyeval/position/task/single_object": (nan, nan),
        "eval/toyeval/position/task/position": (0.5, 0.6), "eval/toyeval/position/task_mean": (0.5, 0.6),
        "diversity/gt_mean": (0.886, 0.873), "diversity/coverage_mean": (0.7, 0.6)}
    change = lambda gain, error: {"gain": gain, "standard_error": error,
                                  "standard_errors": gain / error if error else nan}
    return {"before": {k: b for k, (b, _) in values.items()}, "after": {k: a for k, (_, a) in values.items()},
            "paired": {"eval/toyeval/task_mean": change(0.05, 0.02),
                       "eval/toyeval/task/single_object": change(0.1, 0.05),
                       "eval/toyeval/task/position": change(0.0, 0.0),
                       "eval/toyeval/position/task/single_object": change(nan, nan),
                       "eval/toyeval/position/task/position": change(0.1, 0.04),
                       "eval/toyeval/position/task_mean": change(0.1, 0.04)},
            "prompts": 4, "images_per_prompt": 2, "prompts_per_task": {"single_object": 2, "position": 2}}


def test_summary_line_gives_the_task_mean_each_task_and_diversity_with_their_standard_errors(tmp_path):
    line = summary_line(_toy_results(), ["toyeval"], tmp_path / "report.html")
    # position's change has no spread (s.e. 0), so no number of standard errors
    assert line == ("toyeval held-out task mean 0.150 -> 0.200 (+0.050, 2.5 paired s.e.); "
                    "single_object 0.200 -> 0.300 (+0.100, 2.0 s.e.), position 0.100 -> 0.100 (+0.000); "
                    f"diversity 0.886 -> 0.873 (-0.013); report: {tmp_path / 'report.html'}")
    assert "\n" not in line


def test_summary_line_of_a_reward_without_tasks_gives_its_mean(tmp_path):
    results = {"before": {"eval/toyeval": 0.3, "eval/toyeval/color": 0.5},
               "after": {"eval/toyeval": 0.4, "eval/toyeval/color": 0.5}}
    report = tmp_path / "r.html"
    assert summary_line(results, [], report) == f"toyeval held-out 0.300 -> 0.400 (+0.100); report: {report}"
    assert summary_line(results, ["elsewhere"], report) == f"report: {report}"  # a trained key not scored here


def test_report_md_opens_with_the_headline_then_diversity_and_folds_the_rest():
    md = markdown_report(_toy_results(), 10, ["toyeval"])
    lines = md.split("\n")
    assert lines[:12] == [
        "# Run report", "",
        "| toyeval, held-out | before | after | change | paired s.e. |", "| --- | --- | --- | --- | --- |",
        "| task mean | 0.1500 | 0.2000 | +0.0500 (2.5 s.e.) | 0.0200 |",
        "| single_object | 0.2000 | 0.3000 | +0.1000 (2.0 s.e.) | 0.0500 |",
        "| position | 0.1000 | 0.1000 | +0.0000 | 0.0000 |", "",
        "| diversity (ground truth) | before | after | change |", "| --- | --- | --- | --- |",
        "| gt_mean | 0.8860 | 0.8730 | -0.0130 |", ""]
    folded = md[md.index("<details>"):md.index("</details>")]
    assert "| eval/toyeval/position/task/position | 0.5000 | 0.6000 | +0.1000 (2.5 s.e.) | 0.0400 |" in folded
    assert "| diversity/coverage_mean | 0.7000 | 0.6000 | -0.1000 |  |" in folded
    assert "eval/toyeval/task_mean" not in folded and "gt_mean" not in folded  # shown above
    assert "position/task/single_object" not in md  # NaN on both sides: the sub-score does not apply
    assert "paired standard errors" in md and "Prompts per task: single_object 2, position 2" in md


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.headings, self.labels, self.images, self._tag, self._class = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._tag.append(tag)
        self._class.append(attrs.get("class", ""))
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_endtag(self, tag):
        self._tag.pop()
        self._class.pop()

    def handle_data(self, data):
        if self._tag and self._tag[-1] == "h3" and data.strip():
            self.headings.append(data.strip())
        if self._class and self._class[-1] == "label":
            self.labels.append(data.strip())


def test_html_report_shows_labelled_grids_with_their_prompts(tmp_path):
    prompts = PromptSet(["a red square", "two blue circles"], [{"task": "single"}, {"task": "counting"}])
    before, after = torch.zeros(4, 3, 8, 8), torch.ones(4, 3, 8, 8)
    results = {"before": {"eval/toyeval": 0.3}, "after": {"eval/toyeval": 0.4}}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    curve = plot_reward_curve(tmp_path, ["toyeval"])
    page = html_report(tmp_path, results, prompts, before, after, 2, curve).read_text()
    parsed = _Page()
    parsed.feed(page)
    assert parsed.headings == ["a red square", "two blue circles"]
    assert parsed.labels == ["base", "trained", "base", "trained"]
    assert len(parsed.images) == 1 + 4 and all(src.startswith("data:image/png;base64,") for src in parsed.images)
    assert "+0.1000" in page and "<script" not in page and 'src="http' not in page


def test_videos_become_film_strips_of_their_frames_and_images_stay_as_they_are():
    from flowrl.core.media import stills

    video = torch.rand(2, 3, 3, 4, 5)  # [N, T, 3, H, W]
    strips = stills(video)
    assert strips.shape == (2, 3, 4, 15)
    torch.testing.assert_close(strips[1], torch.cat([video[1, 0], video[1, 1], video[1, 2]], dim=-1), rtol=0, atol=0)
    images = torch.rand(2, 3, 4, 5)
    assert stills(images) is images


class _Tables(HTMLParser):
    """Each <table> of a page as its rows of cell texts, and whether it sits in a folded <details> block."""

    def __init__(self):
        super().__init__()
        self.tables, self.folded, self._details, self._cell = [], [], 0, False

    def handle_starttag(self, tag, attrs):
        if tag == "details":
            self._details += 1
        elif tag == "table":
            self.tables.append([])
            self.folded.append(self._details > 0)
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
            self._cell = True

    def handle_endtag(self, tag):
        self._details -= tag == "details"
        self._cell = self._cell and tag not in ("td", "th")

    def handle_data(self, data):
        if self._cell:
            self.tables[-1][-1][-1] += data


def test_html_report_opens_with_the_headline_table_and_folds_the_rest(tmp_path):
    prompts = PromptSet(["a red square", "a cat left of a dog"], [{"task": "single_object"}, {"task": "position"}])
    page = html_report(tmp_path, _toy_results(), prompts, torch.zeros(4, 3, 8, 8), torch.ones(4, 3, 8, 8), 2, None,
                       trained=["toyeval"]).read_text()
    parsed = _Tables()
    parsed.feed(page)
    (headline, diversity, rest), folded = parsed.tables, parsed.folded
    assert headline == [["toyeval, held-out", "before", "after", "change", "paired s.e."],
                        ["task mean", "0.1500", "0.2000", "+0.0500 (2.5 s.e.)", "0.0200"],
                        ["single_object", "0.2000", "0.3000", "+0.1000 (2.0 s.e.)", "0.0500"],
                        ["position", "0.1000", "0.1000", "+0.0000", "0.0000"]]
    assert diversity == [["diversity (ground truth)", "before", "after", "change"],
                         ["gt_mean", "0.8860", "0.8730", "-0.0130"]]
    assert folded == [False, False, True]
    assert [row[0] for row in rest[1:]] == ["eval/toyeval", "eval/toyeval/position",
                                            "eval/toyeval/position/task/position", "eval/toyeval/position/task_mean",
                                            "diversity/coverage_mean"]
    assert page.index("toyeval, held-out") < page.index("Samples")


def test_before_and_after_grids_label_each_row_and_enlarge_small_tiles():
    """32 px tiles enlarged by whole factors (to at least 96 px), one row per prompt, the prompt written beside it:
    the grid is wider than its tiles' columns alone and taller than its rows."""
    import io

    from PIL import Image

    from flowrl.eval.report import labelled_grid

    images = torch.rand(2 * 4, 3, 32, 32)
    picture = Image.open(io.BytesIO(labelled_grid(images, ["a green triangle", "two purple circles"], 4, "after")))
    assert picture.width >= 4 * 96 + 60 and picture.height >= 2 * 96
    flat = torch.zeros(2 * 4, 3, 32, 32)  # an all-black tile leaves the prompt's text as the only ink left of it
    left = Image.open(io.BytesIO(labelled_grid(flat, ["a green triangle", "two purple circles"], 4, "after")))
    strip = torch.tensor(list(left.convert("L").crop((0, 0, 60, left.height)).getdata()))
    assert (strip < 128).any(), "no label left of the rows"
