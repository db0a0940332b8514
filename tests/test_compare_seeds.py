"""The toy comparison scripts' seeds and resume, without training anything: table cells over seeds read
"mean ± s.e. (n)", a finished run is skipped and an interrupted one cleared (or resumed where exact), and the
speed-up column divides grpo_full's time to its own final level by each method's."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import compare_algorithms  # noqa: E402
from seeded_runs import (fmt_mean_se, gather, is_finished, mark_finished, parse_seeds, prepare_run,  # noqa: E402
                         seed_dir)


def test_mean_and_standard_error_over_seeds():
    assert fmt_mean_se([0.4, 0.42, 0.44]) == "0.420 ± 0.012 (3)"  # stdev 0.02 / sqrt(3)
    assert fmt_mean_se([0.412]) == "0.412 (1)"
    assert fmt_mean_se([0.01, 0.03], "+.3f") == "+0.020 ± 0.010 (2)"
    assert fmt_mean_se([120.0, None, float("nan")], ".0f") == "120 (1/3)"  # never reached: left out, counted
    assert fmt_mean_se([None, None], missing="never") == "never"


def test_seeds_argument():
    assert parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("a,b", "", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seeds(bad)


def test_finished_runs_are_skipped_and_interrupted_ones_cleared(tmp_path):
    arguments = ["configs/toy/grpo.yaml", "seed=1"]
    finished, interrupted, stale = (seed_dir(tmp_path, name, 1) for name in ("done", "cut", "old"))
    for run_dir in (finished, interrupted, stale):
        (run_dir / "lora").mkdir(parents=True)
    mark_finished(finished, arguments, 3.0)
    mark_finished(stale, ["configs/toy/grpo.yaml", "seed=0"], 3.0)

    assert prepare_run(finished, arguments, exact_resume=False) is None  # kept as it is
    assert (finished / "lora").is_dir()
    for run_dir in (interrupted, stale):  # half a run, or one with other settings: started again from nothing
        assert prepare_run(run_dir, arguments, exact_resume=False) == []
        assert not run_dir.exists()
    assert prepare_run(tmp_path / "new_s1", arguments, exact_resume=False) == []

    resumable = seed_dir(tmp_path, "ckpt", 1)
    (resumable / "checkpoints" / "epoch_4").mkdir(parents=True)
    (resumable / "checkpoints" / "epoch_4" / "trainer_state.json").write_text("{}")
    assert prepare_run(resumable, arguments, exact_resume=True) == ["train.resume=latest"]
    assert resumable.exists()
    assert prepare_run(resumable, arguments, exact_resume=False) == [] and not resumable.exists()

    assert is_finished(finished) and not is_finished(interrupted)
    found = gather(tmp_path, {"done": [0, 1], "cut": [1]}, lambda run_dir: run_dir.name)
    assert found == {"done": {1: "done_s1"}}


def _curve(walls_means, base=0.3):
    """A held-out curve as compare_algorithms.curve reads one: the base point, then (wall-clock, task mean)s."""
    rest = {"diversity": 0.4, **dict.fromkeys(compare_algorithms.TASKS, 0.5)}
    return [{"epoch": -1, "wall": 0.0, "rollouts": 0, "mean": base, **rest}] + [
        {"epoch": i, "wall": wall, "rollouts": 10 * (i + 1), "mean": mean, **rest}
        for i, (wall, mean) in enumerate(walls_means)]


def test_speed_up_to_grpo_final_level():
    runs = {"grpo_full": {0: _curve([(50, 0.4), (100, 0.5)]), 1: _curve([(50, 0.45), (100, 0.5)])},
            "nft": {0: _curve([(10, 0.6)]), 1: _curve([(20, 0.55)])},
            "awm": {0: _curve([(10, 0.35)])}}
    level, ratios = compare_algorithms.speedups(runs)
    assert level == pytest.approx(0.5)
    assert ratios["grpo_full"]["wall"] == [1.0, 1.0]
    assert ratios["nft"]["wall"] == [10.0, 5.0] and ratios["nft"]["rollouts"] == [2.0, 2.0]
    assert ratios["awm"]["wall"] == [None]

    args = argparse.Namespace(gain=0.02, budget_s=100.0, parallel=1, test_prompts=4, images=2, top=0)
    table = "\n".join(compare_algorithms.results_table(runs, args, "cmd", {}))
    nft = next(line for line in table.splitlines() if line.startswith("| nft |"))
    assert "7.50 ± 2.50 (2)" in nft and "up to 25x faster than Flow-GRPO" in nft
    awm = next(line for line in table.splitlines() if line.startswith("| awm |"))
    assert "not reached" in awm


def test_top_methods_pick_the_best_finished_first_seed_runs(tmp_path):
    import json

    for name, final in (("nft", 0.6), ("awm", 0.5), ("grpo_full", 0.4), ("grpo_tree", 0.7)):
        run_dir = seed_dir(tmp_path, name, 0)
        run_dir.mkdir()
        records = [{"step": 0, "epoch": -1, "test/toyeval/task_mean": 0.3},
                   {"step": 1, "epoch": 0, "test/toyeval/task_mean": final}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if name != "grpo_tree":  # interrupted: not a candidate
            mark_finished(run_dir, [], 1.0)
    names = ["grpo_full", "grpo_tree", "nft", "awm"]
    assert compare_algorithms.top_methods(tmp_path, names, 0, 1) == ["grpo_full", "nft"]  # + the reference
    assert compare_algorithms.top_methods(tmp_path, names, 0, 2) == ["grpo_full", "nft", "awm"]
