"""The optional native op library (`libcompiledump_native.so`, built by the top-level CMakeLists.txt).

Python owns every schema (`compiledump/ops.py`); the library only adds kernels for them. When it
is loaded, the CPU capture path calls the native kernel (`compiledump::capture_kernel_v1`)
instead of the Python reference kernel: same semantics, fewer microseconds per call.

COMPILEDUMP_NATIVE: unset = load the library if it was built into the package, `0` = never,
`1` = required (an error if it cannot be loaded), or a path to the library to load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

LIBRARY_NAME = "libcompiledump_native.so"
_LOADED: str | None = None  # path of the loaded library


def _candidate() -> Path | None:
    setting = os.environ.get("COMPILEDUMP_NATIVE", "")
    if setting == "0":
        return None
    if setting not in ("", "1"):
        return Path(setting)
    return Path(__file__).with_name(LIBRARY_NAME)


def load(path: str | os.PathLike | None = None) -> bool:
    """Load the native library (from `path`, else as COMPILEDUMP_NATIVE says); True if loaded."""
    global _LOADED
    if _LOADED is not None:
        return True
    target = Path(path) if path is not None else _candidate()
    required = path is not None or os.environ.get("COMPILEDUMP_NATIVE", "") not in ("", "0")
    if target is None or not target.exists():
        if required:
            raise RuntimeError(f"compiledump: native library not found at {target}; build it with CMakeLists.txt")
        return False
    from . import ops  # noqa: F401 - the schemas must exist before the kernels register

    torch.ops.load_library(str(target))
    _LOADED = str(target)
    return True


def native_available() -> bool:
    """True when the native op library is loaded and serves the CPU capture kernel."""
    return _LOADED is not None
