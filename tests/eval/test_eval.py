"""``flowrl eval`` end to end on the toy model: one tiny training run and two evals shared by every test.

What is held: results.json (every checkpoint, the base added, its metrics and deltas), same seeds (the base
images of two evals and a zero LoRA's images are identical bit for bit), resuming (only deleted images are
rendered again, to the same bytes), re-rendering when the settings change, the checkpoint specs and their
one-line errors, FID/KID against a reference directory, the style axis, report.html's structure, and the
report as headless Chromium renders it (skipped without chromium).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests import REPO
from tests.two_processes import TWO_PROCESSES, launch_failure

CONFIG = "configs/toy/nft.yaml"
TOY_SUITE = REPO / "assets/benchmarks/toy_diversity.jsonl"
# Four toy prompts over three tasks; each leaves layout, tonal or both free.
SUITE_LINES = (0, 1, 6, 12)
SUITE_AXES = (["layout", "tonal"], ["layout"], ["tonal"], ["layout", "tonal"])
N = 3  # eval.images_per_prompt
STEPS = 4  # eval.num_steps: few, to keep the file fast


def _records(axes=SUITE_AXES) -> list[dict]:
    lines = TOY_SUITE.read_text().splitlines()
    records = [json.loads(lines[i]) for i in SUITE_LINES]
    for record, free in zip(records, axes):
        record["metadata"]["axes"] = list(free)
    return records


def _write_suite(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _overrides(world, **extra) -> list[str]:
    settings = {"run_dir": world.run, "eval.suite": world.suite, "eval.images_per_prompt": N, "eval.num_steps": STEPS,
                "eval.batch_prompts": 2, **extra}
    return [f"{k}={v}" for k, v in settings.items()]


def _eval(world, checkpoints, out, **extra) -> dict:
    from flowrl.eval.runner import run_eval

    report = run_eval(CONFIG, _overrides(world, **extra), list(checkpoints), str(out))
    assert report == Path(out) / "report.html"
    return json.loads((Path(out) / "results.json").read_text())


def _pngs(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.png"))}


def _zero_b_lora(source: Path, out: Path) -> Path:
    """The run's exported LoRA with every B matrix zeroed: a no-op adapter."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(source))
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in state.items()}, str(out))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from flowrl.commands.train import run_train

    cwd = os.getcwd()
    os.chdir(REPO)  # the configs name the toy model by a path relative to the repository
    try:
        root = tmp_path_factory.mktemp("eval")
        run = root / "run"
        run_train(CONFIG, [f"run_dir={run}", "train.epochs=2", "sampling.prompts_per_batch=4", "sampling.group_size=4",
                           "log.eval_every=0", "log.test_every=0", "log.report_prompts=0", "log.progress=false",
                           "train.checkpoint_every=1"])  # no held-out curve: its base point alone took most of the fixture
        bare = root / "bare"
        bare.mkdir()  # outside the run: no config.yaml records the model of these files
        zero = _zero_b_lora(run / "lora/pytorch_lora_weights.safetensors", bare / "zero.safetensors")
        world = SimpleNamespace(root=root, run=run, zero=zero, bare=bare,
                                suite=_write_suite(root / "suite.jsonl", _records()),
                                prompts=[r["prompt"] for r in _records()], eval1=root / "eval1", eval2=root / "eval2")
        world.checkpoints1 = [f"trained={run}", f"ema={run}:ema", f"trained={run}/checkpoints/step_000000"]
        world.results1 = _eval(world, world.checkpoints1, world.eval1)  # two "trained": the second is trained-2
        # another list: the base last, rendered with an adapter attached and switched off
        world.results2 = _eval(world, [f"zero={zero}", "base"], world.eval2)
        yield world
    finally:
        os.chdir(cwd)


