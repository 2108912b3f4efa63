"""Build hook: compile csrc/ into spccl_train/_C when a CUDA build of torch and nvcc are present.

With build isolation (plain ``pip install .``) torch is not importable here, so nothing is
compiled and the kernels are built just in time on first CUDA use instead (see
``spccl_train/_ext.py``). ``pip install --no-build-isolation .`` in an environment with a CUDA
build of torch compiles them ahead of time. ``SPCCL_NO_BUILD_EXT=1`` skips the build.
"""

import os
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package so an installed copy can compile the kernels on first use."""

    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "spccl_train" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for path in CSRC.iterdir():
            if path.suffix in {".cu", ".cuh", ".h", ".cpp"}:
                shutil.copy2(path, target / path.name)


def _extensions():
    if os.environ.get("SPCCL_NO_BUILD_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    sources = [str(p.relative_to(ROOT)) for p in [CSRC / "ops.cpp", *sorted(CSRC.glob("*.cu"))]]
    ext = CUDAExtension(
        name="spccl_train._C",
        sources=sources,
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithSources
setup(ext_modules=ext_modules, cmdclass=cmdclass)
