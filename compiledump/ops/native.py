"""The optional native op library (`libcompiledump_native.so`, built by the top-level CMakeLists.txt).

Python owns every schema (ops/schemas.py); the library only adds kernels for them, registered
when it is loaded. It is loaded once per process, by ops/register.py right after the schemas are
defined (or by `native_available()` if that comes first), so that Python registers its own
kernels only for the dispatch keys the library leaves free: one owner per (op, key).

COMPILEDUMP_NATIVE (compiledump/config.py): unset = load the library if it was built into the
package, `0` = never, `1` = required (an error if it cannot be loaded), or a path to the library.
"""

from __future__ import annotations

import ctypes
import os
import re
import warnings
from pathlib import Path

import torch

from .. import config
from . import layout, schemas  # schemas: defines the schemas the library registers kernels for

LIBRARY_NAME = "libcompiledump_native.so"
_loaded: str | None = None  # path of the loaded library
_tried = False  # load() has run


def _candidate() -> Path | None:
    setting = config.env("COMPILEDUMP_NATIVE")
    if setting == "0":
        return None
    if setting not in ("", "1"):
        return Path(setting)
    return Path(__file__).resolve().parents[1] / LIBRARY_NAME


def load(path: str | os.PathLike | None = None) -> bool:
    """Load the native library (from `path`, else as COMPILEDUMP_NATIVE says); True if loaded."""
    global _loaded, _tried
    _tried = True
    if _loaded is not None:
        return True
    target = Path(path) if path is not None else _candidate()
    required = path is not None or config.env("COMPILEDUMP_NATIVE") not in ("", "0")
    if target is None or not target.exists():
        if required:
            raise RuntimeError(f"compiledump: native library not found at {target}; build it with CMakeLists.txt")
        return False
    built_for, release = built_for_torch(target), _torch_release()
    if built_for is not None and release is not None and built_for != release:
        built = ".".join(map(str, built_for))
        return _refuse(target, f"was built for torch {built}, and this is torch {torch.__version__}", required)
    try:
        # RTLD_GLOBAL first: AOTInductor packages that call the library's C shims
        # (kernels/aoti_shim.cpp) resolve them from the global scope when they are loaded.
        library = ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:  # e.g. built against another torch, before the version stamp
        return _refuse(target, f"cannot be loaded ({error})", required)
    stale = _stale(library)
    if stale:
        return _refuse(target, f"{stale}, so its kernels would read and write the wrong words", required)
    torch.ops.load_library(str(target))
    _loaded = str(target)
    return True


def _refuse(target: Path, why: str, required: bool) -> bool:
    """Raise (COMPILEDUMP_NATIVE=1 or a path) or warn once that the library at `target` is not
    used, and why; False: capture takes the Python path."""
    message = f"compiledump: the native library {target} {why}; rebuild it (pip install -e . again, or CMakeLists.txt)"
    if required:
        raise RuntimeError(message)
    warnings.warn(message + "; using the Python capture path", RuntimeWarning, stacklevel=3)
    return False


_MARK = b"compiledump-built-for-torch="


def built_for_torch(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """The torch release (major, minor, patch) the library file at `path` was built against, read
    from the file without loading it (kernels/capture_table.cpp), or None for a library built
    before it said."""
    data = Path(path).read_bytes()
    start = data.find(_MARK)
    if start < 0:
        return None
    text = data[start + len(_MARK): data.find(b";", start)].decode("ascii", "replace")
    parts = text.split(".")
    return tuple(int(p) for p in parts) if len(parts) == 3 and all(p.isdigit() for p in parts) else None


def _torch_release() -> tuple[int, int, int] | None:
    """This torch's (major, minor, patch): `2.11.0+cu130` and `2.11.0a0+git...` give (2, 11, 0)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__)
    return tuple(int(g) for g in match.groups()) if match else None


def _stale(library) -> str | None:
    """Why `library` (a ctypes handle) does not match this package's control-block layout, or None."""
    reported = getattr(library, "compiledump_control_layout", None)
    if reported is None:
        return "predates the control-layout check (built from older sources)"
    reported.restype = ctypes.c_int64
    built = reported()
    if built != layout.CONTROL_LAYOUT:
        return f"was built for control layout {built}, this package uses {layout.CONTROL_LAYOUT}"
    return None


# The C shims the library exports for AOTInductor (kernels/aoti_shim.cpp), by op: the declarations
# Inductor's generated code calls instead of going through its proxy executor.
C_SHIMS = {
    schemas.EXPORT: [
        "AOTITorchError aoti_torch_{device}_capture_export_v1(AtenTensorHandle x, AtenTensorHandle arena, "
        "AtenTensorHandle ctrl, int64_t slot, int64_t kind, int64_t reason, int64_t offset, "
        "const int64_t* payload, int64_t payload_len_, int64_t capacity, int64_t tokens, ...)",
    ],
}


def c_shims(device_type: str) -> dict:
    """`aot_inductor.custom_ops_to_c_shims` for programs on `device_type` (cpu or cuda) when the
    loaded library exports the shims, else {} (the proxy executor serves the ops)."""
    if _loaded is None or device_type not in ("cpu", "cuda"):
        return {}
    library = ctypes.CDLL(_loaded, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(library, f"aoti_torch_{device_type}_capture_export_v1"):
        return {}  # a library built before the shims, or without CUDA
    return {getattr(torch.ops.compiledump, op).default: [d.format(device=device_type) for d in decls]
            for op, decls in C_SHIMS.items()}


def loaded_path() -> str | None:
    """Path of the loaded native library, or None."""
    return _loaded


def native_available() -> bool:
    """True when the native op library is loaded (loading it now if no one has tried yet) and
    serves the CPU capture kernel."""
    if not _tried:
        load()
    return _loaded is not None


def kernel_owner(op: str, key: str = "CPU") -> str | None:
    """Who serves `compiledump::<op>` for dispatch `key`: "native", "python", or None (nobody).

    Read from the dispatcher's own record of where each kernel was registered.
    """
    for line in torch._C._dispatch_dump(f"{schemas.NAMESPACE}::{op}").splitlines():
        if line.startswith(f"{key}: registered at "):
            return "python" if ".py:" in line else "native"
    return None