# --- results.json ------------------------------------------------------------------------------------
def test_results_have_every_checkpoint_and_metric(world):
    r = world.results1
    assert list(r["checkpoints"]) == ["base", "trained", "ema", "trained-2"]
    assert r["base"] == "base" and r["checkpoints"]["base"] == {"path": None, "ema": False}
    assert r["checkpoints"]["trained"] == {"path": str(world.run / "lora"), "ema": False}
    assert r["checkpoints"]["ema"] == {"path": str(world.run / "checkpoints/step_000001"), "ema": True}
    assert r["checkpoints"]["trained-2"] == {"path": str(world.run / "checkpoints/step_000000"), "ema": False}
    assert r["prompts"] == world.prompts and world.results2["prompts"] == world.prompts
    assert r["tasks"] == ["single_object", "single_object", "counting", "two_object"]
    assert (r["images_per_prompt"], r["seed"]) == (N, 4242) and world.results2["seed"] == 4242
    for label, values in r["metrics"].items():
        for key in ("reward/toyeval", "held_out/toy_proxy", "held_out/toyeval/partial", "reward/toyeval/task_mean",
                    "diversity/cosine", "diversity/vendi", "diversity/latent_gmd", "axis/layout", "axis/tonal",
                    "toy/gt_mean"):
            assert key in values, (label, key)
        assert 0 <= values["reward/toyeval"] <= 1 and 1 <= values["diversity/vendi"] <= N
        assert not any(k.startswith(("axis/style", "axis/identity", "fid/")) for k in values)
    assert r["not_measured"] == [] and r["unreliable"] == []
    assert r["trained_rewards"] == ["toyeval"]


def test_reward_changes_carry_their_paired_standard_error(world):
    """Every checkpoint renders each prompt on the same seeds as the base: a reward's change gets the s.e. of the
    per-image differences, equal to the change of the means, and the report shows it beside the change."""
    r = world.results1
    assert set(r["paired"]) == {"trained", "ema", "trained-2"}
    for label, pairs in r["paired"].items():
        for key in ("reward/toyeval", "held_out/toy_proxy", "reward/toyeval/task_mean"):
            pair = pairs[key]
            assert pair["gain"] == pytest.approx(r["deltas"][label][key], abs=1e-9), (label, key)
            assert pair["standard_error"] >= 0 and "standard_errors" in pair
    html = (world.eval1 / "report.html").read_text()
    assert " s.e.)" in html and "+-1 of it" in html


def test_deltas_are_metric_minus_base(world):
    r = world.results1
    base = r["metrics"]["base"]
    assert set(r["deltas"]) == {"trained", "ema", "trained-2"}
    for label, deltas in r["deltas"].items():
        values = r["metrics"][label]
        expected = {k for k, v in values.items() if v == v and base.get(k) == base.get(k) and k in base}
        assert set(deltas) == expected
        for key, change in deltas.items():
            assert change == pytest.approx(values[key] - base[key], abs=1e-12)


def test_axis_scores_match_the_images_on_disk(world):
    """axis/layout averages layout_spread over the prompts that leave layout free (0, 1, 3), not prompt 2."""
    from flowrl.eval.runner import read_images
    from flowrl.eval.suites import layout_spread, tonal_spread

    images, _ = read_images(world.eval1 / "images/trained", 4, N)
    groups = torch.arange(4).repeat_interleave(N)
    layout, tonal = layout_spread(images, groups), tonal_spread(images, groups)
    metrics = world.results1["metrics"]["trained"]
    assert metrics["axis/layout"] == pytest.approx(float(torch.nanmean(layout[[0, 1, 3]])), rel=1e-5)
    assert metrics["axis/tonal"] == pytest.approx(float(torch.nanmean(tonal[[0, 2, 3]])), rel=1e-5)


# --- same seeds --------------------------------------------------------------------------------------
def test_base_images_identical_across_evals(world):
    first, second = _pngs(world.eval1 / "images/base"), _pngs(world.eval2 / "images/base")
    assert len(first) == 4 * N and first == second
    assert _pngs(world.eval1 / "images/trained") != first  # the trained LoRA does change the images


def test_zero_lora_renders_the_base_images(world):
    r = world.results2
    assert list(r["checkpoints"]) == ["zero", "base"]
    base = _pngs(world.eval2 / "images/base")
    assert _pngs(world.eval2 / "images/zero") == base
    for key, value in r["metrics"]["zero"].items():
        assert value == pytest.approx(r["metrics"]["base"][key], nan_ok=True), key


# --- resume ------------------------------------------------------------------------------------------
def _count_renders(monkeypatch) -> list[list[str]]:
    import flowrl.eval.held_out as held_out

    calls, original = [], held_out.render

    def counting(policy, prompts, **kwargs):
        calls.append(list(prompts.prompts))
        return original(policy, prompts, **kwargs)

    monkeypatch.setattr(held_out, "render", counting)
    return calls


