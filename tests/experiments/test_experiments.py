"""The experiments runner (``python -m flowrl.experiments experiments/<table>.yaml``) without training the
toy comparisons: table cells over seeds read "mean ± s.e. (n)", a finished run is skipped and an interrupted
one cleared (or resumed where exact), the speed-up column divides grpo_full's time to its own final level by
each method's, every shipped experiment file names valid configs, and one tiny experiment runs end to end."""

import argparse
import json
from pathlib import Path

import pytest

from flowrl.config import Config, load_config
from flowrl.experiments.cells import fmt_mean_se
from flowrl.experiments.cli import main
from flowrl.experiments.runs import gather, is_finished, mark_finished, parse_seeds, prepare_run, seed_dir
from flowrl.experiments.spec import load_experiment
from flowrl.experiments.tables import TABLES, algorithms, collapse
from tests import REPO

SHIPPED = sorted(p for p in (REPO / "experiments").glob("*.yaml") if not p.name.startswith("_"))


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


def test_a_run_whose_config_file_changed_since_is_trained_again(tmp_path):
    """done.json holds a digest of the resolved config: the same arguments over an edited file (here the learning
    rate it sets) no longer count as finished; an edit that resolves to the same settings (a comment) does."""
    grpo = REPO / "configs/toy/grpo.yaml"
    config = tmp_path / "child.yaml"
    config.write_text(f"base: {grpo}\ntrain:\n  learning_rate: 0.001\n")
    arguments, run_dir = [str(config), "seed=0"], seed_dir(tmp_path, "run", 0)
    run_dir.mkdir()
    mark_finished(run_dir, arguments, 1.0)
    assert is_finished(run_dir, arguments)
    config.write_text(f"# a comment\nbase: {grpo}\ntrain:\n  learning_rate: 0.001\n")
    assert is_finished(run_dir, arguments)
    config.write_text(f"base: {grpo}\ntrain:\n  learning_rate: 0.002\n")
    assert not is_finished(run_dir, arguments) and is_finished(run_dir)  # finished, with other settings
    assert prepare_run(run_dir, arguments, exact_resume=False) == [] and not run_dir.exists()


def _curve(walls_means, base=0.3):
    """A held-out curve as the algorithms table reads one: the base point, then (wall-clock, task mean)s."""
    rest = {"diversity": 0.4, **dict.fromkeys(algorithms.TASKS, 0.5)}
    return [{"epoch": -1, "wall": 0.0, "rollouts": 0, "mean": base, **rest}] + [
        {"epoch": i, "wall": wall, "rollouts": 10 * (i + 1), "mean": mean, **rest}
        for i, (wall, mean) in enumerate(walls_means)]


def test_speed_up_to_grpo_final_level():
    runs = {"grpo_full": {0: _curve([(50, 0.4), (100, 0.5)]), 1: _curve([(50, 0.45), (100, 0.5)])},
            "nft": {0: _curve([(10, 0.6)]), 1: _curve([(20, 0.55)])},
            "awm": {0: _curve([(10, 0.35)])}}
    level, ratios = algorithms.speedups(runs)
    assert level == pytest.approx(0.5)
    assert ratios["grpo_full"]["wall"] == [1.0, 1.0]
    assert ratios["nft"]["wall"] == [10.0, 5.0] and ratios["nft"]["rollouts"] == [2.0, 2.0]
    assert ratios["awm"]["wall"] == [None]

    claims = load_experiment(REPO / "experiments/algorithms.yaml").params["claims"]
    params = {"gain": 0.02, "budget_s": 100.0, "parallel": 1, "test_prompts": 4, "images": 2, "top": 0,
              "claims": claims}
    table = "\n".join(algorithms.results_table(runs, params, "cmd", {}))
    nft = next(line for line in table.splitlines() if line.startswith("| nft |"))
    assert "7.50 ± 2.50 (2)" in nft and "up to 25x faster than Flow-GRPO" in nft
    awm = next(line for line in table.splitlines() if line.startswith("| awm |"))
    assert "not reached" in awm


