"""The end-of-run report's pieces: the moving average, which series the curve draws, the summary line,
and report.html's structure (labelled grids with the prompt text, the before/after table, the curve)."""

import json
import math
from html.parser import HTMLParser

import torch

from flowrl.data import PromptSet
from flowrl.eval.report import curve_keys, html_report, moving_average, plot_reward_curve, summary_line


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


def test_summary_line_names_the_trained_score_its_change_and_its_standard_errors(tmp_path):
    results = {"before": {"eval/toyeval": 0.3, "eval/toyeval/task_mean": 0.25, "diversity/gt_mean": 0.7},
               "after": {"eval/toyeval": 0.4, "eval/toyeval/task_mean": 0.35, "diversity/gt_mean": 0.6},
               "paired": {"eval/toyeval/task_mean": {"gain": 0.1, "standard_error": 0.04, "standard_errors": 2.5}}}
    line = summary_line(results, ["toyeval"], tmp_path / "report.html")
    assert line.startswith("toyeval (held-out task mean) 0.250 -> 0.350 (+0.100, 2.5 paired s.e.)")
    assert "diversity 0.700 -> 0.600" in line and line.endswith(f"report: {tmp_path / 'report.html'}")
    results["paired"]["eval/toyeval/task_mean"]["standard_errors"] = math.nan
    assert "s.e." not in summary_line(results, ["toyeval"], tmp_path / "r.html")


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
    from flowrl.media import stills

    video = torch.rand(2, 3, 3, 4, 5)  # [N, T, 3, H, W]
    strips = stills(video)
    assert strips.shape == (2, 3, 4, 15)
    torch.testing.assert_close(strips[1], torch.cat([video[1, 0], video[1, 1], video[1, 2]], dim=-1), rtol=0, atol=0)
    images = torch.rand(2, 3, 4, 5)
    assert stills(images) is images