def test_resume_renders_only_missing_images(world, tmp_path, monkeypatch):
    """Deleted images are rendered again with their batch (eval.batch_prompts=2: prompts 2-3), nothing else,
    to the same bytes, so the results are those of the first run exactly."""
    out = tmp_path / "eval"
    shutil.copytree(world.eval1, out)
    folder = out / "images/trained"
    original = {**_pngs(folder), **{f.name: f.read_bytes() for f in folder.glob("*.safetensors")}}
    for name in ("p0003_00.png", "p0003_02.png"):
        (folder / name).unlink()
    mtimes = {f: f.stat().st_mtime_ns for f in (out / "images").rglob("*") if f.is_file()}
    calls = _count_renders(monkeypatch)
    results = _eval(world, world.checkpoints1, out)
    assert calls == [world.prompts[2:4]]  # one render: the batch of the deleted images
    changed = {f.relative_to(out / "images").as_posix() for f, t in mtimes.items() if f.stat().st_mtime_ns != t}
    assert changed == {"trained/manifest.json", "trained/p0003_01.png", "trained/p0002_00.png",
                       "trained/p0002_01.png", "trained/p0002_02.png", "trained/p0002.latents.safetensors",
                       "trained/p0003.latents.safetensors"}
    assert {**_pngs(folder), **{f.name: f.read_bytes() for f in folder.glob("*.safetensors")}} == original
    _assert_same_results(results, world.results1)
    calls.clear()
    _eval(world, world.checkpoints1, out)
    assert calls == []  # complete: nothing to render


def _assert_same_results(got: dict, expected: dict, loose: tuple[str, ...] = ()) -> None:
    assert {k: v for k, v in got.items() if k not in ("metrics", "deltas")} == \
        {k: v for k, v in expected.items() if k not in ("metrics", "deltas")}
    for part in ("metrics", "deltas"):
        assert got[part].keys() == expected[part].keys()
        for label, values in expected[part].items():
            assert got[part][label].keys() == values.keys()
            for key, value in values.items():
                tolerance = {"rel": 1e-6} if key in loose else {"rel": 0, "abs": 0}
                assert got[part][label][key] == pytest.approx(value, nan_ok=True, **tolerance), (part, label, key)


def test_changed_settings_render_again(world, tmp_path, monkeypatch):
    """Images rendered with other settings are not reused (here: other ODE steps)."""
    out = tmp_path / "eval"
    shutil.copytree(world.eval1, out)
    calls = _count_renders(monkeypatch)
    results = _eval(world, ["base"], out, **{"eval.num_steps": 2})
    assert calls == [world.prompts[0:2], world.prompts[2:4]], calls
    assert results["num_steps"] == 2 and _pngs(out / "images/base") != _pngs(world.eval1 / "images/base")


# --- checkpoint specs --------------------------------------------------------------------------------
def test_checkpoint_specs(world):
    from flowrl.eval.checkpoints import EvalCheckpoint, parse_checkpoint, read_adapter, unique_labels

    run = world.run
    assert parse_checkpoint("base") == EvalCheckpoint("base")
    assert parse_checkpoint("before=base") == EvalCheckpoint("before")
    assert parse_checkpoint(str(run)) == EvalCheckpoint("run", run / "lora")
    step = run / "checkpoints/step_000000"
    assert parse_checkpoint(str(step)) == EvalCheckpoint("run@step_000000", step)
    assert parse_checkpoint(f"{run}:ema") == EvalCheckpoint("run@step_000001-ema", run / "checkpoints/step_000001", True)
    assert parse_checkpoint(f"{step}:ema") == EvalCheckpoint("run@step_000000-ema", step, True)
    lora_file = run / "lora/pytorch_lora_weights.safetensors"
    assert parse_checkpoint(str(lora_file)) == EvalCheckpoint("pytorch_lora_weights", lora_file)
    assert parse_checkpoint(f"mine={lora_file}") == EvalCheckpoint("mine", lora_file)
    with pytest.raises(ValueError, match="base:ema"):
        parse_checkpoint("base:ema")
    labels = [c.label for c in unique_labels([EvalCheckpoint("a"), EvalCheckpoint("a", step), EvalCheckpoint("b"),
                                              EvalCheckpoint("a", lora_file)])]
    assert labels == ["a", "a-2", "b", "a-3"]
    # the EMA weights are not the raw ones (the run trains with EMA on), and the export is the last raw LoRA
    raw, _ = read_adapter(EvalCheckpoint("raw", run / "checkpoints/step_000001"))
    ema, ema_config = read_adapter(EvalCheckpoint("ema", run / "checkpoints/step_000001", True))
    export, config = read_adapter(EvalCheckpoint("export", run / "lora"))
    assert raw.keys() == ema.keys() == export.keys()
    assert max((raw[k] - ema[k]).abs().max().item() for k in raw) > 0
    assert any(raw[k].abs().max() > 0 for k in raw if "lora_B" in k)  # trained: B has moved off zero
    # RUN (its lora/ export, alpha/r folded into B) holds the EMA weights: the same (alpha/r) B A
    scale = lambda c: float(c["lora_alpha"]) / int(c["r"])
    for module in {k.rsplit(".lora_", 1)[0] for k in raw}:
        product = lambda state, s: s * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]
        torch.testing.assert_close(product(export, scale(config)), product(ema, scale(ema_config)), rtol=1e-5, atol=1e-7)


