"""Whether the installed torch and Triton lie inside the ranges this package declares.

The ranges are written once, in ``pyproject.toml``, and were tested at both ends (README,
"Supported versions"). This module reads them back from the installed package's metadata, so the
check can never disagree with what pip was told. A version outside its range is not refused at
import (the code may well work), but the tests and CI fail on it, and the Triton kernels log a
warning once, because a Triton release can change what the kernels rely on (3.9.0's interpreter
did: ``spccl_train/_triton_math.py``).

::

    python -m spccl_train.versions      # one line per package; exit status 1 when one is outside
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import sys
from collections.abc import Mapping

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["CHECKED", "UnsupportedVersionError", "declared_ranges", "installed_versions", "problems", "check_versions"]

log = logging.getLogger(__name__)

DIST = "spccl-train"
CHECKED = ("torch", "triton")
# Triton also ships as pytorch-triton (torch nightlies); the import name is the same.
_DISTRIBUTIONS = {"torch": ("torch",), "triton": ("triton", "pytorch-triton")}


class UnsupportedVersionError(RuntimeError):
    """An installed dependency lies outside the range ``pyproject.toml`` declares."""


def declared_ranges(requirements: list[str] | None = None, extras: list[str] | None = None) -> dict[str, SpecifierSet]:
    """The declared range of each package in :data:`CHECKED`, from the installed metadata.

    ``requirements`` and ``extras`` stand in for the metadata's ``Requires-Dist`` and
    ``Provides-Extra`` lines (tests). A package named in several extras gets the intersection of
    its ranges; a requirement whose platform marker excludes this machine is left out.
    """
    if requirements is None:
        try:
            meta = importlib.metadata.metadata(DIST)
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedVersionError(
                f"{DIST} is not installed, so its declared version ranges cannot be read: install it "
                'with the README\'s command (pip install "torch==2.13.0" -e ".[test]")'
            ) from None
        requirements = meta.get_all("Requires-Dist") or []
        extras = meta.get_all("Provides-Extra") or []
    environments = [{"extra": e} for e in ["", *(extras or [])]]
    ranges: dict[str, SpecifierSet] = {}
    for line in requirements:
        req = Requirement(line)
        name = req.name.lower()
        if name not in CHECKED:
            continue
        if req.marker is not None and not any(req.marker.evaluate(env) for env in environments):
            continue
        ranges[name] = ranges[name] & req.specifier if name in ranges else req.specifier
    return ranges


def installed_versions() -> dict[str, str | None]:
    """Version of each package in :data:`CHECKED` as installed, ``None`` where it is not."""
    found: dict[str, str | None] = {}
    for name in CHECKED:
        found[name] = None
        for dist in _DISTRIBUTIONS[name]:
            try:
                found[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def problems(
    installed: Mapping[str, str | None] | None = None, declared: Mapping[str, SpecifierSet] | None = None
) -> list[str]:
    """One sentence per installed package outside its declared range (none when all fit).

    A package that is not installed is no problem here (Triton is optional on CPU-only installs).
    """
    installed = installed_versions() if installed is None else installed
    declared = declared_ranges() if declared is None else declared
    found = []
    for name, spec in declared.items():
        version = installed.get(name)
        if version is None:
            continue
        try:
            inside = spec.contains(Version(version), prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            found.append(
                f"{name} {version} is installed, but {DIST} supports {name}{spec} (declared in pyproject.toml "
                f"and tested at both ends): install a supported one, e.g. pip install '{name}{spec}'"
            )
    return found


def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` naming every installed package outside its range."""
    found = problems()
    if found:
        raise UnsupportedVersionError("; ".join(found))


@functools.cache
def warn_once_if_unsupported(name: str) -> None:
    """Log one warning when ``name`` is installed outside its declared range (called by the kernels)."""
    try:
        found = [p for p in problems() if p.startswith(f"{name} ")]
    except UnsupportedVersionError:
        return  # running from a source tree without an install: nothing declared to compare with
    for line in found:
        log.warning("%s; the kernels may misbehave", line)


def _main() -> int:
    declared = declared_ranges()
    installed = installed_versions()
    for name in CHECKED:
        spec = declared.get(name, SpecifierSet())
        print(f"{name:8s} {installed[name] or 'not installed':24s} supported: {spec or 'any'}")
    found = problems(installed, declared)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(_main())