def test_collapse_table_reads_when_background_diversity_halved(tmp_path):
    def point(epoch, background, proxy=0.5):
        return {"epoch": epoch, "test/toyeval/task_mean": 0.1, "test/toy_clip/task_mean": proxy,
                "test/diversity/gt_mean": 0.8, "test/diversity/background": background}

    runs = {"fast": [point(-1, 0.8), point(9, 0.41), point(19, 0.4), point(29, 0.1, 0.7)],  # 0.4 = half of 0.8
            "slow": [point(-1, 0.6), point(9, 0.5), point(19, 0.31)],
            "never": [point(-1, 0.8), point(9, 0.79)]}
    found = {}
    for name, records in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        found[name] = collapse.summary(tmp_path / name)
    assert [found[n]["halved"] for n in runs] == [20, None, None]  # epochs trained at that held-out point
    assert found["fast"]["epochs"] == 30 and found["fast"]["final"]["proxy"] == 0.7
    params = {"section": None, "epochs": 30, "parallel": 2, "test_prompts": 32, "images": 8}
    lines = collapse.table({"fast": {0: found["fast"], 1: found["never"]}, "never": {0: found["never"]}},
                           params, "cmd", "configs/toy/grpo_clip.yaml", tmp_path / "plot.png").splitlines()
    assert "30 epochs (2 CPU cores" in lines[4] and "optimised `toy_clip`" in lines[4]
    assert lines[8].startswith("| fast | 0,1 | 20 ± 10 (2) | 20 (1/2) |")
    assert lines[9].startswith("| never | 0 | 10 (1) | never |")


def test_top_methods_pick_the_best_finished_first_seed_runs(tmp_path):
    for name, final in (("nft", 0.6), ("awm", 0.5), ("grpo_full", 0.4), ("grpo_tree", 0.7)):
        run_dir = seed_dir(tmp_path, name, 0)
        run_dir.mkdir()
        records = [{"step": 0, "epoch": -1, "test/toyeval/task_mean": 0.3},
                   {"step": 1, "epoch": 0, "test/toyeval/task_mean": final}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if name != "grpo_tree":  # interrupted: not a candidate
            mark_finished(run_dir, [], 1.0)
    names = ["grpo_full", "grpo_tree", "nft", "awm"]
    assert algorithms.top_methods(tmp_path, names, 0, 1) == ["grpo_full", "nft"]  # + the reference
    assert algorithms.top_methods(tmp_path, names, 0, 2) == ["grpo_full", "nft", "awm"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_experiments_name_valid_runs(path, monkeypatch):
    """Every run of every experiment file, at every seed, is a config the loader accepts (the settings and
    overrides filled in), and its table kind exists."""
    monkeypatch.chdir(REPO)
    experiment = load_experiment(path)
    assert experiment.table in TABLES
    for name in [experiment.substitute(n) for n in experiment.runs]:
        config, *overrides = experiment.arguments(name, experiment.seeds[0])
        load_config(Config, config, overrides)


def test_dry_run_lists_every_run_and_trains_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["experiments/multi_reward.yaml", "--dry-run", "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    for name in ("weighted", "gdpo", "correlation", "marble"):
        for seed in (0, 1):
            assert f"{tmp_path}/{name}_s{seed}: to run" in listed
    assert "train.combine=marble train.marble.refresh_every=2" in listed
    assert "train.time_limit_s=180.0" in listed and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("methods", [["weighted", "gdpo"], ["weighted,gdpo"]])
def test_methods_are_space_or_comma_separated(tmp_path, monkeypatch, capsys, methods):
    monkeypatch.chdir(REPO)
    assert main(["experiments/multi_reward.yaml", "--dry-run", "--seeds", "0", "--out", str(tmp_path),
                 "--methods", *methods]) == 0
    listed = capsys.readouterr().out
    assert f"{tmp_path}/weighted_s0: to run" in listed and f"{tmp_path}/gdpo_s0: to run" in listed
    assert "marble_s0" not in listed and "correlation_s0" not in listed


def test_bad_flags_and_files_say_why_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["experiments/guard.yaml", "--top", "2", "--dry-run"]) == 2
    assert "--top does not apply" in capsys.readouterr().err
    assert main(["experiments/collapse.yaml", "--methods", "nope", "--dry-run"]) == 2
    assert "no run named nope" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "no experiment file" in capsys.readouterr().err
    assert main(["experiments/held_out_guard.yaml", "--seeds", "0", "1", "--dry-run"]) == 2  # '1' is no override
    err = capsys.readouterr().err
    assert "'1' is not an override" in err and "--seeds 0,1,2" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra, words", [
    ("sedes: [0, 1]\n", ["unknown key 'sedes'", "did you mean 'seeds'"]),
    ("colums: []\n", ["unknown key 'colums'", "did you mean 'columns'"]),
])
def test_an_unknown_key_of_an_experiment_file_is_one_line(tmp_path, monkeypatch, capsys, extra, words):
    monkeypatch.chdir(REPO)
    path = tmp_path / "exp.yaml"
    path.write_text("table: metrics\nout: " + str(tmp_path / "runs") + "\ncolumns: []\n"
                    "runs: {a: {config: configs/smoke/sd3_tiny.yaml}}\n" + extra)
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(word in err for word in words), err


