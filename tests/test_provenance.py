"""``git_commit``: the variable wins; else the checkout's commit, ``-dirty`` when its tracked files
differ from it (a copy of the tree with a stale ``.git``, or uncommitted work)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from spccl_train import _provenance


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_changed_checkout_is_marked_dirty(tmp_path, monkeypatch):
    monkeypatch.delenv("SPCCL_GIT_COMMIT", raising=False)
    repo = tmp_path / "repo"
    package = repo / "pkg"
    package.mkdir(parents=True)
    tracked = package / "code.py"
    tracked.write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True, capture_output=True, text=True)
    monkeypatch.setattr(_provenance, "__file__", str(tracked))  # git runs in the module's folder
    assert _provenance.git_commit() == head.stdout.strip()
    (package / "untracked.py").write_text("y = 2\n")  # untracked files do not count
    assert _provenance.git_commit() == head.stdout.strip()
    tracked.write_text("x = 2\n")
    assert _provenance.git_commit() == head.stdout.strip() + "-dirty"
    monkeypatch.setenv("SPCCL_GIT_COMMIT", "abc1234")
    assert _provenance.git_commit() == "abc1234"


def test_no_git_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("SPCCL_GIT_COMMIT", raising=False)
    monkeypatch.setattr(_provenance, "__file__", str(tmp_path / "nowhere" / "m.py"))
    (tmp_path / "nowhere").mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert _provenance.git_commit() == "unknown"
