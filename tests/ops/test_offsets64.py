"""Offsets past 2^31 elements: every CPU-runnable capture kernel gathers the right row and
writes the right arena words when a row offset (row x stride_t) or an arena word offset
(offset + step x row_words) does not fit in 32 bits. Checked against plain torch.

Kernels: the reference kernel (ops/reference.py), the native CPU kernel (kernels/capture_cpu.cpp,
skipped when the native library is not loaded) and the Triton kernel run by the interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py, as tests/ops/test_ops.py runs it).

Memory: the big inputs and arenas are anonymous private mappings (MAP_NORESERVE) viewed by
`torch.frombuffer`: their virtual size is many GiB, but only the pages a test fills or a kernel
writes are ever backed, so the resident set grows by a few MiB (checked). The Triton interpreter
does not copy its tensor arguments for CPU tensors: `GridExecutor._init_args_hst` takes
`storage.cpu()`, which returns the storage itself on CPU, and `_restore_args_dev` copies each
storage onto itself, which torch skips (same data, same view). Its loads and stores go through
the raw pointers, so the CPU tensors themselves are passed, nothing smaller stands in for them.

Each big buffer starts 2^31 elements into its mapping: an offset wrapped to a signed 32-bit
value then lands in mapped (zero, untouched) memory in front of it, so a 32-bit bug reads zeros
or writes where nothing is checked, and the test fails on the values instead of crashing.
"""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from compiledump.ops import layout as L
from compiledump.ops import native, register
from compiledump.ops.reference import capture_reference

pytestmark = pytest.mark.skipif(sys.platform != "linux" or sys.maxsize < 2**62,
                                reason="needs 64-bit Linux (anonymous MAP_NORESERVE mappings)")

I32 = 1 << 31
GUARD = I32  # elements mapped in front of each big buffer (see the module docstring)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python < 3.13 lacks the name
SENTINEL = -7.0
RSS_BUDGET_MB = 256  # what a test may add to the resident set (its virtual buffers: 8 to 24 GiB)
BASE = L.slot_base(1)


@pytest.fixture(params=["reference", "native", "triton"])
def kernel(request):
    if request.param == "reference":
        yield capture_reference
        return
    if request.param == "native":
        if not native.native_available():
            pytest.skip("the native library is not loaded")
        yield register.capture_native
        return
    pytest.importorskip("triton")
    from helpers.triton_interpreter import overflow_checks

    # Warm up the interpreter (imports, variant bookkeeping) before the resident set is measured.
    x = torch.ones(2, 4, 8, dtype=torch.bfloat16)
    register.capture_triton(x, torch.zeros(64), _ctrl(record_row=0), L.KIND_RECORD, BASE, 0, 1, 0)
    with overflow_checks():  # the suite runs without them; here a 32-bit product past 2^31 also asserts
        yield register.capture_triton


def _rss_mb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture
def rss():
    """Fails the test if it made the resident set grow by more than RSS_BUDGET_MB."""
    before = _rss_mb()
    yield
    grown = _rss_mb() - before
    assert grown < RSS_BUDGET_MB, f"resident set grew by {grown} MiB: a kernel touched a whole virtual buffer"