def test_a_run_whose_config_is_missing_names_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    path = tmp_path / "exp.yaml"
    path.write_text(f"table: metrics\nout: {tmp_path / 'runs'}\ncolumns: []\n"
                    "runs: {a: {config: configs/nope.yaml}}\n")
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "run 'a': config file configs/nope.yaml not found" in err and len(err.strip().splitlines()) == 1, err


def test_tiny_experiment_runs_resumes_and_writes_its_table(tmp_path, monkeypatch, capsys):
    """One run of the tiny SD3 smoke config for one epoch: trained, tabulated, skipped on rerun; with its
    ``done.json`` gone (an interruption) a rerun would start it again."""
    monkeypatch.chdir(REPO)
    experiment = tmp_path / "tiny.yaml"
    experiment.write_text(
        f"table: metrics\nout: {tmp_path / 'runs'}\nresults: {tmp_path / 'results.md'}\ntitle: Tiny\n"
        "settings: [train.epochs=1, log.eval_every=0, log.report_prompts=0, log.progress=false, "
        "train.checkpoint_every=0]\n"
        "runs:\n  tiny: {config: configs/smoke/sd3_tiny.yaml, overrides: [sampling.group_size=2]}\n"
        "columns:\n  - {header: brightness, key: reward/brightness_mean, at: last}\n")
    assert main([str(experiment)]) == 0
    run_dir = tmp_path / "runs" / "tiny_s0"
    assert is_finished(run_dir)
    done = (run_dir / "done.json").read_text()
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("## Tiny") and "| run | seeds | brightness |" in table and "| tiny | 0 | 0." in table

    assert main([str(experiment)]) == 0  # finished: kept, not trained again
    assert (run_dir / "done.json").read_text() == done
    (run_dir / "done.json").unlink()
    capsys.readouterr()
    assert main([str(experiment), "--dry-run"]) == 0
    assert f"{run_dir}: interrupted, starting again" in capsys.readouterr().out


