"""The native build at install. All project metadata lives in pyproject.toml; this file only adds
the native capture library (the top-level CMakeLists.txt), shipped inside the `compiledump`
package, where compiledump/ops/native.py loads it.

COMPILEDUMP_BUILD_NATIVE (compiledump/config.py) says what `pip install` does:
- unset or `auto`: build it where cmake, a C++ compiler and the installed torch are found; where
  they are not, or the build fails, say so and install the pure-Python package (it works
  everywhere, more slowly: docs/compiling.md, "The native capture path");
- `1`: build it or fail the install;
- `0`: never build (no cmake runs).

The library is compiled against the torch that will import it (its C++ ABI). pip builds in an
isolated environment without that torch, so the torch of the target environment is asked for
its CMake files through the installing interpreter run outside pip's isolation.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("COMPILEDUMP_BUILD_NATIVE", "").strip().lower() or "auto"
LIBRARY = "libcompiledump_native.so"  # compiledump.ops.native.LIBRARY_NAME (not imported: it imports torch)
TARGET = "compiledump_native"  # the CMake target; the project has others we must not build
ROOT = Path(__file__).resolve().parent
# What pip's build isolation sets; without them the installing interpreter sees its own packages.
ISOLATION_VARS = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")


def checkout_build_dir(prefix: str) -> Path:
    """The CMake build directory of an editable install from this checkout, one per torch (named by
    its CMake prefix, whose headers and libraries the CMake cache records). It is kept, so a
    reinstall compiles only what changed, and the test suite builds in it too (tests/conftest.py
    `native_build` adds the C++ driver there): a fresh checkout's install and test run (CI)
    compile the library once, not twice."""
    return ROOT / "build" / ("native-" + hashlib.sha1(prefix.encode()).hexdigest()[:12])


class NativeDistribution(Distribution):
    # setuptools runs build_ext (below) only for a distribution with extension modules; a wheel
    # that may hold the library is tagged for this platform and Python.
    def has_ext_modules(self):
        return MODE != "0"


class NativeUnavailable(Exception):
    """Why the library cannot be built here."""


def _outside_isolation() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ISOLATION_VARS}


def _torch_cmake_prefix() -> str:
    """torch.utils.cmake_prefix_path of the torch this package will run with."""
    try:
        import torch.utils  # --no-build-isolation: the target environment's own torch

        return torch.utils.cmake_prefix_path
    except ImportError:
        pass
    probe = subprocess.run([sys.executable, "-c", "import torch.utils; print(torch.utils.cmake_prefix_path)"],
                           env=_outside_isolation(), capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip():
        raise NativeUnavailable("torch is not installed where compiledump is being installed (install torch first)")
    return probe.stdout.strip().splitlines()[-1]


class BuildNative(build_ext):
    """Build the CMake target and copy the library into the package (no `cmake --install`: that
    would also install any other targets the project grows)."""

    def run(self):
        if MODE == "0":
            return
        try:
            self._build()
        except NativeUnavailable as why:
            if MODE == "1":
                raise RuntimeError(f"COMPILEDUMP_BUILD_NATIVE=1: {why}") from None
            print(f"compiledump: the native capture library was not built ({why}); installing the "
                  "pure-Python capture path (COMPILEDUMP_BUILD_NATIVE=1 makes this an error)",
                  file=sys.stderr, flush=True)

    def _build(self):
        if shutil.which("cmake") is None:
            raise NativeUnavailable("cmake is not on PATH")
        if not (os.environ.get("CXX") or any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++"))):
            raise NativeUnavailable("no C++ compiler (c++, g++, clang++ or $CXX)")
        prefix = _torch_cmake_prefix()
        # A wheel builds in setuptools' scratch directory; an editable install in the checkout's.
        build_dir = checkout_build_dir(prefix) if self.inplace else Path(self.build_temp) / "native"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir), f"-DCMAKE_PREFIX_PATH={prefix}",
                     # No RPATH to this machine's torch/lib in the shipped file (as `cmake --install`
                     # leaves it): torch is imported, its libraries loaded, before the library is.
                     "-DCMAKE_SKIP_BUILD_RPATH=ON",
                     "-DCOMPILEDUMP_BUILD_DRIVER=OFF"]
        build = ["cmake", "--build", str(build_dir), "--target", TARGET,
                 "--parallel", str(self.parallel or os.cpu_count() or 1)]
        for cmd in (configure, build):
            print(" ".join(cmd), flush=True)
            if subprocess.run(cmd, env=_outside_isolation()).returncode != 0:
                raise NativeUnavailable(f"`{' '.join(cmd)}` failed (output above)")
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
        built = Path(self.build_lib) / "compiledump" / LIBRARY
        return [str(built)] if not self.inplace and built.exists() else []


if __name__ == "__main__":  # as pip's build backend runs it; tests/conftest.py imports checkout_build_dir
    setup(distclass=NativeDistribution, cmdclass={"build_ext": BuildNative})
