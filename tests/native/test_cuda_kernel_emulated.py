"""The native CUDA kernel's body, run on the CPU: kernels/capture_device.h compiled by the host
C++ compiler (tests/native/cuda_kernel_on_cpu.cpp) and run as one block of threads would run it,
thread by thread between its barriers, against the reference kernel on every sample.

No GPU has run kernels/capture_cuda.cu yet; this checks everything of it but the CUDA launch,
the barriers and the device atomics: the gates and counters, the row gather through strides, the
hc mean's order and rounding, the casts of every input dtype, the NaN/Inf count and the commit.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from compiledump.ops import layout as L
from compiledump.ops import reference
from compiledump.ops.geometry import geometry

from helpers.samples import (DTYPES, GEOMETRIES, assert_matches_reference, assert_nonfinite_count_stops_at_the_cap,
                             generator_for, int_samples, run_kernel, with_nonfinite)

REPO = Path(__file__).resolve().parents[2]

# The order of the harness's `switch` (cuda_kernel_on_cpu.cpp).
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4,
               torch.int32: 5, torch.int16: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9,
               torch.float8_e4m3fn: 10, torch.float8_e5m2: 11}


@pytest.fixture(scope="module")
def kernel_on_cpu(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("cuda_kernel_on_cpu") / "kernel.so"
    include = torch.utils.cpp_extension.include_paths()[0]  # c10's headers: the fp16/bf16/fp8 types
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include}", f"-I{REPO / 'kernels'}",
                    str(REPO / "tests" / "native" / "cuda_kernel_on_cpu.cpp"), "-o", str(out)],
                   check=True, capture_output=True, timeout=300)
    library = ctypes.CDLL(str(out))
    run = library.compiledump_cuda_kernel_on_cpu
    run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int64]
    run.restype = ctypes.c_int

    def launch(threads):
        def kernel(x, arena, ctrl, kind, base, offset, capacity, reason):
            # What capture_kernel_cuda receives from the C++ table or from Python (ops/register.py).
            src, (T, H, D, st, sh, sd, row_reg, mean) = geometry(x, kind)
            args = (ctypes.c_int64 * 12)(kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg)
            assert run(DTYPE_CODES[src.dtype], src.data_ptr(), arena.data_ptr(), ctrl.data_ptr(), args, int(mean),
                       threads) == 0
        return kernel

    return launch


@pytest.mark.parametrize("threads", [256, 7])  # the launch's block, and one that loops more
@pytest.mark.parametrize("geometry_name", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_RECORD_ROWS])
def test_cuda_kernel_matches_reference(kernel_on_cpu, threads, geometry_name, dtype, kind):
    if kind == L.KIND_RECORD_ROWS and geometry_name == "1d":
        pytest.skip("all-rows records are 2-D or 3-D")
    g = generator_for(geometry_name, str(dtype), kind)
    x = GEOMETRIES[geometry_name](g, dtype)
    assert_matches_reference(kernel_on_cpu(threads), x, kind, calls=3)


@pytest.mark.parametrize("name", list(int_samples()))
def test_cuda_kernel_ids_match_reference(kernel_on_cpu, name):
    x = int_samples()[name]
    assert_matches_reference(kernel_on_cpu(32), x, L.KIND_IDS, calls=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
                                   torch.bool])
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_STEP])
def test_cuda_kernel_other_dtypes_match_reference(kernel_on_cpu, dtype, kind):
    """The dtypes the CUDA launch dispatches beyond fp32/bf16/fp16, converted to fp32 as the
    reference converts them (a float64 past fp32's range stores and counts as Inf)."""
    g = torch.Generator().manual_seed(5)
    source = torch.randn(5, 37, 4, generator=g) * 3
    if dtype == torch.float64:
        source = source.double()
        source[1, 3, 2] = 1e300
    x = source.to(dtype).transpose(1, 2)
    assert_matches_reference(kernel_on_cpu(64), x, kind, calls=2)


def test_host_decided_drops_only_count(kernel_on_cpu):
    x = torch.randn(4, 3, 9)
    for reason in (L.CNT_TOKEN_GATE, L.CNT_SHAPE_CHANGED, L.CNT_ARENA_FULL):
        want_arena, want_ctrl = run_kernel(reference.capture_reference, x, L.KIND_RECORD, (1, 1, -1, 0), 2, reason)
        got_arena, got_ctrl = run_kernel(kernel_on_cpu(256), x, L.KIND_RECORD, (1, 1, -1, 0), 2, reason)
        assert torch.equal(got_ctrl, want_ctrl) and int(got_ctrl[L.slot_base(2) + reason]) == 2
        assert torch.isnan(got_arena).all() and torch.isnan(want_arena).all()


@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ROWS, L.KIND_STEP])
def test_cuda_kernel_wide_rows_on_many_blocks(kernel_on_cpu, kind):
    """Rows wider than a block, with NaN/Inf in them: record and all-rows records run on several
    blocks (block 0 claims and commits, the others observe and count their NaN/Inf), steps on
    one; the counts, the first bad call and the stored values equal the reference's."""
    g = torch.Generator().manual_seed(11)
    x = with_nonfinite(torch.randn(3, 3, 700, generator=g), g, 12)[:, :, 3:693]  # strided rows of 690
    assert_matches_reference(kernel_on_cpu(256), x, kind, calls=2)


def test_nonfinite_count_stops_at_the_cap(kernel_on_cpu):
    """The rule every kernel follows near the NaN/Inf count's cap (tests/ops/test_ops.py)."""
    assert_nonfinite_count_stops_at_the_cap(kernel_on_cpu(7))
