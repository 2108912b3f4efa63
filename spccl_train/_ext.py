"""Loading the CUDA kernels (``csrc/``) as the ``torch.ops.spccl`` operators.

Two ways in, tried in order on first use:

1. ``spccl_train/_C*.so``, built by ``setup.py`` when the install saw a CUDA build of torch and
   a CUDA toolchain (``pip install --no-build-isolation .``);
2. a just-in-time build of ``csrc/`` with ``torch.utils.cpp_extension.load``, cached under
   ``$SPCCL_EXT_DIR`` (default ``~/.cache/spccl_train/<torch>-<cuda>``), so a user with a
   CUDA build of torch needs no manual step: the first CUDA call compiles (about a minute),
   later processes load the cached library in milliseconds.

Without CUDA the package never tries, and the reference codecs serve. ``SPCCL_DISABLE_KERNELS=1``
forces the reference everywhere (useful to compare).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import pathlib

import torch

__all__ = ["kernels_available", "load_kernels", "csrc_dir", "KernelsUnavailableError"]

_log = logging.getLogger(__name__)

_OPS = (
    "pici_compress",
    "pici_compress_pieces",
    "pici_prune_compress_pieces",
    "pici_decompress",
    "pici_decompress_accumulate",
    "pici_decompress_patch",
    "coo_compress",
    "coo_decompress",
    "coo_decompress_accumulate",
)


class KernelsUnavailableError(RuntimeError):
    """The CUDA kernels were asked for explicitly but could not be built or loaded."""


def csrc_dir() -> pathlib.Path:
    """The CUDA sources: ``csrc/`` of a source checkout, or the copy shipped in the package."""
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if (candidate / "ops.cpp").exists():
            return candidate
    raise KernelsUnavailableError(f"no csrc/ with ops.cpp next to {here}; reinstall spccl-train")


def _ops_registered() -> bool:
    return hasattr(torch.ops, "spccl") and all(hasattr(torch.ops.spccl, op) for op in _OPS)


def _build_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "spccl_train" / f"torch{torch.__version__}-cu{torch.version.cuda}"
    path = pathlib.Path(os.environ.get("SPCCL_EXT_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_prebuilt() -> bool:
    here = pathlib.Path(__file__).resolve().parent
    for lib in sorted(glob.glob(str(here / "_C*.so"))):
        torch.ops.load_library(lib)
        return True
    return False


def _jit_build() -> None:
    from torch.utils import cpp_extension

    src = csrc_dir()
    sources = [str(src / "ops.cpp")] + sorted(str(p) for p in src.glob("*.cu"))
    _log.warning("spccl_train: compiling the CUDA kernels (first use; cached afterwards)")
    cpp_extension.load(
        name="spccl_train_kernels",
        sources=sources,
        extra_include_paths=[str(src)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        build_directory=str(_build_dir()),
        is_python_module=False,
        verbose=os.environ.get("SPCCL_EXT_VERBOSE") == "1",
    )


@functools.cache
def load_kernels() -> None:
    """Load (building if needed) the CUDA kernels; raise :class:`KernelsUnavailableError` if impossible."""
    if os.environ.get("SPCCL_DISABLE_KERNELS") == "1":
        raise KernelsUnavailableError("SPCCL_DISABLE_KERNELS=1 is set")
    if torch.version.cuda is None or not torch.cuda.is_available():
        raise KernelsUnavailableError("the CUDA kernels need a CUDA build of torch and a visible GPU")
    if not _ops_registered():
        try:
            if not _load_prebuilt():
                _jit_build()
        except Exception as exc:  # a broken toolchain must not break the package
            raise KernelsUnavailableError(f"could not build or load the spccl CUDA kernels: {exc}") from exc
    if not _ops_registered():
        raise KernelsUnavailableError("the spccl library loaded but did not register its operators")
    from . import _fake  # noqa: F401  (fake implementations need the ops to exist)


@functools.cache
def kernels_available() -> bool:
    """True when the ``torch.ops.spccl`` CUDA kernels are loaded (building them on first call)."""
    try:
        load_kernels()
    except KernelsUnavailableError as exc:
        if torch.cuda.is_available():
            _log.warning("spccl_train: using the reference codecs on CUDA: %s", exc)
        return False
    return True