def test_the_front_table_reads_fixed_weights_from_configs_and_puts_both_fronts_side_by_side(tmp_path):
    import yaml

    from flowrl.experiments.tables import front

    run = tmp_path / "fixed_025_s0"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"rewards": [{"name": "toyeval", "weight": 0.25},
                                                                 {"name": "toy_proxy", "weight": 0.75}]}))
    assert front.trained_w1(run, ["toyeval", "toy_proxy"]) == 0.25
    p = {"slider": "slider", "rewards": ["toyeval", "toy_proxy"], "eval_suite": "held.jsonl", "eval_images": 8,
         "compute": "each fixed 28 epochs, the slider 140", "section": None}
    results = {"slider": {0: {0.25: {"toyeval": 0.5, "toy_proxy": 0.25}}, 1: {0.25: {"toyeval": 0.7, "toy_proxy": 0.35}}},
               "fixed_025": {0: {0.25: {"toyeval": 0.4, "toy_proxy": 0.2}}}}
    found = front.fronts(results, p)
    text = front.table(found, p, "python -m flowrl.experiments experiments/pareto_front.yaml")
    assert "| 0.25 | 0.600 ± 0.100 (2) | 0.400 (1) | 0.300 ± 0.050 (2) | 0.200 (1) |" in text
    front.plot(found, p, tmp_path / "front.png")
    assert (tmp_path / "front.png").stat().st_size > 0


def test_the_pareto_front_experiment_dry_runs(capsys):
    from flowrl.experiments.spec import load_experiment
    from flowrl.experiments.tables import TABLES

    exp = load_experiment("experiments/pareto_front.yaml")
    exp.dry_run = True
    assert TABLES[exp.table](exp) is None
    out = capsys.readouterr().out
    assert out.count("python -m flowrl train") == 18 and "--preference w1,1-w1" in out


def test_the_short_slider_experiment_reuses_the_fixed_runs_and_names_its_own_figure(capsys):
    from flowrl.experiments.spec import load_experiment
    from flowrl.experiments.tables import TABLES, front

    long, short = load_experiment("experiments/pareto_front.yaml"), load_experiment("experiments/pareto_front_short.yaml")
    assert short.params["slider"] == "slider_14" and short.params["figure"] == "results_front_14.png"
    assert short.out == long.out  # the fixed-weight runs are found trained, not trained again
    assert {name: run for name, run in short.runs.items() if name.startswith("fixed_")} == {
        name: run for name, run in long.runs.items() if name.startswith("fixed_")}
    assert front.is_slider_run(Path("out/slider_14_s2"), "slider_14")
    assert not front.is_slider_run(Path("out/slider_14_s2"), "slider")
    assert not front.is_slider_run(Path("out/slider_short_s0"), "slider")  # "slider_s" begins it: not the run
    assert not front.is_slider_run(Path("out/slider_s2"), "slider_14")
    short.dry_run = True
    assert TABLES[short.table](short) is None
    assert capsys.readouterr().out.count("python -m flowrl train") == 18
    gdpo = load_experiment("experiments/pareto_front_gdpo.yaml")  # the same slider, fixed models on z-scores
    assert gdpo.runs["slider_14"] == short.runs["slider_14"] and gdpo.out == long.out
    fixed = [run for name, run in gdpo.runs.items() if name != "slider_14"]
    assert len(fixed) == 5 and all("train.combine=gdpo" in run.overrides for run in fixed)


def test_table_only_over_runs_never_trained_is_one_line(tmp_path, capsys):
    code = main([str(REPO / "experiments/algorithms.yaml"), "--seeds", "0", "--out", str(tmp_path / "runs"),
                 "--results", str(tmp_path / "results.md"), "--table-only", "--methods", "nft"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "has no metrics.jsonl" in err and "--table-only" in err and "--tune-budget-s 0" in err
    assert not (tmp_path / "results.md").exists()


def test_a_rewritten_section_keeps_a_blank_line_before_the_next_heading(tmp_path):
    from flowrl.experiments.markdown import replace_section

    path = tmp_path / "results.md"
    path.write_text("## A\n\nold\n\n## B\n\nkept\n")
    replace_section(path, "## A\n\n| x |\n|---|\n| 1 |\n", "## A")
    assert path.read_text() == "## A\n\n| x |\n|---|\n| 1 |\n\n## B\n\nkept\n"
    replace_section(path, "## B\n\nnew\n", "## B")  # the last section
    assert path.read_text().endswith("| 1 |\n\n## B\n\nnew\n\n")
