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
_TRIED = False  # load() has run (it runs when ops.py defines the schemas)


def _candidate() -> Path | None:
    setting = os.environ.get("COMPILEDUMP_NATIVE", "")
    if setting == "0":
        return None
    if setting not in ("", "1"):
        return Path(setting)
    return Path(__file__).with_name(LIBRARY_NAME)


def load(path: str | os.PathLike | None = None) -> bool:
    """Load the native library (from `path`, else as COMPILEDUMP_NATIVE says); True if loaded."""
    global _LOADED, _TRIED
    _TRIED = True
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
    """True when the native op library is loaded (it is loaded with the op schemas, on first use
    of the capture API or here) and serves the CPU capture kernel."""
    if _LOADED is None and not _TRIED:  # the capture path calls this: import only once
        from . import ops  # noqa: F401 - defining the schemas loads the library (COMPILEDUMP_NATIVE)
    return _LOADED is not None


def kernel_owner(op: str, key: str = "CPU") -> str | None:
    """Who serves `compiledump::<op>` for dispatch `key`: "native", "python", or None (nobody).

    One owner per (op, key): the native library for the keys it implements when it is loaded,
    Python otherwise. Read from the dispatcher's own record of where each kernel was registered.
    """
    for line in torch._C._dispatch_dump(f"compiledump::{op}").splitlines():
        if line.startswith(f"{key}: registered at "):
            return "python" if ".py:" in line else "native"
    return None


SCHEMAS_HEADER = Path(__file__).resolve().parents[1] / "kernels" / "schemas.h"


def schemas_header() -> str:
    """kernels/schemas.h as it must read: ops.SCHEMAS for C++ processes that have no Python to
    define them (`python -m compiledump.native --write-schemas` rewrites the file)."""
    from . import ops

    entries = "".join(f'    "{schema}",\n' for schema in ops.SCHEMAS.values())
    return (
        "// The `compiledump` op schemas, for processes without Python (kernels/schemas.cpp defines\n"
        "// them there). Generated from compiledump/ops.py SCHEMAS by\n"
        "// `python -m compiledump.native --write-schemas`; tests/test_aot.py checks it is current.\n"
        "#pragma once\n\n"
        "namespace compiledump {\n\n"
        f"constexpr const char* kSchemas[] = {{\n{entries}}};\n\n"
        "}  // namespace compiledump\n"
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-schemas"]:
        sys.exit("usage: python -m compiledump.native --write-schemas")
    SCHEMAS_HEADER.write_text(schemas_header())
    print(f"wrote {SCHEMAS_HEADER}")
