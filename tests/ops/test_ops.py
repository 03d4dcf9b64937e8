"""The capture op itself: opcheck on every sample, and the Triton kernel against the CPU kernel.

Acceptance 1 (opcheck on fp32/bf16/fp16, odd dims, non-contiguous) and the issue's requirement
that the interpreted Triton kernel match the CPU implementation (same accumulation order).
"""

import itertools

import pytest
import torch

import compiledump
from compiledump.capture import api
from compiledump.capture.state import STATE
from compiledump.ops import reference, register, schemas
from compiledump.ops import layout as L

from helpers.samples import (
    DATA_PATH_REGISTERS,
    DTYPES,
    GEOMETRIES,
    REGISTERS,
    WIDE_GEOMETRIES,
    assert_copy_acts_on_the_published_claim,
    assert_matches_reference,
    assert_nonfinite_count_stops_at_the_cap,
    generator_for,
    float_samples,
    int_samples,
    run_kernel,
    with_nonfinite,
)



def _slot(tag, kind):
    slot, reason = api._plan(tag, kind, False, True, "cpu")
    assert reason == 0
    return slot


@pytest.fixture
def small_arena(dump_dir):
    compiledump.configure(arena_mb=1, max_steps=4, max_tags=64)
    compiledump.init("cpu")
    return STATE.runtime


def _opcheck_cases():
    for dtype in DTYPES:
        for name in float_samples(dtype):
            for kind in (L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP):
                yield pytest.param(dtype, name, kind, id=f"{str(dtype)[6:]}-{name}-{L.KIND_NAMES[kind]}")
    for name in int_samples():
        yield pytest.param(None, name, L.KIND_IDS, id=f"{name}-ids")


@pytest.mark.parametrize("dtype,name,kind", list(_opcheck_cases()))
def test_opcheck_capture(small_arena, cpu_kernel, dtype, name, kind):
    x = int_samples()[name] if dtype is None else float_samples(dtype)[name]
    slot = _slot(f"t_{name}_{kind}", kind)
    rt = small_arena
    torch.library.opcheck(schemas.capture, (x, rt.arena, rt.ctrl, slot, kind, 0))
    # opcheck works on copies; one direct call shows the sample is really captured.
    schemas.capture(x, rt.arena, rt.ctrl, slot, kind, 0)
    assert rt.ctrl[L.slot_base(slot) + L.CNT_WRITTEN] == 1


def test_opcheck_set_register(small_arena):
    torch.library.opcheck(schemas.set_register, (small_arena.ctrl, L.REG_ROWS, 5))
    schemas.set_register(small_arena.ctrl, L.REG_ROWS, 5)
    assert small_arena.ctrl[L.REG_ROWS] == 5


# --- Triton kernel (interpreted) vs the CPU reference kernel ------------------------------------

def _triton_cases():
    """Every geometry and kind in float32; in bf16/fp16, whose difference is the data path alone
    (the load, the fp32 sum, the cast), one row (a step) of every geometry and every row (an
    all-rows record, the costliest case to interpret) of a few: the kinds' row choices and claims
    are dtype-blind, and each interpreted case costs seconds."""
    all_rows_half = ("3d_hc3", "3d_noncontig", "2d_nonfinite")
    for dtype in DTYPES:
        for geometry in GEOMETRIES:
            kinds = ([L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_RECORD_ROWS] if dtype == torch.float32
                     else [L.KIND_STEP, L.KIND_RECORD_ROWS] if geometry in all_rows_half else [L.KIND_STEP])
            for kind in kinds:
                if not (kind == L.KIND_RECORD_ROWS and geometry == "1d"):  # record() stores a 1-D tensor whole
                    yield pytest.param(geometry, dtype, kind, id=f"{L.KIND_NAMES[kind]}-{str(dtype)[6:]}-{geometry}")


def _calls_and_capacity(kind):
    """Captures per register setting, and the steps the slot's region holds. A step region of 2
    takes 3 calls: two steps, then full. A record's region holds one capture, as the host sizes it
    (capacity 1), and 2 calls take every path its claimed counter leads to: the first write
    (counter 0), then a later call (counter 1, at capacity: a record still writes, a keep-first
    record drops). A third would only repeat the second's path (the reference kernel reads a
    record's counter only as 0 or not, for keep-first); each interpreted call costs about a second."""
    return (3, 2) if kind == L.KIND_STEP else (2, 1)


@pytest.mark.parametrize("geometry,dtype,kind", list(_triton_cases()))
def test_triton_matches_cpu_reference(geometry, dtype, kind):
    g = generator_for(geometry, str(dtype), kind)
    x = GEOMETRIES[geometry](g, dtype)
    registers = REGISTERS if dtype == torch.float32 else DATA_PATH_REGISTERS
    calls, capacity = _calls_and_capacity(kind)
    assert_matches_reference(register.capture_triton, x, kind, calls, registers, capacity)


@pytest.mark.parametrize("name", list(int_samples()))
def test_triton_matches_cpu_reference_ids(name):
    x = int_samples()[name]
    assert_matches_reference(register.capture_triton, x, L.KIND_IDS, calls=2)


