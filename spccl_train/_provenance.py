"""Which commit produced a result: ``$SPCCL_GIT_COMMIT`` if set, else ``git rev-parse`` of this
checkout, with ``-dirty`` appended when its tracked files differ from that commit.

The variable comes first because copies of the tree run elsewhere (a GPU machine) may carry a
stale ``.git``; set it to the commit under test there. Where it is not set, such a copy's files
differ from the stale commit, and ``-dirty`` says that the commit alone does not name the code.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

__all__ = ["git_commit"]


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", *args],
            check=False,
            cwd=pathlib.Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str:
    """Short commit id of the code being run (``-dirty`` if tracked files differ from it), or
    ``"unknown"``."""
    if os.environ.get("SPCCL_GIT_COMMIT"):
        return os.environ["SPCCL_GIT_COMMIT"]
    head = _git("rev-parse", "--short", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else ""
    if not commit:
        return "unknown"
    changed = _git("diff", "--quiet", "HEAD", "--")  # exit 1: tracked files differ from HEAD
    return commit + "-dirty" if changed is not None and changed.returncode == 1 else commit
