"""Fault containment (flowrl/training/faults.py): non-finite steps skipped then a stop, all-NaN reward epochs,
a reward server that dies or trickles its reply forever, a full disk while checkpointing. Each stop is one line,
exits non-zero and leaves the last checkpoint intact and resumable."""

import errno
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flowrl.recipes.grpo as grpo
import flowrl.training.checkpoint as checkpoint
from flowrl.cli import main
from flowrl.core.safe_io import check_checkpoint
from flowrl.training.checkpoint import resolve_checkpoint
from tests.fault_helpers import TINY_TRAIN, remote_spec, reward_server, small_disk, trickle_server


def train(run_dir, *extra, capsys=None):
    """flowrl train in-process -> (exit code, the stderr lines that are errors); stdout kept in OUT[0]."""
    code = main(["train", *TINY_TRAIN, f"run_dir={run_dir}", *extra])
    captured = capsys.readouterr()
    OUT[:] = [captured.out]
    return code, [line for line in captured.err.splitlines() if ": error: " in line or "Traceback" in line]


OUT = [""]


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def lora(path):
    return load_file(str(Path(path) / "lora.safetensors"))


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("FLOWRL_DEBUG", raising=False)


@pytest.fixture
def nan_loss_in(monkeypatch):
    """nan_loss_in({2, 3}): the GRPO loss is NaN in those epochs (a diverged step), normal elsewhere."""
    state = {"epoch": 0, "bad": set()}
    real_loss, real_end = grpo.transition_loss, grpo.end_epoch

    def loss(*args, **kwargs):
        value = real_loss(*args, **kwargs)
        return value * float("nan") if state["epoch"] in state["bad"] else value

    def end_epoch(run, epoch, **kwargs):
        state["epoch"] = epoch + 1
        return real_end(run, epoch, **kwargs)

    monkeypatch.setattr(grpo, "transition_loss", loss)
    monkeypatch.setattr(grpo, "end_epoch", end_epoch)
    return lambda epochs: state["bad"].update(epochs)