def _cli(world, *args, **extra) -> tuple[int, str]:
    """``flowrl eval`` in this process; returns (exit code, stderr)."""
    import contextlib
    import io

    from flowrl.cli import main

    stderr = io.StringIO()
    argv = ["eval", CONFIG, *_overrides(world, **extra), "--out", str(world.root / "cli_out")]
    for spec in args:
        argv += ["--checkpoint", spec]
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, stderr.getvalue()


def _one_line_error(world, *args, **extra) -> str:
    code, stderr = _cli(world, *args, **extra)
    assert code == 2, stderr
    # diffusers' loading progress bars (stderr, when the model is built to check a LoRA's shapes) aside
    lines = [line for line in stderr.replace("\r", "\n").splitlines()
             if line.strip() and not ("it/s]" in line or "s/it]" in line or "Loading" in line)]
    assert len(lines) == 1 and lines[0].startswith("flowrl eval: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_missing_checkpoint_is_one_line_through_the_real_cli(world):
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "eval", CONFIG, f"run_dir={world.run}",
                           "--checkpoint", str(world.root / "nowhere"), "--out", str(world.root / "cli_out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_DEBUG": ""})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "checkpoint not found" in lines[0] and "nowhere" in lines[0]


@pytest.fixture(scope="module")
def no_ema_run(world):
    """A toy GRPO run trained with train.ema=false."""
    from flowrl.commands.train import run_train

    run = world.root / "no_ema"
    run_train("configs/toy/grpo.yaml", [f"run_dir={run}", "train.ema=false", "train.epochs=1",
                                        "sampling.prompts_per_batch=1", "sampling.group_size=2", "sampling.num_steps=2",
                                        "log.eval_every=0", "log.report_prompts=0", "log.progress=false",
                                        "train.checkpoint_every=1"])
    assert not list(run.rglob("ema.safetensors"))
    return run


def test_bad_checkpoints_are_one_line_errors(world, no_ema_run):
    assert "checkpoint not found" in _one_line_error(world, str(world.root / "missing.safetensors"))
    assert "has no EMA weights" in _one_line_error(world, f"{no_ema_run}:ema")
    step = next((no_ema_run / "checkpoints").glob("step_*"))
    assert "has no EMA weights" in _one_line_error(world, f"{step}:ema")
    assert "base:ema" in _one_line_error(world, "base:ema")


def test_checkpoint_of_another_model_is_refused(world):
    other = world.root / "other_run"
    shutil.copytree(world.run / "lora", other / "lora")
    config = yaml.safe_load((world.run / "config.yaml").read_text())
    config["model"].update(family="flux", path="assets/some_flux")
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    line = _one_line_error(world, str(other))
    assert "'assets/some_flux'" in line and "'assets/toy'" in line and "flux" in line and "sd3" in line


