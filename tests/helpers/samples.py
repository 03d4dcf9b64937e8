"""Capture-kernel samples shared by the op tests and the native-kernel tests: random data of
odd sizes in fp32/bf16/fp16, contiguous and not, and the register settings to run them under."""

import zlib

import torch

from compiledump.ops import layout as L

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float_samples(dtype):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "3d": rnd(5, 4, 33),
        "3d_noncontig": rnd(5, 33, 4).transpose(1, 2),
        "2d_sliced": rnd(7, 19)[:, ::2],
        "1d_strided": rnd(35)[::2],
        "0d": rnd(()),
        "4d": rnd(3, 2, 5, 7),
    }


def int_samples():
    g = torch.Generator().manual_seed(1)
    return {
        "ids_int64": torch.randint(0, 1000, (5, 3), generator=g),
        "ids_int32_transposed": torch.randint(-50, 50, (3, 5), generator=g, dtype=torch.int32).t(),
        "ids_1d_int16": torch.randint(0, 100, (9,), generator=g, dtype=torch.int16),
    }


def with_nonfinite(x: torch.Tensor, g: torch.Generator, count: int = 5) -> torch.Tensor:
    """`x` (a fresh tensor or a view of one: its layout is kept) with NaN, +Inf and -Inf written
    in place at `count` random elements."""
    idx = torch.randint(0, x.numel(), (count,), generator=g)
    values = [float("nan"), float("inf"), float("-inf")]
    coords = torch.unravel_index(idx, x.shape)
    for i in range(count):
        x[tuple(int(c[i]) for c in coords)] = values[i % 3]
    return x


GEOMETRIES = {
    "3d": lambda g, dt: torch.randn(6, 4, 37, generator=g).to(dt),
    "3d_hc3": lambda g, dt: torch.randn(5, 3, 29, generator=g).to(dt),  # a mean whose division is inexact
    "3d_hc8": lambda g, dt: torch.randn(4, 8, 21, generator=g).to(dt),
    "3d_noncontig": lambda g, dt: torch.randn(6, 37, 4, generator=g).to(dt).transpose(1, 2),
    # hc 16 with the hc axis innermost in memory, and dim 1: layouts where a library reduction over
    # hc (numpy's, torch's) may sum pairwise instead of in hc order.
    "3d_hc16_transposed": lambda g, dt: torch.randn(3, 21, 16, generator=g).to(dt).transpose(1, 2),
    "3d_hc16_dim1": lambda g, dt: torch.randn(4, 16, 1, generator=g).to(dt),
    "2d": lambda g, dt: torch.randn(5, 1031, generator=g).to(dt),  # > one BLOCK
    "2d_sliced": lambda g, dt: torch.randn(5, 23, generator=g).to(dt)[1:, ::3],
    "1d": lambda g, dt: torch.randn(13, generator=g).to(dt),
    # NaN/Inf at random places: the kernels count them (SLOT_NONFINITE) and date the first call.
    "3d_nonfinite": lambda g, dt: with_nonfinite(torch.randn(6, 37, 4, generator=g).to(dt).transpose(1, 2), g, 9),
    "2d_nonfinite": lambda g, dt: with_nonfinite(torch.randn(5, 23, generator=g).to(dt)[1:, ::3], g, 4),
}
# Rows wide enough that the Triton kernel splits a step or keep-first capture into a claim launch
# and a copy launch over several programs (five tiles of BLOCK columns or more; layout.splits), with
# odd widths, the hc mean, strides and NaN/Inf.
WIDE_GEOMETRIES = {
    "2d_logits": lambda g, dt: torch.randn(3, 5 * 2048 + 7, generator=g).to(dt),
    "3d_hc": lambda g, dt: torch.randn(2, 4, 5 * 2048 + 16, generator=g).to(dt),
    "2d_strided": lambda g, dt: torch.randn(3, 2 * (5 * 2048 + 1), generator=g).to(dt)[:, ::2],
    "3d_nonfinite": lambda g, dt: with_nonfinite(torch.randn(2, 6 * 2048, 3, generator=g).to(dt).transpose(1, 2),
                                                 g, 9),
}
REGISTERS = [  # (enabled, rows, record_row, step_row[, check_all])
    (1, 1, -1, 0),
    (1, 1, 2, 3, 1),  # COMPILEDUMP_NONFINITE=all: the whole input is checked
    (1, 5, -1, 0, 1),
    (0, 1, -1, 0, 1),
    (1, 1, 2, 3),
    (1, 1, -3, -1),
    (1, 5, -1, 0),  # rows gate closed: steps skipped
    (0, 1, -1, 0),  # suspended
    (1, 1, 40, 0),  # record row out of range
]
# What the registers decide (the gates, which row) is integer logic, the same in every dtype's
# variant; what a dtype changes is the data path: its loads (the first tile's, loaded before the
# claim, included), the hc mean and the NaN/Inf check. The interpreted Triton kernel runs its
# other dtypes (after float32, which runs every setting) under these: the default rows, other
# rows from both ends, the whole input checked (while suspended too), and a row out of range
# (whose early load must stay masked).
DATA_PATH_REGISTERS = [REGISTERS[0], REGISTERS[1], REGISTERS[3], REGISTERS[5], REGISTERS[8]]


