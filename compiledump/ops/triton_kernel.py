"""The capture kernel: one Triton launch per capture call (two for a wide step, below).

One launch fuses everything a capture needs, so a CUDA graph holds one node per capture point
(two for a wide step or keep-first record) and every decision that may change between replays
is read from device memory:

1. read the header registers (enabled flag, rows gate, gather row) from the control block, one
   snapshot that every thread of the program agrees on (`read_registers`);
2. pick exactly one counter of the tag's slot and `atomic_add` it; the old value of the
   written-counter is the step index (append) or tells whether this is the first write (keep-first);
3. gather the row, average over the hc axis in fp32 (or copy it), cast, and store into the arena;
4. count the NaN/Inf values read (or, with REG_CHECK_ALL, in the whole input), date the first
   call that saw one, and commit the write (SLOT_COMMITTED: a crash mid-write is detectable).

Compiled variants (see ops/variants.py, which decides them on the host): every integer argument
is a 64-bit runtime value that Triton never specializes (an int equal to 1, or divisible by 16,
would otherwise select another compiled kernel, and a CUDA graph capture must not compile one),
so a variant depends only on the input dtype, the layout class (MEAN, IS_INT, VEC) and the
input's 16-byte alignment. Once a variant is compiled, its launches go straight into the
compiled kernel (`DirectLaunch`), skipping the JIT's per-launch binding and cache lookup. All offset
math is 64-bit: rows of a `[74900, 4, 7168]` tensor or arenas past 8 GiB are addressed exactly.

Speed: the row is cut into tiles of BLOCK columns (one row per tile, every row for all-rows
records), spread over several programs of NUM_WARPS warps. Program 0 alone claims the counter.
Steps and keep-first records write only if (steps: where) the claimed value says, and programs
cannot wait for each other, so they run one program, or, for a wide row (a logits step), two
launches of the same compiled kernel (`phase`): one program claims and publishes its decision
in the slot (layout.SLOT_CLAIM), then a launch over every tile copies as it says
(ops/variants.py `launches_for`). On the contiguous fast path (VEC > 1) the hints in
ops/triton_steps.py let Triton emit 16-byte vector loads and stores, and the HC_BLOCK hc rows of a
tile are all loaded before any is added, so they are in flight together instead of one memory
round trip each. A capture is a chain of dependent round trips to memory; the chain is kept to
three: the registers (with the steps register), then the claim's atomic with the payload's first
tile loaded beside it, then the stores before the commit. SASS and PTX: scripts/kernel_ptx.py,
benchmarks/RESULTS.md.

Under `TRITON_INTERPRET=1` the same kernel runs on CPU tensors, which is how the tests check it
against the CPU implementation without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import triton
import triton.language as tl

from . import layout as L
from . import variants
from .triton_steps import copy_tile, hc_row, nonfinite, read_registers, split_decision, tile_at
from .variants import (
    ALIGN_WORDS,
    BLOCK,
    NUM_WARPS,
    Variant,
    ensure_prepared,
    launches_for,
    variant_for,
)

INT_ARGS = ["T", "H", "D", "stride_t", "stride_h", "stride_d", "base", "offset", "capacity", "kind", "reason",
            "row_reg", "phase"]


@triton.jit(do_not_specialize=INT_ARGS)
def capture_kernel(
    x_ptr,
    arena_ptr,
    ctrl_ptr,
    T: tl.int64,
    H: tl.int64,
    D: tl.int64,
    stride_t: tl.int64,
    stride_h: tl.int64,
    stride_d: tl.int64,
    base: tl.int64,  # word index of the slot's counters in the control block
    offset: tl.int64,  # word offset of the slot's region in the arena (-1: no region)
    capacity: tl.int64,  # steps the region holds (1 unless kind == STEP)
    kind: tl.int64,  # layout.KIND_*
    reason: tl.int64,  # host-decided drop counter (0: none)
    row_reg: tl.int64,  # header register holding the row to gather (ROW_FIXED_ZERO: row 0; ROW_ALL: every row)
    phase: tl.int64,  # layout.LAUNCH_*: the whole capture, or the claim or copy launch of a split one
    MEAN: tl.constexpr,  # average over H (else copy H x D)
    IS_INT: tl.constexpr,  # record_ids: store int32 (any other kind converts to float32)
    VEC: tl.constexpr,  # > 1: stride_d == 1; D, stride_t, stride_h multiples of VEC; x 16-byte aligned
    STORE_VEC: tl.constexpr,  # what the arena offset of a row is known to be a multiple of
    HOST_ARENA: tl.constexpr,  # the arena is host-mapped memory (crash-proof capture, one program)
    RELEASE: tl.constexpr,  # the commit is a release (ops/variants.py COMMIT_RELEASE), else relaxed
    PAYLOAD_FIRST: tl.constexpr,  # the first tile is loaded before the claim (ops/variants.py PAYLOAD_FIRST)
    BLOCK: tl.constexpr,
):
    # Program 0 claims the counter; the other programs (launched for the kinds whose write does not
    # depend on the claimed value: record, all-rows record, ids; or as the copy launch of a split
    # capture, which acts on the decision its claim launch published) copy their share.
    pid = tl.program_id(0)
    claimer = (pid == 0) & (phase != L.LAUNCH_COPY)
    programs = tl.num_programs(0)
    # Decode steps begun (dates a NaN/Inf). Loaded with the registers, so its round trip overlaps
    # theirs: loaded after the claim, it held every store back by one more round trip.
    steps_now = tl.load(ctrl_ptr + L.REG_STEPS).to(tl.int64)
    enabled, rows_ok, row, check_all = read_registers(ctrl_ptr, row_reg, BLOCK)
    rows_ok = rows_ok | (kind != L.KIND_STEP)
    row = tl.where(row_reg < 0, 0, row)
    row = tl.where(row < 0, row + T, row)
    row_ok = (row >= 0) & (row < T)

    # Exactly one counter per call; the order is the precedence of the reasons.
    counter = tl.where(row_ok, L.CNT_WRITTEN, L.CNT_ROW_OUT_OF_RANGE)
    counter = tl.where(rows_ok, counter, L.CNT_ROWS_GATE)
    counter = tl.where(reason != 0, reason, counter)
    counter = tl.where(enabled, counter, L.CNT_SUSPENDED)
    live = counter == L.CNT_WRITTEN
    rows = tl.where(row_reg == L.ROW_ALL, T, 1)  # rows stored: all of them, or the one gathered

    # Payload first: the program's first tile is loaded before the claim, so its round trip to
    # memory overlaps the claim's atomic instead of following it (one dependent round trip less
    # per capture). Only where the registers alone say this launch copies (the claim may still
    # drop it: a full step region, counted; the tile is then read for nothing), never for
    # keep-first records, whose later calls all drop. Kept in the input's type: a conversion
    # here would wait for the load.
    early = tl.where(phase == L.LAUNCH_COPY, row_ok, live & (phase == L.LAUNCH_WHOLE))
    row_blocks = tl.cdiv(D, BLOCK)  # tiles per row
    early = early & (kind != L.KIND_RECORD_ONCE) & (pid < rows * row_blocks) & PAYLOAD_FIRST
    early_limit = tl.where(early, D, 0)
    cols, src_off, col_off = tile_at(pid, tl.maximum(row_blocks, 1), row, stride_t, stride_d, VEC, BLOCK)
    e0 = hc_row(x_ptr, src_off, 0, H, stride_h, col_off, cols, early_limit, VEC)
    e1, e2, e3 = e0, e0, e0  # a copy reads one row at a time: e0 alone
    if MEAN:
        e1 = hc_row(x_ptr, src_off, 1, H, stride_h, col_off, cols, early_limit, VEC)
        e2 = hc_row(x_ptr, src_off, 2, H, stride_h, col_off, cols, early_limit, VEC)
        e3 = hc_row(x_ptr, src_off, 3, H, stride_h, col_off, cols, early_limit, VEC)

    # Relaxed: the counter only has to be claimed atomically; nothing reads the payload before
    # the kernel has finished (flush synchronizes the device first).
    old = tl.atomic_add(ctrl_ptr + base + counter, 1, mask=claimer, sem="relaxed").to(tl.int64)
    old = tl.where(claimer, old, 0)

    # Decode steps begun: a step capture raises it past its own index (its claiming program does).
    tl.atomic_max(ctrl_ptr + L.REG_STEPS, (old + 1).to(tl.int32), mask=claimer & live & (kind == L.KIND_STEP),
                  sem="relaxed")
    check_all = enabled & check_all
    # keep-first writes only on the first live call; append only while the region has room.
    write = live & ((kind != L.KIND_RECORD_ONCE) | (old == 0))
    write = write & ((kind != L.KIND_STEP) | (old < capacity))
    # The record kinds note the token count of the capture the dump now holds.
    is_record = (kind == L.KIND_RECORD) | (kind == L.KIND_RECORD_ONCE) | (kind == L.KIND_RECORD_ROWS)
    kept_tokens = tl.where(row_reg == L.ROW_FIXED_ZERO, 0, T)  # a tensor stored whole has no token count
    tl.atomic_xchg(ctrl_ptr + base + L.SLOT_KEPT_TOKENS, kept_tokens.to(tl.int32),
                   mask=write & is_record & claimer, sem="relaxed")
    bad_step = 1 + tl.where(live & (kind == L.KIND_STEP), old, steps_now)  # dates a NaN/Inf (SLOT_BAD_STEP)
    write, check_all, bad_step = split_decision(ctrl_ptr + base + L.SLOT_CLAIM, phase, write, check_all, bad_step,
                                                row_ok, pid)
    step = tl.where(kind == L.KIND_STEP, bad_step - 1, 0)  # bad_step is the step's index + 1 when it writes

    if IS_INT:
        out_ptr = arena_ptr.to(tl.pointer_type(tl.int32))
    else:
        out_ptr = arena_ptr
    # A skipped call reads and writes nothing: it has no tiles. (Also sidesteps the
    # interpreter's dislike of scalar booleans broadcast into a mask.)
    limit = tl.where(write, D, 0)
    col_blocks = tl.cdiv(limit, BLOCK)
    tiles = tl.where(write, rows, 0) * col_blocks
    has_tile = pid < tiles
    first_limit = tl.where(has_tile, limit, 0)
    if VEC > 1:  # hinted where they are made (copy_tile's arguments take no hint)
        limit = tl.multiple_of(limit, VEC)
        first_limit = tl.multiple_of(first_limit, VEC)
    # The program's first tile, from the loads made before the claim where there were some (a
    # program without a tile stores nothing: limit 0), then its other tiles. Peeled rather than
    # a loop that reuses them, so the early rows do not stay in registers through every tile.
    bad_read = copy_tile(x_ptr, out_ptr, pid, tl.maximum(col_blocks, 1), row, step, offset, first_limit,
                         H, D, stride_t, stride_h, stride_d, e0, e1, e2, e3, early & has_tile, True, MEAN, IS_INT, VEC,
                         STORE_VEC, BLOCK)
    for tile in range(pid + programs, tiles, programs):
        bad_read += copy_tile(x_ptr, out_ptr, tile, col_blocks, row, step, offset, limit, H, D, stride_t, stride_h,
                              stride_d, e0, e1, e2, e3, False, False, MEAN, IS_INT, VEC, STORE_VEC, BLOCK)

    # COMPILEDUMP_NONFINITE=all: every element of the input, whatever was kept.
    bad_all = tl.zeros([BLOCK], dtype=tl.int32)
    if not IS_INT:
        all_blocks = tl.cdiv(tl.where(check_all, D, 0), BLOCK)
        for tile in range(pid, T * H * all_blocks, programs):
            th = tile // all_blocks
            t = th // H
            cols = (tile - th * all_blocks) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + t * stride_t + (th - t * H) * stride_h + cols * stride_d, mask=cols < D, other=0.0)
            bad_all += nonfinite(v.to(tl.float32))
    bad = tl.sum(tl.where(check_all, bad_all, bad_read), axis=0)
    # A branch, not masks: a clean call (nearly all of them) then issues none of these memory
    # operations, and above all does not wait for the compare-and-swap's round trip to L2 (which
    # a mask cannot skip: atomic_cas has none), as the native kernel's `if (s.bad)`.
    if bad > 0:
        seen = tl.load(ctrl_ptr + base + L.SLOT_NONFINITE)
        tl.atomic_add(ctrl_ptr + base + L.SLOT_NONFINITE, tl.minimum(bad, L.NONFINITE_CAP),
                      mask=seen < L.NONFINITE_CAP, sem="relaxed")
        # The first call that saw one, set once.
        first = tl.atomic_cas(ctrl_ptr + base + L.SLOT_BAD_STEP, 0, bad_step.to(tl.int32), sem="relaxed")
        tl.atomic_xchg(ctrl_ptr + base + L.SLOT_BAD_TOKENS, kept_tokens.to(tl.int32), mask=first == 0,
                       sem="relaxed")
    # The commit, after this program's stores (the other programs' are ordered by kernel end).
    # In a host-mapped arena the reader is the host, possibly after the context died: system
    # scope, so the payload reaches host memory before the commit does.
    tl.debug_barrier()
    if HOST_ARENA:
        tl.atomic_add(ctrl_ptr + base + L.SLOT_COMMITTED, 1, mask=write & (pid == 0), sem="release", scope="sys")
    elif RELEASE:
        tl.atomic_add(ctrl_ptr + base + L.SLOT_COMMITTED, 1, mask=write & (pid == 0), sem="release")
    else:
        tl.atomic_add(ctrl_ptr + base + L.SLOT_COMMITTED, 1, mask=write & (pid == 0), sem="relaxed")


def launch(x, arena, ctrl, geometry, base, offset, capacity, kind, reason):
    """Launch the capture kernel for one call, in the variant and grid ops/variants.py chose
    (compiled before any CUDA graph capture needs it)."""
    T, H, D, st, sh, sd, row_reg, _mean = geometry
    host_arena = bool(variants.MAPPED_ARENAS) and arena.data_ptr() in variants.MAPPED_ARENAS
    v = variant_for(x, geometry, kind, host_arena)
    direct = direct_launcher(x.device, v)
    if direct is None or not DIRECT_LAUNCH or not _compiled_for(arena, ctrl):
        direct = functools.partial(_launch, v)
    # One launch, or a split capture's claim and copy (the same compiled variant: phase is a
    # runtime argument).
    for phase, programs in launches_for(geometry, kind, host_arena):
        direct(programs, x, arena, ctrl, T, H, D, st, sh, sd, base, offset, capacity, kind, reason, row_reg, phase)


# Prepared variants launch straight into their compiled kernel (`DirectLaunch`); read at call
# time, False inside `through_the_jit()`.
DIRECT_LAUNCH = True


@contextlib.contextmanager
def through_the_jit():
    """Launch every capture kernel through Triton's JIT inside the block, as before the direct
    launch (scripts/gpu_check.py compares the two, benchmarks/gpu_host_split.py times both)."""
    global DIRECT_LAUNCH
    DIRECT_LAUNCH = False
    try:
        yield
    finally:
        DIRECT_LAUNCH = True


def direct_launcher(device: torch.device, v: Variant):
    """The `DirectLaunch` of variant `v` on `device`, compiling and loading the variant first
    where no call did yet (ops/variants.py); None where its launches go through the JIT."""
    return ensure_prepared(device, v, _prepare)


def constexprs(v: Variant) -> dict:
    """The compile-time arguments of variant `v`'s launches (benchmarks/gpu_host_split.py reuses them)."""
    return dict(MEAN=v.mean, IS_INT=v.is_int, VEC=v.vec, STORE_VEC=min(v.vec, ALIGN_WORDS), HOST_ARENA=v.host_arena,
                RELEASE=v.release, PAYLOAD_FIRST=v.payload_first, BLOCK=BLOCK)