def _virtual(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `numel` elements backed by untouched anonymous memory, GUARD elements into
    its mapping (freed with the tensor)."""
    size = (GUARD + numel) * dtype.itemsize
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(mapping, dtype=dtype)[GUARD:]


def _ctrl(record_row: int = -1, step_row: int = 0) -> torch.Tensor:
    ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
    ctrl[L.REG_ENABLED] = 1
    ctrl[L.REG_ROWS] = 1
    ctrl[L.REG_MAX_ROWS] = 1
    ctrl[L.REG_RECORD_ROW] = record_row
    ctrl[L.REG_STEP_ROW] = step_row
    return ctrl


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    return torch.randint(-(2**20), 2**20, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_record_hc_mean_of_a_row_past_2_31_elements(kernel, rss, layout):
    """record() of a 3-D [T, H, D] bf16 hidden state: the fp32 mean over hc of row 4199, whose
    first element is 4199 x 2^19 > 2^31 elements (4.4 GB) into the tensor. `transposed` has
    stride_d = H (no vector path in the Triton kernel)."""
    T, H, D, stride_t = 4200, 4, 64, 1 << 19
    row = 4199
    assert row * stride_t > I32 and (row - 1) * stride_t > I32
    strides = (stride_t, D, 1) if layout == "packed" else (stride_t, 1, H)
    x = _virtual(T * stride_t, torch.bfloat16).as_strided((T, H, D), strides)
    x[row] = _random((H, D), torch.bfloat16, seed=1)
    x[row - 1] = _random((H, D), torch.bfloat16, seed=2)  # a neighbour: a wrong row reads other values
    arena = torch.full((3 * D,), SENTINEL)
    ctrl = _ctrl(record_row=row)

    kernel(x, arena, ctrl, L.KIND_RECORD, BASE, D, 1, 0)

    want = torch.mean(x[row], 0, dtype=torch.float32)  # the fp32 mean over hc
    torch.testing.assert_close(arena[D : 2 * D], want, rtol=1e-6, atol=0)
    assert (arena[:D] == SENTINEL).all() and (arena[2 * D :] == SENTINEL).all()
    assert ctrl[BASE + L.CNT_WRITTEN] == 1 and ctrl[BASE + L.SLOT_KEPT_TOKENS] == T


def _steps(kernel, x, arena, ctrl, offset, rows):
    """record_step() once per row of `rows` into a 3-step region at `offset`."""
    for row in rows:
        ctrl[L.REG_STEP_ROW] = row
        kernel(x, arena, ctrl, L.KIND_STEP, BASE, offset, 3, 0)


def test_record_step_of_rows_on_both_sides_of_2_31_elements(kernel, rss):
    """record_step() of a 2-D [T, D] fp16 tensor with a huge row stride: three steps gather rows
    4095 (just under 2^31 elements), 4096 (just past it) and -1 (row 4499)."""
    T, D, stride_t = 4500, 128, (1 << 19) + 8
    rows = [4095, 4096, -1]
    assert 4095 * stride_t < I32 < 4096 * stride_t
    x = _virtual(T * stride_t, torch.float16).as_strided((T, D), (stride_t, 1))
    for seed, row in enumerate(rows + [4094, 4097, T - 2]):
        x[row] = _random((D,), torch.float16, seed=10 + seed)
    arena = torch.full((5 * D,), SENTINEL)
    ctrl = _ctrl()

    _steps(kernel, x, arena, ctrl, D, rows)

    for step, row in enumerate(rows):
        start = D + step * D
        assert torch.equal(arena[start : start + D], x[row].float()), f"step {step} (row {row})"
    assert (arena[:D] == SENTINEL).all() and (arena[4 * D :] == SENTINEL).all()
    assert ctrl[BASE + L.CNT_WRITTEN] == 3


# Past 2^31 and past 2^32 words: the interpreter passes an int argument in [2^31, 2^32) as a
# uint32 (whatever the kernel declares), which a signed 32-bit bug would not wrap; past 2^32 any
# 32-bit offset math does.
STARTS = pytest.mark.parametrize("start", [I32, 2 * I32], ids=["2^31", "2^32"])


@STARTS
def test_arena_region_past_2_31_words(kernel, rss, start):
    """record() into a region that starts 1024 words past `start`, in an arena of start + 2^16 words."""
    arena = _virtual(start + (1 << 16), torch.float32)
    offset, D = start + 1024, 96
    arena[offset - 16 : offset + D + 16] = SENTINEL
    x = _random((3, D), torch.float32, seed=3)
    ctrl = _ctrl(record_row=-1)

    kernel(x, arena, ctrl, L.KIND_RECORD, BASE, offset, 1, 0)

    assert torch.equal(arena[offset : offset + D], x[-1])
    assert (arena[offset - 16 : offset] == SENTINEL).all() and (arena[offset + D : offset + D + 16] == SENTINEL).all()


def test_steps_whose_words_cross_2_31(kernel, rss):
    """record_step() into a region at 2^31 - 1500 words: step 0 ends below 2^31, step 1
    (offset + step x row_words) straddles it, step 2 lies past it."""
    arena = _virtual(I32 + (1 << 16), torch.float32)
    D, offset = 1000, I32 - 1500
    arena[offset - 16 : offset + 3 * D + 16] = SENTINEL
    x = _random((4, D), torch.bfloat16, seed=4)
    ctrl = _ctrl()

    rows = [2, 0, 3]
    _steps(kernel, x, arena, ctrl, offset, rows)

    for step, row in enumerate(rows):
        start = offset + step * D
        assert torch.equal(arena[start : start + D], x[row].float()), f"step {step} at word {start}"
    assert (arena[offset - 16 : offset] == SENTINEL).all()
    assert (arena[offset + 3 * D : offset + 3 * D + 16] == SENTINEL).all()
    assert ctrl[BASE + L.CNT_WRITTEN] == 3


@STARTS
def test_ids_past_2_31_words(kernel, rss, start):
    """record_ids() (int32 stores) of a whole [4, 8] int64 tensor 4096 words past `start`."""
    arena = _virtual(start + (1 << 16), torch.float32)
    offset = start + 4096
    arena[offset - 16 : offset + 32 + 16] = SENTINEL
    x = _random((4, 8), torch.int64, seed=5)
    ctrl = _ctrl()

    kernel(x, arena, ctrl, L.KIND_IDS, BASE, offset, 1, 0)

    assert torch.equal(arena[offset : offset + 32].view(torch.int32), x.flatten().to(torch.int32))
    assert (arena[offset - 16 : offset] == SENTINEL).all() and (arena[offset + 32 : offset + 48] == SENTINEL).all()