def test_lora_of_other_shapes_does_not_fit(world):
    """A bare LoRA file (no run config to compare) whose tensors don't fit: refused before any image is made."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(world.run / "lora/pytorch_lora_weights.safetensors"))
    key = next(k for k in state if "lora_A" in k)
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 8)  # a wider layer than this model's
    bad = world.bare / "wide.safetensors"
    save_file(state, str(bad))
    shutil.rmtree(world.root / "cli_out", ignore_errors=True)
    line = _one_line_error(world, str(bad))
    assert "does not fit this model" in line and key.removeprefix("transformer.") in line
    assert not list((world.root / "cli_out").rglob("*.png"))  # the base was not rendered first
    renamed = {k.replace("attn.", "attention_nowhere.", 1): v for k, v in load_file(str(world.zero)).items()}
    save_file(renamed, str(world.bare / "renamed.safetensors"))
    assert "does not fit this model" in _one_line_error(world, str(world.bare / "renamed.safetensors"))


def test_bad_suites_are_one_line_errors(world):
    empty = world.root / "empty.txt"
    empty.write_text("")
    blank = world.root / "blank.jsonl"
    blank.write_text("\n   \n\n")
    for suite in (empty, blank):
        assert "no prompts" in _one_line_error(world, **{"eval.suite": suite})
    records = _records()
    records[2]["metadata"]["axes"] = ["layout", "colour"]
    line = _one_line_error(world, **{"eval.suite": _write_suite(world.root / "bad_axis.jsonl", records)})
    assert "prompt 3" in line and "colour" in line and "unknown axes" in line


def test_arguments_after_checkpoint_are_overrides(world):
    """The documented `flowrl eval CONFIG --checkpoint A a.b=c` form."""
    from flowrl.cli import parse_args

    args = parse_args(["eval", CONFIG, "--checkpoint", "base", "eval.seed=1", "--checkpoint", "b=x"])
    assert args.overrides == ["eval.seed=1"] and args.checkpoint == ["base", "b=x"]
    with pytest.raises(SystemExit):
        parse_args(["eval", CONFIG, "--checkpoint", "base", "--no-such-flag"])


# --- FID / KID ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fid_eval(world):
    out = world.root / "eval_fid"
    shutil.copytree(world.eval1, out)
    reference = world.root / "reference"
    reference.mkdir()
    for file in sorted((world.eval1 / "images/base").glob("*.png"))[:8]:
        shutil.copy(file, reference / file.name)
    with pytest.warns(UserWarning, match="unreliable"):
        results = _eval(world, [f"trained={world.run}"], out,
                        **{"eval.reference": reference, "eval.fid_features": "toy"})
    return SimpleNamespace(results=results, out=out)


def test_fid_against_a_reference(world, fid_eval):
    r = fid_eval.results
    assert r["unreliable"] == ["fid"]
    for label in ("base", "trained"):
        values = r["metrics"][label]
        assert {"fid/fid", "fid/kid", "fid/kid_std"} <= set(values)
        assert values["fid/fid"] >= 0
    assert values["fid/n_reference"] == 8 and values["fid/n_images"] == 4 * N
    assert "fid/fid" in r["deltas"]["trained"]
    page = (fid_eval.out / "report.html").read_text()
    assert "Unreliable: fid" in page


def test_reference_of_one_image_is_one_line(world):
    one = world.root / "one_ref"
    one.mkdir()
    shutil.copy(world.eval1 / "images/base/p0000_00.png", one)
    line = _one_line_error(world, "base", **{"eval.reference": one})
    assert "1 images" in line and "at least 2" in line
    assert "not a directory" in _one_line_error(world, "base", **{"eval.reference": world.root / "no_such_dir"})


# --- style axis --------------------------------------------------------------------------------------
def test_style_axis_measured_with_a_model_and_noted_without(world, tmp_path):
    import open_clip

    assert type(open_clip.get_tokenizer("ViT-S-32")).__name__ == "SimpleTokenizer"  # bundled BPE, no download
    suite = _write_suite(tmp_path / "style.jsonl", _records((["style"], ["style", "layout"], ["layout"], ["tonal"])))
    measured, unmeasured = tmp_path / "measured", tmp_path / "unmeasured"
    for out in (measured, unmeasured):
        shutil.copytree(world.eval1 / "images/base", out / "images/base")
    with_model = _eval(world, ["base"], measured, **{"eval.suite": suite, "eval.style_model": "ViT-S-32"})
    style = with_model["metrics"]["base"]["axis/style"]
    assert 0 <= style <= 1 and with_model["not_measured"] == []
    without = _eval(world, ["base"], unmeasured, **{"eval.suite": suite})
    assert "axis/style" not in without["metrics"]["base"] and without["not_measured"] == ["style"]
    assert "Not measured (no model configured): style" in (unmeasured / "report.html").read_text()
    assert "Not measured" not in (measured / "report.html").read_text()


# --- report.html -------------------------------------------------------------------------------------
class Node:
    def __init__(self, tag: str, attrs: dict, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, attrs, parent, [], ""

    def iter(self):
        yield self
        for child in self.children:
            yield from child.iter()

    def find_all(self, tag: str, css: str | None = None) -> list["Node"]:
        return [n for n in self.iter() if n.tag == tag and (css is None or css in n.attrs.get("class", "").split())]

    def all_text(self) -> str:
        return self.text + "".join(c.all_text() for c in self.children)


class TreeBuilder(HTMLParser):
    VOID = {"img", "meta", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node("#document", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(node)
        if tag not in self.VOID:
            self.current = node

    def handle_endtag(self, tag):
        node = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        assert node is not None, f"unmatched </{tag}>"
        self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(Node("#text", {}, self.current))
        self.current.children[-1].text = data


def parse_html(text: str) -> Node:
    builder = TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


def _section(root: Node, heading: str) -> list[Node]:
    """The nodes after the <h2> whose text starts with ``heading``, up to the next <h2>."""
    body = root.find_all("body")[0].children
    start = next(i for i, n in enumerate(body) if n.tag == "h2" and n.all_text().startswith(heading))
    end = next((i for i in range(start + 1, len(body)) if body[i].tag == "h2"), len(body))
    return body[start + 1:end]


def test_report_html_structure(world):
    page = (world.eval1 / "report.html").read_text()
    assert "<script" not in page.lower() and 'src="http' not in page and "url(http" not in page
    root = parse_html(page)
    labels = list(world.results1["checkpoints"])
    grids = root.find_all("div", "prompt")
    shown = [0, 2, 3, 1]  # round-robin over the tasks: single_object, counting, two_object, single_object
    assert len(grids) == len(shown)
    for grid, index in zip(grids, shown):
        prompt, task = world.prompts[index], world.results1["tasks"][index]
        assert grid.find_all("h3")[0].all_text() == f"{prompt} {task}"
        rows = grid.find_all("div", "row")
        assert [r.find_all("span", "label")[0].all_text() for r in rows] == labels
        for row, label in zip(rows, labels):
            (image,) = row.find_all("img")
            assert image.attrs["alt"] == f"{label}: {prompt}"
            assert base64.b64decode(image.attrs["src"].removeprefix("data:image/png;base64,"))[:8] == b"\x89PNG\r\n\x1a\n"
    (summary,) = [n for n in _section(root, "Summary") if n.tag == "table"]
    header = [th.all_text() for th in summary.find_all("tr")[0].find_all("th")]
    assert header == ["metric", "base", "trained", "Δ trained", "ema", "Δ ema", "trained-2", "Δ trained-2"]
    rows = {tr.find_all("td")[0].all_text(): [td.all_text() for td in tr.find_all("td")[1:]]
            for tr in summary.find_all("tr")[1:]}
    assert {"reward/toyeval", "diversity/cosine", "axis/layout", "axis/tonal", "toy/gt_mean"} <= set(rows)
    base_value = world.results1["metrics"]["base"]["reward/toyeval"]
    trained_value = world.results1["metrics"]["trained"]["reward/toyeval"]
    assert rows["reward/toyeval"][:3] == [f"{base_value:.4f}", f"{trained_value:.4f}",
                                          f"{trained_value - base_value:+.4f}"]
    (plot,) = [n for n in _section(root, "Trade-off") if n.tag == "img"]
    assert plot.attrs["src"].startswith("data:image/png;base64,")
    assert base64.b64decode(plot.attrs["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    for image in root.find_all("img"):
        assert image.attrs["src"].startswith("data:image/png;base64,")
    assert "Not measured" not in page and "Unreliable" not in page


def _render_script():
    return importlib.import_module("tools.render_report")


def test_report_in_headless_chromium(world, tmp_path):
    script = _render_script()
    if script.find_chromium() is None:
        pytest.skip("chromium is not installed")
    report = world.eval1 / "report.html"
    dom = script.dump_dom(report)
    for prompt in world.prompts:
        assert prompt in dom
    summary = script.summarize(dom)
    assert summary["grids"] == [world.prompts[i] for i in (0, 2, 3, 1)] and summary["rows_per_grid"] == [4] * 4
    assert summary["tables"] >= 2 and summary["plot"] and summary["images"] == 4 * 4 + 1
    shot = tmp_path / "report.png"
    script.screenshot(report, shot, width=1000, height=1400)
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1000, 1400)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, tables and image grids, not one colour
    assert script.main([str(report), "--out", str(tmp_path / "main.png"), "--width", "800", "--height", "900"]) == 0


# --- train small, evaluate large ---------------------------------------------------------------------
def test_eval_size_renders_larger_images_and_is_part_of_the_settings(world, tmp_path):
    """eval.height / eval.width: `flowrl eval` renders at that size (the toy trains at 32 px), and renders cached at
    the training size are not reused for it."""
    from PIL import Image

    out = tmp_path / "eval"
    shutil.copytree(world.eval2, out)
    _eval(world, ["base"], out, **{"eval.height": 64, "eval.width": 48})
    sizes = {Image.open(f).size for f in (out / "images/base").glob("*.png")}
    assert sizes == {(48, 64)}, sizes  # PIL: (width, height)
    assert {Image.open(f).size for f in (world.eval2 / "images/base").glob("*.png")} == {(32, 32)}


def test_an_eval_size_the_model_cannot_sample_is_one_line(world):
    shutil.rmtree(world.root / "cli_out", ignore_errors=True)
    line = _one_line_error(world, "base", **{"eval.height": 34})  # the toy VAE halves, then 2x2 patches: 4
    assert "multiples of 4" in line and "34x32" in line, line
    assert not (world.root / "cli_out").exists()  # refused: no output directory left behind


def test_a_directory_that_is_not_a_run_is_one_line_in_evals_own_words(world, tmp_path):
    """Not train's "no checkpoint to resume ... (start without resume=...)": eval says what it looks for."""
    (tmp_path / "notes").mkdir()
    shutil.rmtree(world.root / "cli_out", ignore_errors=True)
    line = _one_line_error(world, str(tmp_path / "notes"))
    assert "holds no adapter to evaluate" in line and "resume" not in line, line
    assert not (world.root / "cli_out").exists()


