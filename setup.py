"""Opt-in native build. All project metadata lives in pyproject.toml; this file only adds:

  COMPILEDUMP_BUILD_NATIVE=1 pip install --no-build-isolation .

which runs the top-level CMakeLists.txt and ships libcompiledump_native.so inside the
`compiledump` package, where compiledump/ops/native.py loads it. Without the variable nothing here
runs: the wheel stays pure Python and no compiler or cmake is needed.

--no-build-isolation is required with the opt-in because the library is compiled against the
torch that will import it (its C++ ABI): CMake must find that torch, the already-installed one,
not a fresh (multi-GB, CUDA) torch that an isolated build environment would download.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

BUILD_NATIVE = os.environ.get("COMPILEDUMP_BUILD_NATIVE", "") == "1"
LIBRARY = "libcompiledump_native.so"  # compiledump.ops.native.LIBRARY_NAME (not imported: it imports torch)
TARGET = "compiledump_native"  # the CMake target; the project has others we must not build
ROOT = Path(__file__).resolve().parent


class NativeDistribution(Distribution):
    # True only with the opt-in: setuptools then runs build_ext (below) and bdist_wheel tags the
    # wheel for this platform and Python instead of py3-none-any.
    def has_ext_modules(self):
        return BUILD_NATIVE


class BuildNative(build_ext):
    """Build the CMake target and copy the library into the package (no `cmake --install`: that
    would also install any other targets the project grows)."""

    def run(self):
        if not BUILD_NATIVE:
            return
        if shutil.which("cmake") is None:
            raise RuntimeError("COMPILEDUMP_BUILD_NATIVE=1: cmake is not on PATH")
        try:
            import torch.utils
        except ImportError as error:
            raise RuntimeError(
                "COMPILEDUMP_BUILD_NATIVE=1 needs torch importable at build time (the library is "
                "compiled against it): install torch first, then "
                "`pip install --no-build-isolation`") from error
        build_dir = Path(self.build_temp) / "native"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir),
                     f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                     # No RPATH to this machine's torch/lib in the shipped file (as `cmake --install`
                     # leaves it): torch is imported, its libraries loaded, before the library is.
                     "-DCMAKE_SKIP_BUILD_RPATH=ON",
                     "-DCOMPILEDUMP_BUILD_DRIVER=OFF"]
        build = ["cmake", "--build", str(build_dir), "--target", TARGET,
                 "--parallel", str(self.parallel or os.cpu_count() or 1)]
        for cmd in (configure, build):
            print(" ".join(cmd), flush=True)
            # A failure fails the install: no silent fallback to the pure-Python package.
            if subprocess.run(cmd).returncode != 0:
                raise RuntimeError(f"COMPILEDUMP_BUILD_NATIVE=1: `{' '.join(cmd)}` failed (output above); "
                                   "unset the variable for the pure-Python package")
        # Editable installs (inplace) import the source package, so the library goes there, as
        # `cmake --install` puts it by default; otherwise into build_lib, which becomes the wheel.
        package_dir = ROOT / "compiledump" if self.inplace else Path(self.build_lib) / "compiledump"
        package_dir.mkdir(parents=True, exist_ok=True)
        print(f"copying {build_dir / LIBRARY} -> {package_dir}", flush=True)
        # Copy, then rename over: a process that has the old library mapped keeps a valid file.
        partial = package_dir / (LIBRARY + ".partial")
        shutil.copyfile(build_dir / LIBRARY, partial)
        os.replace(partial, package_dir / LIBRARY)

    def get_outputs(self):
        if not BUILD_NATIVE or self.inplace:
            return []
        return [str(Path(self.build_lib) / "compiledump" / LIBRARY)]


setup(distclass=NativeDistribution, cmdclass={"build_ext": BuildNative})
