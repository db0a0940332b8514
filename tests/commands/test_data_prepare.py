"""``flowrl data prepare NAME OUT``: geneval's two files, and each refusal as one line that leaves no file (an
unknown name, files already in OUT, pickscore and ocr without the network). The network is never touched:
urllib and the datasets package are replaced."""

import hashlib
import json
import sys
import types
import urllib.request

import pytest

from flowrl.data import geneval as geneval_prompts
from flowrl.cli import main
from flowrl.commands import data as data_command
from flowrl.data.prompts import load_prompts


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any download attempt fails as it would offline, and is recorded."""
    calls = []

    def refuse(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(geneval_prompts, "TRAIN_SIZE", 500)  # the file's first 500 records: fast
    return calls


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured
    return lines[0]


def test_geneval_writes_train_and_eval(tmp_path, capsys):
    out = tmp_path / "geneval"
    assert main(["data", "prepare", "geneval", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {out / 'train.jsonl'}", f"wrote {out / 'eval.jsonl'}"]
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "train.jsonl"]  # no temporary left
    evaluation, train = load_prompts(out / "eval.jsonl"), load_prompts(out / "train.jsonl")
    assert len(evaluation) == 553 and len(train) == 500
    assert evaluation.metadata[0] == {"tag": "single_object", "include": [{"class": "bench", "count": 1}],
                                      "prompt": "a photo of a bench"}
    assert not set(train.prompts) & set(evaluation.prompts)
    first = (out / "eval.jsonl").read_text().splitlines()[0]
    assert json.loads(first) == {"prompt": "a photo of a bench", "metadata": evaluation.metadata[0]}


def test_existing_files_need_force(tmp_path, capsys):
    out = tmp_path / "geneval"
    out.mkdir()
    (out / "eval.jsonl").write_text("keep me\n")
    assert main(["data", "prepare", "geneval", str(out)]) == 2
    assert "already exists; pass --force" in error_line(capsys)
    assert (out / "eval.jsonl").read_text() == "keep me\n" and not (out / "train.jsonl").exists()
    assert main(["data", "prepare", "geneval", str(out), "--force"]) == 0
    assert len(load_prompts(out / "eval.jsonl")) == 553


def test_unknown_name_lists_the_known_ones(tmp_path, capsys):
    assert main(["data", "prepare", "laion", str(tmp_path / "out")]) == 2
    assert error_line(capsys).endswith("unknown dataset 'laion'; known: geneval, ocr, pickscore")
    assert not (tmp_path / "out").exists()


def test_ocr_offline_says_what_to_download(tmp_path, capsys, monkeypatch, no_network):
    out = tmp_path / "ocr"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["data", "prepare", "ocr", str(out)]) == 2
    line = error_line(capsys)
    assert data_command.OCR_URL.format(name="train.txt") in line and str(out / "eval.txt") in line
    assert not no_network and not out.exists()  # refused before any download
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["data", "prepare", "ocr", str(out)]) == 2  # online, but the host cannot be reached
    assert "could not download" in error_line(capsys) and no_network and not out.exists()


def test_ocr_checks_the_pinned_content(tmp_path, capsys, monkeypatch):
    """A file whose git blob id is not the pinned commit's is refused; matching files are written."""
    payloads = {"train.txt": b'A sign that says "HELLO"\n', "test.txt": b'A mug reading "TEA"\n'}
    blob = {name: hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() for name, data in payloads.items()}
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: _Response(payloads[url.rsplit("/", 1)[1]]))
    assert main(["data", "prepare", "ocr", str(tmp_path / "bad")]) == 2
    assert "does not match flow_grpo commit" in error_line(capsys) and not (tmp_path / "bad").exists()
    monkeypatch.setattr(data_command, "OCR_FILES", {"train.txt": ("train.txt", blob["train.txt"], None),
                                                    "eval.txt": ("test.txt", blob["test.txt"], None)})
    assert main(["data", "prepare", "ocr", str(tmp_path / "good")]) == 0
    assert load_prompts(tmp_path / "good" / "eval.txt").prompts == ['A mug reading "TEA"']


class _Response:
    def __init__(self, data):
        self.data = data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self):
        return self.data


def test_pickscore_offline_or_without_datasets(tmp_path, capsys, monkeypatch):
    out = tmp_path / "pickscore"
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: import fails
    assert main(["data", "prepare", "pickscore", str(out)]) == 2
    assert "pip install 'flowrl[data]'" in error_line(capsys)

    def offline(name, split):
        raise ConnectionError("offline mode is enabled")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert main(["data", "prepare", "pickscore", str(out)]) == 2
    line = error_line(capsys)
    assert data_command.PICKAPIC in line and str(out / "train.txt") in line and str(out / "eval.txt") in line
    assert not out.exists()


def test_pickscore_split_follows_flow_grpo(tmp_path, capsys, monkeypatch):
    """Unique captions of six words or more, a seeded shuffle, PICKSCORE_TEST_SIZE of them for eval."""
    captions = [f"a caption of six words number {i}" for i in range(10)] + ["too short", "too short"]
    table = types.SimpleNamespace(unique=lambda column: list(dict.fromkeys(captions)))
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: table))
    monkeypatch.setattr(data_command, "PICKSCORE_TEST_SIZE", 3)
    assert main(["data", "prepare", "pickscore", str(tmp_path / "p")]) == 0
    train, evaluation = (load_prompts(tmp_path / "p" / name).prompts for name in ("train.txt", "eval.txt"))
    assert len(evaluation) == 3 and sorted(train + evaluation) == sorted(captions[:10])


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in ("geneval", "pickscore", "ocr", "--force"))
