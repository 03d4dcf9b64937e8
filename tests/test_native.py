"""The optional native op library: builds with CMake against this torch, and its CPU kernel
matches the Python reference kernel on every sample (skipped where no compiler/cmake exists)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiledump import layout as L
from compiledump import native, ops

from test_ops import DTYPES, GEOMETRIES, REGISTERS, _int_samples, _run_kernel

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def native_library(tmp_path_factory):
    if native.native_available():
        yield native._LOADED
        return
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("cmake or a C++ compiler is not installed")
    build = tmp_path_factory.mktemp("build")
    prefix = subprocess.run([sys.executable, "-c", "import torch; print(torch.utils.cmake_prefix_path)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    for cmd in (["cmake", "-S", str(REPO), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}"],
                ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    library = build / native.LIBRARY_NAME
    assert native.load(library)
    yield str(library)
    # The rest of the suite runs as it started (the kernels stay registered, but unused).
    native._LOADED = None


def _native_kernel(x, arena, ctrl, kind, base, offset, capacity, reason):
    ops.capture_native(x, arena, ctrl, kind, base, offset, capacity, reason)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP])
def test_native_matches_reference(native_library, geometry, dtype, kind):
    g = torch.Generator().manual_seed(11)
    x = GEOMETRIES[geometry](g, dtype)
    for registers in REGISTERS:
        want_arena, want_ctrl = _run_kernel(ops.capture_reference, x, kind, registers, calls=3)
        got_arena, got_ctrl = _run_kernel(_native_kernel, x, kind, registers, calls=3)
        assert torch.equal(got_ctrl, want_ctrl)
        torch.testing.assert_close(got_arena, want_arena, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(_int_samples()))
def test_native_ids_match_reference(native_library, name):
    x = _int_samples()[name]
    for registers in REGISTERS:
        want_arena, want_ctrl = _run_kernel(ops.capture_reference, x, L.KIND_IDS, registers, calls=2)
        got_arena, got_ctrl = _run_kernel(_native_kernel, x, L.KIND_IDS, registers, calls=2)
        assert torch.equal(got_ctrl, want_ctrl)
        assert torch.equal(got_arena.view(torch.int32), want_arena.view(torch.int32))


def test_opcheck_native_kernel(native_library):
    x = torch.randn(5, 33, 4).transpose(1, 2)
    arena = torch.zeros(256)
    ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, -1
    _, geo = ops.geometry(x, L.KIND_RECORD)
    torch.library.opcheck(ops.capture_kernel, (x, arena, ctrl, L.KIND_RECORD, L.slot_base(1), 0, 1, 0, *geo))


def test_native_loader_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LOADED", None)
    with pytest.raises(RuntimeError, match="native library not found"):
        native.load(tmp_path / "missing.so")
    monkeypatch.setenv("COMPILEDUMP_NATIVE", "0")
    assert native.load() is False and not native.native_available()
