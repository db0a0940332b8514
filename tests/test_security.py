"""Security hygiene (issue 18, Build 5), kept by grep: no pickle, torch.load only with weights_only=True,
yaml.safe_load only, trust_remote_code never switched on by flowrl itself (only passed through from a reward's
config kwargs, default False)."""

import re

from tests import REPO

SOURCES = sorted(p for d in ("flowrl", "rewards", "scripts", "tools") for p in (REPO / d).rglob("*.py"))


def _hits(pattern: str, *, unless: str | None = None):
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(pattern, code) and not (unless and re.search(unless, code)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return found


def test_sources_exist():
    assert len(SOURCES) > 50


def test_no_pickle():
    assert not _hits(r"\bimport pickle\b|\bpickle\.|\bcloudpickle\b|\bdill\b|allow_pickle\s*=\s*True|joblib\.load")


def test_torch_load_always_weights_only():
    assert not _hits(r"torch\.load\(", unless=r"weights_only\s*=\s*True")


def test_yaml_safe_load_only():
    assert not _hits(r"yaml\.(load|unsafe_load|full_load)\(|yaml\.Loader\b|yaml\.UnsafeLoader\b")


def test_trust_remote_code_is_never_switched_on():
    assert not _hits(r"trust_remote_code\s*=\s*True")


def test_remote_reward_caps_its_replies():
    from rewards.remote import MAX_RESPONSE_BYTES, RemoteReward

    assert MAX_RESPONSE_BYTES == 16 * 2 ** 20
    assert RemoteReward("http://127.0.0.1:1", max_response_bytes=10, check_health=False).max_response_bytes == 10
    text = (REPO / "rewards" / "remote.py").read_text()
    assert "resp.read(self.max_response_bytes + 1)" in text and "err.read(65536)" in text