def _launch(v, programs, *args):
    """One launch of variant `v` over `programs` programs through Triton's JIT (which compiles it
    the first time, and returns the compiled kernel; None under the interpreter)."""
    return capture_kernel[(programs,)](*args, **constexprs(v), num_warps=NUM_WARPS)


class DirectLaunch:
    """Launches straight into the kernel Triton's JIT compiled for one variant, with every argument
    (constexprs included) in the kernel's order, as the JIT's own launch does once it has found the
    kernel: without the JIT's binding, specialization key and cache lookup, which took 28 of the
    66 µs of host time of an eager capture on the first H200 run."""

    __slots__ = ("kernel", "constexpr_values")

    def __init__(self, kernel, v: Variant):
        self.kernel = kernel
        values = constexprs(v)
        self.constexpr_values = tuple(values[name] for name in capture_kernel.arg_names if name in values)

    def __call__(self, programs, *args):
        self.kernel[(programs, 1, 1)](*args, *self.constexpr_values)


def _compiled_for(arena, ctrl) -> bool:
    """Whether a launch into `arena` and `ctrl` has the specialization `_launch_scratch` compiled
    for (Triton specializes pointers on element type and 16-byte alignment; the input's are part of
    the variant): always for the process's arena, which torch allocates aligned."""
    return (arena.dtype == torch.float32 and ctrl.dtype == torch.int32 and arena.data_ptr() % 16 == 0
            and ctrl.data_ptr() % 16 == 0)


