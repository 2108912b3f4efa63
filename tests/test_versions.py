"""The installed torch and Triton lie inside the ranges pyproject.toml declares, and the check
that says so names the package, its version, the range and the fix when they do not."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from spccl_train import versions

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = [
    "torch<2.14,>=2.11",
    "numpy",
    "pytest>=8; extra == 'test'",
    "triton<3.10,>=3.6; platform_system == 'Linux' and extra == 'test'",
    "triton<3.10,>=3.6; platform_system == 'Linux' and extra == 'triton'",
]


def test_installed_versions_are_supported():
    """Fails, with the reason, when torch or Triton is outside its declared range."""
    found = versions.problems()
    assert not found, "\n".join(found)


def test_metadata_matches_pyproject():
    """What the check reads (installed metadata) is what pyproject.toml says: no stale install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    want = {}
    for line in lines:
        req = Requirement(line)
        if req.name in versions.CHECKED:
            want[req.name] = want[req.name] & req.specifier if req.name in want else req.specifier
    assert versions.declared_ranges() == want


def test_ranges_from_requirements_intersect_extras():
    ranges = versions.declared_ranges(REQUIREMENTS, ["test", "triton"])
    assert ranges == {"torch": SpecifierSet(">=2.11,<2.14"), "triton": SpecifierSet(">=3.6,<3.10")}


def test_a_platform_marker_that_excludes_this_machine_is_left_out():
    ranges = versions.declared_ranges(["triton>=3.6; platform_system == 'Plan9'"], [])
    assert "triton" not in ranges


@pytest.mark.parametrize(
    "name, version, inside",
    [
        ("triton", "3.5.1", False),
        ("triton", "3.6.0", True),
        ("triton", "3.9.0", True),
        ("triton", "3.10.0", False),
        ("torch", "2.13.0+cpu", True),
        ("torch", "2.11.0+cu130", True),
        ("torch", "2.14.1", False),
        ("torch", "2.10.0", False),
        ("torch", "not-a-version", False),
    ],
)
def test_problems_name_package_version_range_and_fix(name, version, inside):
    declared = versions.declared_ranges(REQUIREMENTS, ["test"])
    found = versions.problems({"torch": "2.12.0", "triton": "3.7.1", name: version}, declared)
    if inside:
        assert found == []
    else:
        (line,) = found
        assert line.startswith(f"{name} {version} is installed")
        assert str(declared[name]) in line and "pip install" in line


def test_a_missing_optional_package_is_no_problem():
    declared = versions.declared_ranges(REQUIREMENTS, ["test"])
    assert versions.problems({"torch": "2.13.0", "triton": None}, declared) == []


def test_command_line_prints_and_exits_by_the_check():
    out = subprocess.run([sys.executable, "-m", "spccl_train.versions"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "supported: " in out.stdout
