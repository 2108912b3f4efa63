"""Which commit produced a result: ``$SPCCL_GIT_COMMIT`` if set, else ``git rev-parse`` of this checkout.

The variable comes first because copies of the tree run elsewhere (a GPU machine) may carry a
stale ``.git``; set it to the commit under test there.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

__all__ = ["git_commit"]


def git_commit() -> str:
    """Short commit id of the code being run, or ``"unknown"``."""
    if os.environ.get("SPCCL_GIT_COMMIT"):
        return os.environ["SPCCL_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            cwd=pathlib.Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