def test_eval_reads_the_text_cache_with_freed_encoders(world, tmp_path):
    """``model.text_cache: disk`` with the encoders freed renders the images the live encoders give."""
    out, cache = tmp_path / "eval", tmp_path / "cache"
    _eval(world, ["base"], out, **{"model.text_cache": "disk", "model.free_text_encoders": "true",
                                   "model.text_cache_path": cache})
    assert list(cache.glob("*.safetensors"))
    assert _pngs(out / "images/base") == _pngs(world.eval2 / "images/base")


@pytest.mark.slow
def test_two_processes_render_the_same_images_and_results_as_one(world, tmp_path):
    """``accelerate launch flowrl eval``: each process renders whole batches of the suite, the main one scores
    them, and results.json and every image are those of one process."""
    one = _eval(world, [f"trained={world.run}"], tmp_path / "one")
    launcher = TWO_PROCESSES
    proc = subprocess.run([*launcher, "-m", "flowrl", "eval", CONFIG, *_overrides(world), "--checkpoint",
                           f"trained={world.run}", "--out", str(tmp_path / "two")], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, launch_failure(proc.stderr)
    # the processes joined one group and split the suite: the main one's bar counts its half of the 4 prompts
    # (two processes that each rendered the whole suite would write the same files at once)
    assert "eval trained (process 0's share, 2 processes)" in proc.stderr and "2/2" in proc.stderr, proc.stderr[-2000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    for label in ("base", "trained"):
        assert _pngs(tmp_path / "one" / "images" / label) == _pngs(tmp_path / "two" / "images" / label), label
        assert not list((tmp_path / "two" / "images" / label).glob("manifest.*.json"))  # merged into one
    _assert_same_results(two, one)