def run_kernel(kernel, x, kind, registers, calls, reason=0, slot_words=None, capacity=2):
    """`calls` captures of `x` by `kernel` into slot 2 of a fresh control block whose header holds
    `registers` and whose slot words start as `slot_words` ({word: value}, else 0); the slot's
    region holds `capacity` steps."""
    enabled, rows, record_row, step_row, check_all = (*registers, 0)[:5]
    arena_t = torch.full((max(8192, 16 + 2 * x.numel()),), float("nan"))  # room for every row of x, twice
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
    for word, value in (slot_words or {}).items():
        ctrl[L.slot_base(2) + word] = value
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS] = enabled, rows, 1
    ctrl[L.REG_RECORD_ROW], ctrl[L.REG_STEP_ROW] = record_row, step_row
    ctrl[L.REG_CHECK_ALL], ctrl[L.REG_STEPS] = check_all, 3  # steps begun: dates non-finite records
    for _ in range(calls):
        kernel(x, arena_t, ctrl, kind, L.slot_base(2), 8, capacity, reason)
    return arena_t, ctrl


def generator_for(*parts) -> torch.Generator:
    """A generator seeded from a test's parameters, the same in every process (hash() of a str
    is not: PYTHONHASHSEED), so a failing draw can be run again."""
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def assert_matches_reference(kernel, x, kind, calls, registers_list=REGISTERS, capacity=2) -> None:
    """`kernel` (the reference kernel's signature) against the reference kernel on `x` under every
    REGISTERS setting, `calls` captures each (into a region of `capacity` steps, run_kernel): the
    control block word for word, the arena bit for bit (ids are int32 words; every kernel, the
    reference included, converts each element to fp32, sums the hc rows in h order and divides
    once). The Triton kernel's published decisions (SLOT_CLAIM, written only by its split
    launches) are left out: no other kernel has them."""
    from compiledump.ops.reference import capture_reference

    for registers in registers_list:
        want_arena, want_ctrl = run_kernel(capture_reference, x, kind, registers, calls, capacity=capacity)
        got_arena, got_ctrl = run_kernel(kernel, x, kind, registers, calls, capacity=capacity)
        assert torch.equal(L.without_claims(got_ctrl), want_ctrl), registers
        assert torch.equal(got_arena.view(torch.int32), want_arena.view(torch.int32)), registers


def assert_nonfinite_count_stops_at_the_cap(kernel) -> None:
    """From a count preset to NONFINITE_CAP - 3, one call adds its whole NaN/Inf count (ending past
    the cap) and later calls add nothing, so the int32 never overflows. A step capture with the
    whole input checked: one program/block in every kernel, so each adds the call's count at once."""
    g = torch.Generator().manual_seed(7)
    x = with_nonfinite(torch.randn(5, 3, 29, generator=g), g, 6)
    bad = int((~torch.isfinite(x)).sum())
    for calls in (1, 3):
        _, ctrl = run_kernel(kernel, x, L.KIND_STEP, (1, 1, 0, 0, 1), calls,
                             slot_words={L.SLOT_NONFINITE: L.NONFINITE_CAP - 3})
        assert int(ctrl[L.slot_base(2) + L.SLOT_NONFINITE]) == L.NONFINITE_CAP - 3 + bad, calls


def assert_copy_acts_on_the_published_claim(x, launch) -> None:
    """A split step capture's copy launch takes its claim launch's decision, not its own reads: two
    captures of `x` (2 rows wide enough to split, layout.splits; step row 1), each a claim
    launch, then the device flag turned off (as a register write racing on another stream would),
    then the copy launch, still write the claimed steps and commit each once.
    `launch(phase, x, arena, ctrl, base, offset, capacity)` runs one launch (LAUNCH_CLAIM or
    LAUNCH_COPY) of the kernel under test."""
    arena_t = torch.full((8 + 3 * x.shape[1],), float("nan"))
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_STEP_ROW] = 1, 1, 1, 1
    base = L.slot_base(2)
    for _ in range(2):
        launch(L.LAUNCH_CLAIM, x, arena_t, ctrl, base, 8, 3)
        ctrl[L.REG_ENABLED] = 0  # a racing write: the copy must not change its mind
        launch(L.LAUNCH_COPY, x, arena_t, ctrl, base, 8, 3)
        ctrl[L.REG_ENABLED] = 1
    assert int(ctrl[base + L.CNT_WRITTEN]) == 2 and int(ctrl[base + L.SLOT_COMMITTED]) == 2
    assert int(ctrl[base + L.CNT_SUSPENDED]) == 0 and int(ctrl[L.REG_STEPS]) == 2
    assert int(ctrl[base + L.SLOT_CLAIM]) == L.CLAIM_WRITES | 2  # step 1 (+1), writes
    rows = arena_t[8 : 8 + 2 * x.shape[1]].view(2, -1)
    assert torch.equal(rows[0], x[1]) and torch.equal(rows[1], x[1])
    assert torch.isnan(arena_t[8 + 2 * x.shape[1] :]).all()  # the third step's room: untouched