@pytest.mark.parametrize("geometry, dtype, kind", [
    # both split kinds (a step's claim, a keep-first record's) on float32; the other data paths as steps
    *((geometry, torch.float32, kind) for geometry in ("2d_logits", "3d_nonfinite")
      for kind in (L.KIND_STEP, L.KIND_RECORD_ONCE)),
    ("2d_logits", torch.bfloat16, L.KIND_STEP), ("3d_hc", torch.bfloat16, L.KIND_RECORD_ONCE),
    ("3d_hc", torch.float16, L.KIND_STEP), ("2d_strided", torch.float16, L.KIND_STEP),
    ("3d_nonfinite", torch.bfloat16, L.KIND_STEP)])
def test_triton_split_capture_matches_cpu_reference(geometry, dtype, kind, monkeypatch):
    """A wide step or keep-first record runs as two launches (one program claims and publishes
    its decision, then every tile's program copies as it says) and writes what the reference
    kernel writes, under every register setting: suspended, gated, out-of-range rows, a full
    region (a step's three calls into two steps; _calls_and_capacity), NaN/Inf counted in the row
    or the whole input."""
    from compiledump.ops import triton_kernel

    grids = []
    real_launch = triton_kernel._launch
    monkeypatch.setattr(triton_kernel, "_launch", lambda v, programs, *args: (grids.append((args[-1], programs)),
                                                                              real_launch(v, programs, *args))[1])
    g = generator_for("wide", geometry, str(dtype), kind)
    x = WIDE_GEOMETRIES[geometry](g, dtype)
    calls, capacity = _calls_and_capacity(kind)
    assert_matches_reference(register.capture_triton, x, kind, calls, capacity=capacity)
    tiles = -(-x.shape[-1] // triton_kernel.BLOCK)
    # Each call: the claim, then the copy over every tile, in stream order (the other launches are
    # the first call's preparation of the variants, on scratch buffers).
    assert tiles >= 5 and [grid for grid in grids if grid[0] != L.LAUNCH_WHOLE] == (
        [(L.LAUNCH_CLAIM, 1), (L.LAUNCH_COPY, tiles)] * len(REGISTERS) * calls)


def test_triton_split_copy_acts_on_the_published_claim():
    """The copy launch's programs act on the claim launch's decision (helpers.samples)."""
    from compiledump.ops import triton_kernel
    from compiledump.ops.geometry import geometry

    def launch(phase, x, arena, ctrl, base, offset, capacity):
        src, geo = geometry(x, L.KIND_STEP)
        T, H, D, st, sh, sd, row_reg, _ = geo
        programs = dict(triton_kernel.launches_for(geo, L.KIND_STEP))[phase]
        triton_kernel._launch(triton_kernel.variant_for(src, geo, L.KIND_STEP), programs, src, arena, ctrl, T, H, D,
                              st, sh, sd, base, offset, capacity, L.KIND_STEP, 0, row_reg, phase)

    assert_copy_acts_on_the_published_claim(torch.randn(2, 6 * 2048 + 5, generator=torch.Generator().manual_seed(3)),
                                            launch)


@pytest.mark.parametrize("reason", [L.CNT_TOKEN_GATE, L.CNT_SHAPE_CHANGED, L.CNT_ARENA_FULL])
def test_host_decided_drop_only_counts(reason):
    x = torch.randn(4, 3, 8)
    for kernel in (reference.capture_reference, register.capture_triton):
        arena_t, ctrl = run_kernel(kernel, x, L.KIND_RECORD, (1, 1, -1, 0), calls=3, reason=reason)
        assert torch.isnan(arena_t).all()
        counters = ctrl[L.slot_base(2) : L.slot_base(2) + L.SLOT_WORDS].tolist()
        assert counters == [3 if c == reason else 0 for c in range(L.SLOT_WORDS)]


# --- Semantics against plain torch ------------------------------------------------------------


def _expected_row(x, kind, record_row, step_row):
    """Independent statement of what one capture stores (the seed's semantics + row registers)."""
    if kind == L.KIND_RECORD_ROWS:  # every row, hc-averaged
        return (x.float().mean(1) if x.dim() == 3 else x.float()).reshape(-1)
    if kind in (L.KIND_RECORD, L.KIND_RECORD_ONCE):
        if x.dim() == 3:
            return x.float().mean(1)[record_row]
        if x.dim() == 2:
            return x.float()[record_row]
        return x.float().reshape(-1)
    if x.dim() >= 2:
        return x.float()[step_row].reshape(-1)
    return x.float().reshape(-1)


# The reference kernel against plain torch; the Triton kernel is held to the reference bit for bit
# above (and the native one in tests/native), so each is held to plain torch through it.
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_STEP, L.KIND_RECORD_ROWS])
def test_kernel_values_match_plain_torch(geometry, dtype, kind):
    if kind == L.KIND_RECORD_ROWS and geometry == "1d":
        pytest.skip("all-rows records are 2-D or 3-D (record() stores a 1-D tensor whole)")
    g = torch.Generator().manual_seed(7)
    x = GEOMETRIES[geometry](g, dtype)
    fn = reference.capture_reference
    for record_row, step_row in itertools.product([-1, 1, -2], [0, 2]):
        arena_t, _ = run_kernel(fn, x, kind, (1, 1, record_row, step_row), calls=1)
        want = _expected_row(x, kind, record_row, step_row)
        got = arena_t[8 : 8 + want.numel()]
        # x.float().mean() reduces in a different order than the kernel's sequential fp32 sum.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        assert torch.isnan(arena_t[8 + want.numel() :]).all()  # nothing written past the row


