"""The native CUDA kernel's body, run on the CPU: kernels/capture_device.h compiled by the host
C++ compiler (tests/native/cuda_kernel_on_cpu.cpp) and run as its launches would run it, block by
block and thread by thread between its barriers, against the reference kernel on every sample.

No GPU has run kernels/capture_cuda.cu yet; this checks everything of it but the CUDA launch,
the barriers and the device atomics: the gates and counters, the row gather through strides, the
fast path's vector loads (16-byte aligned contiguous rows), the hc mean's order and rounding, the
casts of every input dtype, the NaN/Inf count, the commit, and a wide step's claim and copy
launches, whose control block equals the Triton kernel's word for word.
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

from helpers.samples import (DTYPES, GEOMETRIES, REGISTERS, WIDE_GEOMETRIES, assert_matches_reference,
                             assert_copy_acts_on_the_published_claim, assert_nonfinite_count_stops_at_the_cap,
                             generator_for, int_samples, run_kernel, with_nonfinite)

REPO = Path(__file__).resolve().parents[2]

# The order of the harness's `switch` (cuda_kernel_on_cpu.cpp).
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int64: 4,
               torch.int32: 5, torch.int16: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9,
               torch.float8_e4m3fn: 10, torch.float8_e5m2: 11}


class KernelOnCpu:
    """The compiled harness: `kernel(threads)` is a capture function with the reference kernel's
    signature; `last()` says what the last capture launched."""

    def __init__(self, library):
        self._run = library.compiledump_cuda_kernel_on_cpu
        self._run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        self._run.restype = ctypes.c_int
        self._last = library.compiledump_cuda_kernel_last_launches
        self._last.argtypes = [ctypes.POINTER(ctypes.c_int64)]

    def kernel(self, threads, only_phase=-1):
        def capture(x, arena, ctrl, kind, base, offset, capacity, reason):
            # What capture_kernel_cuda receives from the C++ table or from Python (ops/register.py).
            src, (T, H, D, st, sh, sd, row_reg, mean) = geometry(x, kind)
            args = (ctypes.c_int64 * 12)(kind, base, offset, capacity, reason, T, H, D, st, sh, sd, row_reg)
            assert self._run(DTYPE_CODES[src.dtype], src.data_ptr(), arena.data_ptr(), ctrl.data_ptr(), args,
                             int(mean), threads, only_phase) == 0
        return capture

    def __call__(self, threads):
        return self.kernel(threads)

    def last(self):
        """(fast path taken, [(phase, blocks), ...]) of the last capture."""
        out = (ctypes.c_int64 * 6)()
        self._last(out)
        return bool(out[0]), [(out[2 + 2 * i], out[3 + 2 * i]) for i in range(out[1])]


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
    return KernelOnCpu(ctypes.CDLL(str(out)))


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


# Rows the fast path takes (16-byte aligned, contiguous along D, D and the strides multiples of
# every vector width, 16 one-byte elements included): odd row counts, an hc of 3 (an inexact mean)
# and 6 (past one group of four hc rows loaded together), rows and hc rows wider than the part
# read, a row of more vectors than a block has threads, NaN/Inf.
VECTOR_GEOMETRIES = {
    "3d": lambda g, dt: torch.randn(5, 4, 48, generator=g).to(dt),
    "3d_hc3": lambda g, dt: torch.randn(3, 3, 80, generator=g).to(dt),
    "3d_hc6_sliced": lambda g, dt: torch.randn(3, 6, 64, generator=g).to(dt)[:, :, 16:48],
    "2d_wide": lambda g, dt: torch.randn(3, 4112, generator=g).to(dt),
    "2d_sliced": lambda g, dt: torch.randn(7, 64, generator=g).to(dt)[:, 16:48],
    "3d_nonfinite": lambda g, dt: with_nonfinite(torch.randn(5, 4, 48, generator=g).to(dt), g, 9),
}


@pytest.mark.parametrize("threads", [256, 7])
@pytest.mark.parametrize("geometry_name", list(VECTOR_GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_RECORD_ROWS])
def test_cuda_kernel_fast_path_matches_reference(kernel_on_cpu, threads, geometry_name, dtype, kind):
    g = generator_for("vector", geometry_name, str(dtype), kind)
    x = VECTOR_GEOMETRIES[geometry_name](g, dtype)
    assert_matches_reference(kernel_on_cpu(threads), x, kind, calls=3)
    assert kernel_on_cpu.last()[0], "the fast path was not taken"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
                                   torch.bool])
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_STEP])
def test_cuda_kernel_fast_path_other_dtypes(kernel_on_cpu, dtype, kind):
    """The fast path's loads of 2 (fp64) and 16 (one-byte types) elements; fp64 past fp32's range."""
    g = torch.Generator().manual_seed(6)
    source = torch.randn(5, 3, 32, generator=g) * 3
    if dtype == torch.float64:
        source = source.double()
        source[1, 2, 7] = 1e300
    x = source.to(dtype)
    assert_matches_reference(kernel_on_cpu(64), x, kind, calls=2)
    assert kernel_on_cpu.last()[0]


def _ids_samples():
    g = torch.Generator().manual_seed(9)
    # Contiguous, a whole number of 16-byte vectors: one flat row on the fast path.
    flat = {"ids_int64_flat": torch.randint(-5, 1000, (7, 8), generator=g),
            "ids_uint8_flat": torch.randint(0, 255, (3, 32), generator=g, dtype=torch.uint8)}
    return {**int_samples(), **flat}


@pytest.mark.parametrize("name", list(_ids_samples()))
def test_cuda_kernel_ids_paths(kernel_on_cpu, name):
    """ids, contiguous ones as one flat row of vectors; odd sizes and transposed ones element-wise."""
    assert_matches_reference(kernel_on_cpu(32), _ids_samples()[name], L.KIND_IDS, calls=2)
    assert kernel_on_cpu.last()[0] == name.endswith("_flat")


def test_cuda_kernel_slow_path_where_the_fast_one_would_misread(kernel_on_cpu):
    """Inputs one condition short of the fast path each take the element-wise path, and match."""
    g = torch.Generator().manual_seed(8)
    base = torch.randn(5 * 48 + 1, generator=g)
    short = {
        "unaligned": base[1:].view(5, 48),  # 4 bytes past a 16-byte boundary
        "odd_width": torch.randn(5, 4, 46, generator=g),
        "odd_row_stride": torch.randn(5, 50, generator=g)[:, :48],
        "odd_hc_stride": torch.randn(5, 4, 50, generator=g)[:, :, :48],
        "strided_columns": torch.randn(5, 96, generator=g)[:, ::2],
    }
    for name, x in short.items():
        assert_matches_reference(kernel_on_cpu(64), x, L.KIND_RECORD, calls=2)
        assert not kernel_on_cpu.last()[0], name
    # An aligned input into an arena that is not 16-byte aligned (a view one word in).
    x = torch.randn(5, 4, 48, generator=g)
    arenas = {}
    for name, kernel in (("reference", reference.capture_reference), ("cuda", kernel_on_cpu(64))):
        arena_t = torch.full((8 + 4 * 48 + 1,), float("nan"))[1:]
        ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
        ctrl[L.REG_ENABLED], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, -1
        kernel(x, arena_t, ctrl, L.KIND_RECORD, L.slot_base(2), 8, 1, 0)
        arenas[name] = arena_t
    assert not kernel_on_cpu.last()[0]
    assert torch.equal(arenas["cuda"].view(torch.int32), arenas["reference"].view(torch.int32))


@pytest.mark.parametrize("geometry_name, dtype", [
    ("2d_logits", torch.float32), ("2d_logits", torch.bfloat16), ("3d_hc", torch.float16),
    ("2d_strided", torch.float16), ("3d_nonfinite", torch.float32)])
@pytest.mark.parametrize("kind", [L.KIND_STEP, L.KIND_RECORD_ONCE])
def test_cuda_kernel_split_capture_matches_reference(kernel_on_cpu, geometry_name, dtype, kind):
    """A wide step or keep-first record: a claim launch of one block, then a copy launch over many,
    equal to the reference kernel under every register setting (suspended, gated, rows out of
    range, a full region, NaN/Inf in the row or the whole input)."""
    g = generator_for("wide", geometry_name, str(dtype), kind)
    x = WIDE_GEOMETRIES[geometry_name](g, dtype)
    assert_matches_reference(kernel_on_cpu(256), x, kind, calls=3)
    _, launches = kernel_on_cpu.last()
    assert [phase for phase, _ in launches] == [L.LAUNCH_CLAIM, L.LAUNCH_COPY]
    assert launches[0][1] == 1 and launches[1][1] > 1


def _assert_split_step_equals_triton(kernel_on_cpu, x):
    """Steps of `x` split by both device kernels leave the same control block (SLOT_CLAIM included,
    and set) and arena, word for word, under every REGISTERS setting."""
    from compiledump.ops import register

    for registers in REGISTERS:
        native_arena, native_ctrl = run_kernel(kernel_on_cpu(256), x, L.KIND_STEP, registers, calls=3)
        triton_arena, triton_ctrl = run_kernel(register.capture_triton, x, L.KIND_STEP, registers, calls=3)
        assert torch.equal(native_ctrl, triton_ctrl), registers
        assert torch.equal(native_arena.view(torch.int32), triton_arena.view(torch.int32)), registers
    assert int(native_ctrl[L.slot_base(2) + L.SLOT_CLAIM]) != 0


def test_cuda_kernel_split_control_block_equals_triton(kernel_on_cpu):
    """Both device kernels split a wide step alike and publish the same decision: their control
    blocks are equal word for word, SLOT_CLAIM included (what scripts/gpu_check.py compares)."""
    g = torch.Generator().manual_seed(12)
    x = with_nonfinite(torch.randn(3, 5 * 2048 + 12, generator=g), g, 5)
    _assert_split_step_equals_triton(kernel_on_cpu, x)


# Steps by the split rule (layout.splits: H x D >= 8193 elements over D >= 2049 columns), both sides
# of each threshold: [T, D] and [T, H, D].
SPLIT_RULE_SHAPES = [((3, 8192), False), ((3, 8193), True), ((2, 4, 2048), False), ((2, 4, 2049), True),
                     ((2, 3, 2730), False), ((2, 3, 2731), True), ((2, 16, 600), False)]


def test_both_kernels_split_by_one_rule(kernel_on_cpu):
    """The emulated CUDA kernel and the Triton kernel's launches (ops/variants.py) split exactly the
    steps layout.splits names, and an hc step split at fewer than 8193 columns (4 hc rows of 2049)
    leaves the Triton kernel's control block and arena word for word."""
    from compiledump.ops import triton_kernel
    from compiledump.ops.geometry import geometry

    g = torch.Generator().manual_seed(21)
    for shape, split in SPLIT_RULE_SHAPES:
        x = torch.randn(*shape, generator=g).bfloat16()
        run_kernel(kernel_on_cpu(256), x, L.KIND_STEP, REGISTERS[0], calls=1)
        native_phases = [phase for phase, _ in kernel_on_cpu.last()[1]]
        geo = geometry(x, L.KIND_STEP)[1]
        triton_phases = [phase for phase, _ in triton_kernel.launches_for(geo, L.KIND_STEP)]
        expected = [L.LAUNCH_CLAIM, L.LAUNCH_COPY] if split else [L.LAUNCH_WHOLE]
        assert native_phases == triton_phases == expected, shape
        assert L.splits(*geo[1:3]) == split  # (H, D) as the kernels view the step
    x = with_nonfinite(torch.randn(2, 4, 2049 + 15, generator=g), g, 3).bfloat16()
    _assert_split_step_equals_triton(kernel_on_cpu, x)


def test_cuda_kernel_split_copy_acts_on_the_published_claim(kernel_on_cpu):
    """The copy launch's blocks act on the claim launch's decision (helpers.samples), on the fast path."""
    x = torch.randn(2, 6 * 2048 + 4, generator=torch.Generator().manual_seed(3))

    def launch(phase, x, arena, ctrl, base, offset, capacity):
        kernel_on_cpu.kernel(256, phase)(x, arena, ctrl, L.KIND_STEP, base, offset, capacity, 0)

    assert_copy_acts_on_the_published_claim(x, launch)
    assert kernel_on_cpu.last()[0]