def test_nan_steps_are_skipped_then_the_run_stops_with_the_weights_intact(tmp_path, capsys, nan_loss_in):
    nan_loss_in({2, 3, 4})
    code, errors = train(tmp_path, "train.epochs=6", "train.checkpoint_every=1", "train.max_skipped_steps=3",
                         "train.keep_checkpoints=9", capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "3 optimizer steps in a row had a non-finite gradient" in errors[0] and "train.resume=latest" in errors[0]
    rows = metrics(tmp_path)
    assert [r["faults/skipped_steps"] for r in rows] == [0, 0, 1, 2]  # epoch 4 aborts before it is logged
    ckpts = tmp_path / "checkpoints"
    assert resolve_checkpoint(tmp_path).name == "step_000003"  # nothing after the stop
    good, skipped = lora(ckpts / "step_000001"), lora(ckpts / "step_000003")
    assert all(torch.isfinite(v).all() for v in skipped.values())
    assert all(torch.equal(good[k], skipped[k]) for k in good)  # skipped steps leave the weights untouched
    assert not torch.equal(lora(ckpts / "step_000000")[next(iter(good))], good[next(iter(good))])  # it did train


def test_a_lone_nan_step_is_survived(tmp_path, capsys, nan_loss_in):
    nan_loss_in({1})
    code, errors = train(tmp_path, "train.epochs=3", capsys=capsys)
    assert code == 0 and not errors
    assert [r["faults/skipped_steps"] for r in metrics(tmp_path)] == [0, 1, 1]
    exported = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert all(torch.isfinite(v).all() for v in exported.values())


def test_every_reward_nan_stops_after_max_nan_epochs(tmp_path, capsys):
    code, errors = train(tmp_path, "train.epochs=5", "train.checkpoint_every=1", "train.max_nan_epochs=2",
                         "rewards=[{name: 'tests.fault_helpers:AllNan'}]", capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "reward 'all_nan' scored every image NaN" in errors[0] and "2 epochs in a row" in errors[0]
    assert OUT[0].count("warning: epoch 0: reward 'all_nan' scored every image NaN") == 1
    assert [r["faults/nan_reward_epochs"] for r in metrics(tmp_path)] == [1, 2]
    assert resolve_checkpoint(tmp_path).name == "step_000000"  # the aborting epoch saved nothing
    assert not (tmp_path / "lora").exists()  # and exported nothing as if it had succeeded


def test_a_logged_only_reward_that_fails_never_reaches_the_training_signal(tmp_path, capsys):
    """A weight-0 reward scoring every image NaN leaves the trained reward's advantages as they are: the run trains
    (a nonzero gradient), warns of nothing, and logs the failures as the logged reward's NaN count."""
    code, errors = train(tmp_path, "train.epochs=2",
                         "rewards=[{name: 'tests.reward_fixtures:RedMinusBlue'}, "
                         "{name: 'tests.fault_helpers:AllNan', weight: 0.0}]", capsys=capsys)
    assert code == 0 and not errors
    assert "warning:" not in OUT[0]
    rows = metrics(tmp_path)
    assert all(row["optim/grad_norm"] > 0 and row["reward/all_nan_nan"] == 2 for row in rows)
    assert all(row["reward/combined_mean"] == row["reward/redness_mean"] for row in rows)


def test_an_infinite_reward_counts_as_unscored(tmp_path, capsys):
    """+inf is dropped as NaN is, and counted as such: logged in reward/<name>_nan and toward train.max_nan_epochs."""
    code, errors = train(tmp_path, "train.epochs=3", "train.max_nan_epochs=2",
                         "rewards=[{name: 'tests.fault_helpers:AllInf'}]", capsys=capsys)
    assert code == 2 and len(errors) == 1 and "reward 'all_inf' scored every image NaN" in errors[0], errors
    assert [r["reward/all_inf_nan"] for r in metrics(tmp_path)] == [2, 2]


def test_online_dpo_with_no_pair_warns_each_epoch_and_stops_after_max_nan_epochs(tmp_path, capsys):
    """Every group tied: online DPO has no (winner, loser) pair and trains nothing. The run says so each epoch and
    stops after train.max_nan_epochs such epochs, as it does when every reward is NaN, instead of exiting 0."""
    code, errors = train(tmp_path, "recipe=nft", "nft.loss=dpo", "train.epochs=4", "train.checkpoint_every=1",
                         "train.max_nan_epochs=2", "rewards=[{name: 'tests.fault_helpers:Constant'}]", capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "nft.loss=dpo found no preference pair" in errors[0] and "2 epochs in a row" in errors[0]
    assert OUT[0].count("warning: epoch 0: nft.loss=dpo found no preference pair") == 1
    assert [r["dpo/pairs"] for r in metrics(tmp_path)] == [0, 0]


def test_resuming_a_finished_run_says_it_is_complete_and_rebuilds_nothing(tmp_path, capsys):
    """No empty progress bar, no report rendered again, no "0 epochs": one line pointing at the report."""
    run = ["train", *TINY_TRAIN[:1], *[a for a in TINY_TRAIN[1:] if not a.startswith("log.report_prompts")],
           f"run_dir={tmp_path}", "train.epochs=1", "log.report_prompts=2", "log.eval_images_per_prompt=1"]
    assert main(run) == 0
    first = capsys.readouterr().out
    assert "writing the report: 2 held-out prompts x 1 images" in first
    report = (tmp_path / "report.json").stat().st_mtime_ns
    assert main([*run, "train.resume=latest"]) == 0
    out = capsys.readouterr().out
    assert f"the run in {tmp_path} is complete (1 epochs); its report: {tmp_path / 'report.html'}" in out, out
    assert "writing the report" not in out and (tmp_path / "report.json").stat().st_mtime_ns == report


def test_one_nan_epoch_warns_in_one_line_and_the_run_goes_on(tmp_path, capsys):
    code, errors = train(tmp_path, "train.epochs=1", "train.max_nan_epochs=2",
                         "rewards=[{name: 'tests.fault_helpers:AllNan'}]", capsys=capsys)
    assert code == 0 and not errors
    warnings = [line for line in OUT[0].splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "reward 'all_nan' scored every image NaN" in warnings[0]
    assert metrics(tmp_path)[0]["faults/nan_reward_epochs"] == 1


def test_a_server_that_dies_under_reward_errors_nan_stops_the_run(tmp_path, capsys):
    with reward_server("dies", serve_first=1) as url:  # epoch 0 scores, then HTTP 503 for good
        code, errors = train(tmp_path, "train.epochs=6", "train.checkpoint_every=1", "train.reward_errors=nan",
                             remote_spec(url), capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "reward 'judge' scored every image NaN" in errors[0]
    rows = metrics(tmp_path)
    assert len(rows) == 3 and rows[0]["reward/judge_nan"] == 0 and rows[2]["reward/judge_nan"] == 2
    assert resolve_checkpoint(tmp_path).name == "step_000001"
    check_checkpoint(resolve_checkpoint(tmp_path))


def test_a_server_that_dies_under_reward_errors_raise_is_one_line_after_bounded_retries(tmp_path, capsys):
    with reward_server("dies", serve_first=1) as url:
        code, errors = train(tmp_path, "train.epochs=4", "train.checkpoint_every=1", remote_spec(url),
                             capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "remote reward 'judge'" in errors[0] and "failed after 2 attempts: HTTP 503" in errors[0]
    assert resolve_checkpoint(tmp_path).name == "step_000000"
    check_checkpoint(tmp_path / "checkpoints" / "step_000000")


def test_a_trickling_server_under_reward_errors_nan_stops_the_run_within_its_deadlines(tmp_path, capsys, caplog):
    """A judge sending one byte every 0.05 s never trips timeout=2; deadline=0.5 ends each of the 2 attempts,
    each epoch scores NaN, and max_nan_epochs=2 stops the run. Without the deadline each attempt would last
    the server's give_up (5 s): 2 epochs x 2 attempts x 5 s = 20 s."""
    deadline, retries, nan_epochs = 0.5, 2, 2
    with trickle_server("body", interval=0.05, give_up=5.0) as srv:
        start = time.monotonic()
        code, errors = train(tmp_path, "train.epochs=6", "train.reward_errors=nan",
                             f"train.max_nan_epochs={nan_epochs}",
                             remote_spec(srv.url, timeout=2.0, deadline=deadline, max_retries=retries),
                             capsys=capsys)
        elapsed = time.monotonic() - start
        assert srv.connections == retries * nan_epochs
    assert code == 2 and len(errors) == 1, errors
    assert "reward 'judge' scored every image NaN" in errors[0] and f"{nan_epochs} epochs in a row" in errors[0]
    assert [r["reward/judge_nan"] for r in metrics(tmp_path)] == [2, 2]
    said = [r.getMessage() for r in caplog.records if "reward 'judge' failed" in r.getMessage()]
    assert len(said) == nan_epochs and all(f"timed out after {retries} attempts" in m and
                                           f"deadline={deadline}s per attempt" in m for m in said), said
    budget = deadline * retries * nan_epochs  # 2 s of waiting on the judge; backoff is 0
    assert budget <= elapsed < budget + 8.0, elapsed  # slack: building the tiny model and two tiny epochs


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_resumes(tmp_path, capsys, monkeypatch):
    real_save, calls = checkpoint.save_file, []

    def save_file(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if "step_000001" in filename and filename.endswith("lora.safetensors"):
            Path(filename).write_bytes(b"half a file")  # the disk filled mid-write
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    code, errors = train(tmp_path, "train.epochs=3", "train.checkpoint_every=1", capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "No space left on device" in errors[0] and "step_000000, is intact" in errors[0]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000"]  # the .tmp_ dir is gone
    assert (ckpts / "latest").read_text().strip() == "step_000000"
    check_checkpoint(ckpts / "step_000000")

    monkeypatch.setattr(checkpoint, "save_file", real_save)  # space freed: resume where it stopped
    (ckpts / ".tmp_step_000007").mkdir()  # a crashed save's leftover is ignored, then cleaned
    code, errors = train(tmp_path, "train.epochs=3", "train.checkpoint_every=1", "train.resume=latest",
                         capsys=capsys)
    assert code == 0 and not errors
    assert [r["epoch"] for r in metrics(tmp_path)] == [0, 1, 2]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000", "step_000001", "step_000002"]


def test_a_real_full_disk_while_checkpointing_stops_in_one_line_and_resumes(tmp_path, capsys, monkeypatch):
    """No mocked writer: the run directory is a 1 MiB tmpfs, filled with a ballast file just before the second
    checkpoint so that half of the first checkpoint's size is left. Whichever writer hits the full disk (torch's
    zip writer raises RuntimeError, safetensors its own error, open() OSError), the run stops the same way."""
    with small_disk(tmp_path / "disk", 1024) as disk:
        run_dir, real_save = disk / "run", checkpoint.save_checkpoint
        ckpts = run_dir / "checkpoints"

        def save_checkpoint(directory, step, **kwargs):
            if step == 1:
                first = sum(f.stat().st_size for f in (ckpts / "step_000000").iterdir())
                (disk / "ballast").write_bytes(bytes(max(shutil.disk_usage(disk).free - first // 2, 0)))
            return real_save(directory, step, **kwargs)

        monkeypatch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
        code, errors = train(run_dir, "train.epochs=3", "train.checkpoint_every=1", capsys=capsys)
        assert code == 2 and len(errors) == 1, errors  # one line, no traceback
        first = sum(f.stat().st_size for f in (ckpts / "step_000000").iterdir())
        found = re.search(r"a checkpoint needs about ([\d.]+) KiB free and ([\d.]+) KiB is free now", errors[0])
        assert found, errors[0]
        assert found.group(1) == f"{first / 1024:.1f}" and float(found.group(2)) < float(found.group(1))
        assert f"could not write checkpoint step_000001 under {ckpts}: " in errors[0]
        assert f"the last checkpoint, {ckpts / 'step_000000'}, is intact" in errors[0]
        assert errors[0].endswith("resume from it with train.resume=latest")
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000000"]  # no .tmp_* left behind
        assert (ckpts / "latest").read_text().strip() == "step_000000"
        check_checkpoint(ckpts / "step_000000")

        (disk / "ballast").unlink()  # space freed: resume where it stopped
        monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
        code, errors = train(run_dir, "train.epochs=3", "train.checkpoint_every=1", "train.resume=latest",
                             capsys=capsys)
        assert code == 0 and not errors
        assert [r["epoch"] for r in metrics(run_dir)] == [0, 1, 2]
        assert (ckpts / "latest").read_text().strip() == "step_000002"


def test_nan_epochs_in_a_row_count_across_a_resume(tmp_path, capsys):
    nan = "rewards=[{name: 'tests.fault_helpers:AllNan'}]"
    code, errors = train(tmp_path, "train.epochs=1", "train.max_nan_epochs=2", nan, capsys=capsys)
    assert code == 0 and not errors  # one NaN epoch: a warning, then the final checkpoint
    code, errors = train(tmp_path, "train.epochs=2", "train.max_nan_epochs=2", "train.resume=latest", nan,
                         capsys=capsys)
    assert code == 2 and len(errors) == 1, errors  # the second in a row, although the first was before the restart
    assert "2 epochs in a row through epoch 1" in errors[0]
    assert [r["faults/nan_reward_epochs"] for r in metrics(tmp_path)] == [1, 2]
    assert resolve_checkpoint(tmp_path).name == "step_000000"


def test_skipped_steps_count_across_a_resume(tmp_path, capsys, nan_loss_in):
    nan_loss_in({1, 2, 3})  # the fixture's epoch carries over to the resumed run, which starts at epoch 2
    code, errors = train(tmp_path, "train.epochs=2", "train.max_skipped_steps=3", capsys=capsys)
    assert code == 0 and not errors
    code, errors = train(tmp_path, "train.epochs=4", "train.max_skipped_steps=3", "train.resume=latest",
                         capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "3 optimizer steps in a row had a non-finite gradient" in errors[0]
    assert [r["faults/skipped_steps"] for r in metrics(tmp_path)] == [0, 1, 2]  # the total goes on too


def test_learning_rate_inf_is_rejected_at_load(tmp_path, capsys):
    code, errors = train(tmp_path / "run", "train.learning_rate=inf", capsys=capsys)
    assert code == 2 and "train.learning_rate" in errors[0] and "finite" in errors[0]
    assert not (tmp_path / "run").exists()


def test_metrics_resume_drops_only_a_torn_last_line(tmp_path, caplog):
    from flowrl.training.metrics import MetricsLogger, read_metrics

    log = MetricsLogger(tmp_path)
    for step in range(3):
        log.log({"loss": 0.5 + step}, step=step)
    whole = (tmp_path / "metrics.jsonl").read_text()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    log.truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(whole.splitlines(keepends=True)[:2])
    assert "partial line" in caplog.text


def test_metrics_damaged_before_the_last_line_is_one_line_naming_it(tmp_path):
    from flowrl.training.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a metrics record"):
        MetricsLogger(tmp_path).truncate_after(5)