# --- Non-finite values and the commit counter against plain torch ------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_RECORD_ROWS])
@pytest.mark.parametrize("check_all", [0, 1])
def test_nonfinite_counts_match_torch(dtype, kernel, kind, check_all):
    """SLOT_NONFINITE counts NaN/Inf in the rows a kept capture reads (or, with REG_CHECK_ALL, in
    the whole input of every call); SLOT_BAD_STEP/TOKENS date the first call; SLOT_COMMITTED
    counts the writes. The native kernel is held to the reference bit for bit (tests/native)."""
    g = generator_for(str(dtype), kernel, kind, check_all)
    x = torch.randn(6, 37, 4, generator=g).to(dtype).transpose(1, 2)  # [6, 4, 37], not contiguous
    with_nonfinite(x, g, 7)
    x[2, 1, 5], x[3, 0, 0], x[0, 2, 2] = float("nan"), float("-inf"), float("inf")  # rows 2, 3 and one not read
    fn = reference.capture_reference if kernel == "reference" else register.capture_triton
    calls, record_row, step_row = 3, 2, 3
    _, ctrl = run_kernel(fn, x, kind, (1, 1, record_row, step_row, check_all), calls=calls)
    slot = ctrl[L.slot_base(2) : L.slot_base(2) + L.SLOT_WORDS]
    writes = {L.KIND_RECORD: calls, L.KIND_RECORD_ONCE: 1, L.KIND_STEP: 2, L.KIND_RECORD_ROWS: calls}[kind]
    bad = ~torch.isfinite(x.float())
    if check_all:
        want = int(bad.sum()) * calls
    elif kind == L.KIND_RECORD_ROWS:
        want = int(bad.sum()) * writes
    else:
        want = int(bad[step_row if kind == L.KIND_STEP else record_row].sum()) * writes
    assert want > 0
    assert int(slot[L.SLOT_NONFINITE]) == want
    assert int(slot[L.SLOT_COMMITTED]) == writes
    # The first call: a step's own index (0), else the steps begun when it ran (run_kernel sets 3).
    assert int(slot[L.SLOT_BAD_STEP]) == 1 + (0 if kind == L.KIND_STEP else 3)
    assert int(slot[L.SLOT_BAD_TOKENS]) == 6
    assert int(ctrl[L.REG_STEPS]) == 3  # steps 0 and 1 claimed (2 past the region) keep it at 3


@pytest.mark.parametrize("kernel", ["reference", "triton", "native"])
def test_nonfinite_count_stops_at_the_cap_below_2_31(kernel):
    """Every kernel follows one rule near the NaN/Inf count's cap (the CUDA kernel, emulated:
    tests/native)."""
    if kernel == "native" and not compiledump.native_available():
        pytest.skip("the native library is not loaded")
    from helpers.triton_interpreter import overflow_checks

    with overflow_checks():  # counts near 2^31: the interpreter asserts on a 32-bit overflow too
        assert_nonfinite_count_stops_at_the_cap({"reference": reference.capture_reference,
                                                 "triton": register.capture_triton,
                                                 "native": register.capture_native}[kernel])


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_finite_inputs_count_nothing_and_steps_advance(kernel):
    x = torch.randn(5, 3, 11, dtype=torch.float16) * 1000  # large but finite; fp16 max is 65504
    fn = reference.capture_reference if kernel == "reference" else register.capture_triton
    _, ctrl = run_kernel(fn, x, L.KIND_STEP, (1, 1, -1, 1, 1), calls=2)
    slot = ctrl[L.slot_base(2) : L.slot_base(2) + L.SLOT_WORDS]
    assert slot[L.SLOT_NONFINITE] == 0 and slot[L.SLOT_BAD_STEP] == 0 and slot[L.SLOT_COMMITTED] == 2
    ctrl[L.REG_STEPS] = 0
    for _ in range(4):  # capacity 2: the claims past it still count as steps begun
        fn(x, torch.zeros(4096), ctrl, L.KIND_STEP, L.slot_base(1), 0, 2, 0)
    assert int(ctrl[L.REG_STEPS]) == 4


def test_float64_past_fp32_range_counts_as_stored():
    # The arena stores fp32: a finite float64 that overflows it is stored as Inf, and counted.
    x = torch.tensor([[1.0, 1e300, -1e300, 2.0]], dtype=torch.float64)
    for fn in (reference.capture_reference, register.capture_triton):
        arena_t, ctrl = run_kernel(fn, x, L.KIND_RECORD, (1, 1, -1, 0), calls=1)
        assert torch.isinf(arena_t[9:11]).all()
        assert int(ctrl[L.slot_base(2) + L.SLOT_NONFINITE]) == 2