def _launch_scratch(device, v, launch=None):
    """Launch variant `v` on `device` once on scratch buffers with the device flag off (it counts
    one suspended call in a scratch control block, writes nothing), with `launch` (default: the JIT,
    which compiles and loads the kernel and returns it)."""
    H, D = (4 if v.mean else 1), 16  # D and the strides are multiples of every vector width
    buf = torch.zeros(H * D + 16, dtype=v.dtype, device=device)
    x = (buf[: H * D] if v.aligned else buf[1 : 1 + H * D]).view(1, H, D)
    arena = torch.zeros(H * D, dtype=torch.float32, device=device)
    ctrl = torch.zeros(L.control_words(1), dtype=torch.int32, device=device)
    kind = L.KIND_IDS if v.is_int else L.KIND_RECORD
    return (launch or functools.partial(_launch, v))(1, x, arena, ctrl, 1, H, D, H * D, D, 1, L.slot_base(1), 0, 1,
                                                     kind, 0, L.REG_RECORD_ROW, L.LAUNCH_WHOLE)


def _prepare(device, v):
    """Compile and load variant `v` on `device` (ops/variants.py `ensure_prepared` calls this
    outside any graph capture); returns the `DirectLaunch` of its compiled kernel, or None
    where its launches go through the JIT.

    The direct launcher runs once on scratch buffers here, so that a Triton whose compiled kernels
    take other arguments fails outside any capture (warned once per message), not in one."""
    compiled = _launch_scratch(device, v)
    if compiled is None or not hasattr(type(compiled), "__getitem__"):
        return None  # the interpreter returns no kernel
    direct = DirectLaunch(compiled, v)
    try:
        _launch_scratch(device, v, direct)
    except Exception as error:  # noqa: BLE001 - the JIT launch still works: warned, not raised
        warnings.warn(f"compiledump: Triton {triton.__version__}'s compiled capture kernel did not launch directly "
                      f"({type(error).__name__}: {str(error)[:200]}); captures go through Triton's JIT launch, which "
                      "costs about 28 µs more host time per capture (measured on an H200 host). Nothing is lost.",
                      RuntimeWarning, stacklevel=2)
        return None
    return direct


def prepare(device: torch.device, dtypes) -> None:
    """Compile and load, on `device`, every variant that captures of tensors of `dtypes` can use
    (also those of a host-mapped arena, once the process has one)."""
    # Triton compiles and loads for the current CUDA device.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for host_arena in sorted({False, bool(variants.MAPPED_ARENAS)}):
            for dtype in dtypes:
                # Floats: records with and without an hc mean, steps; integers: record_ids.
                layouts = [(True, False), (False, False)] if dtype.is_floating_point else [(False, True)]
                for mean, is_int in layouts:
                    ensure_prepared(device, Variant(dtype, mean, is_int, 1, True, host_arena,
                                                    variants.commit_is_release(host_arena), variants.PAYLOAD_FIRST),
                                    _prepare)
