"""The capture kernel: one Triton launch per capture call (two for a wide step, below).

One launch fuses everything a capture needs, so a CUDA graph holds one node per capture point
(two for a wide step or keep-first record) and every decision that may change between replays
is read from device memory:

1. read the header registers (enabled flag, rows gate, gather row) from the control block, one
   snapshot that every thread of the program agrees on (`_read_registers`);
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
(ops/variants.py `launches_for`). On the contiguous fast path (VEC > 1) the hints below let
Triton emit 16-byte vector loads and stores, and the HC_BLOCK hc rows of a tile are all loaded
before any is added, so they are in flight together instead of one memory round trip each.
SASS and PTX: scripts/kernel_ptx.py, benchmarks/RESULTS.md.

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
from .variants import (
    ALIGN_WORDS,
    BLOCK,
    NUM_WARPS,
    Variant,
    ensure_prepared,
    launches_for,
    variant_for,
)

HC_BLOCK = tl.constexpr(4)  # hc rows loaded together (hc_mult is 4 in the models this targets); unrolled below
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
    BLOCK: tl.constexpr,
):
    # Program 0 claims the counter; the other programs (launched for the kinds whose write does not
    # depend on the claimed value: record, all-rows record, ids; or as the copy launch of a split
    # capture, which acts on the decision its claim launch published) copy their share.
    pid = tl.program_id(0)
    claimer = (pid == 0) & (phase != L.LAUNCH_COPY)
    programs = tl.num_programs(0)
    enabled, rows_ok, row, check_all = _read_registers(ctrl_ptr, row_reg, BLOCK)
    rows_ok = rows_ok | (kind != L.KIND_STEP)
    row = tl.where(row_reg < 0, 0, row)
    row = tl.where(row < 0, row + T, row)
    row_ok = (row >= 0) & (row < T)

    # Exactly one counter per call; the order is the precedence of the reasons.
    counter = tl.where(row_ok, L.CNT_WRITTEN, L.CNT_ROW_OUT_OF_RANGE)
    counter = tl.where(rows_ok, counter, L.CNT_ROWS_GATE)
    counter = tl.where(reason != 0, reason, counter)
    counter = tl.where(enabled, counter, L.CNT_SUSPENDED)
    # Relaxed: the counter only has to be claimed atomically; nothing reads the payload before
    # the kernel has finished (flush synchronizes the device first).
    old = tl.atomic_add(ctrl_ptr + base + counter, 1, mask=claimer, sem="relaxed").to(tl.int64)
    old = tl.where(claimer, old, 0)

    live = counter == L.CNT_WRITTEN
    # Decode steps begun: a step capture raises it past its own index (its claiming program does).
    steps_now = tl.load(ctrl_ptr + L.REG_STEPS).to(tl.int64)
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
    write, check_all, bad_step = _split_decision(ctrl_ptr + base + L.SLOT_CLAIM, phase, write, check_all, bad_step,
                                                 row_ok, pid)
    step = tl.where(kind == L.KIND_STEP, bad_step - 1, 0)  # bad_step is the step's index + 1 when it writes
    row_words = D if MEAN else H * D
    rows = tl.where(row_reg == L.ROW_ALL, T, 1)  # rows stored: all of them, or the one gathered

    if IS_INT:
        out_ptr = arena_ptr.to(tl.pointer_type(tl.int32))
    else:
        out_ptr = arena_ptr
    # A skipped call reads and writes nothing: it has no tiles. (Also sidesteps the
    # interpreter's dislike of scalar booleans broadcast into a mask.)
    limit = tl.where(write, D, 0)
    col_blocks = tl.cdiv(limit, BLOCK)
    tiles = tl.where(write, rows, 0) * col_blocks
    bad_read = tl.zeros([BLOCK], dtype=tl.int32)  # non-finite values among those read, per lane
    for tile in range(pid, tiles, programs):
        r = tile // col_blocks
        cols = (tile - r * col_blocks) * BLOCK + tl.arange(0, BLOCK)
        src_off = (row + r) * stride_t
        dest = offset + (step + r) * row_words
        if VEC > 1:
            src_off = tl.multiple_of(src_off, VEC)
            dest = tl.multiple_of(dest, STORE_VEC)
            col_off = cols  # stride_d == 1: contiguous, so Triton can vectorize
            mask_cols = cols < tl.multiple_of(limit, VEC)
        else:
            col_off = cols * stride_d
            mask_cols = cols < limit
        if MEAN:
            # HC_BLOCK hc rows are loaded before any is added, so their loads are in flight
            # together; they are then added one by one, in the reference kernel's order.
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for h0 in range(0, H, HC_BLOCK):
                v0 = _hc_row(x_ptr + src_off, h0, H, stride_h, col_off, cols, limit, VEC)
                v1 = _hc_row(x_ptr + src_off, h0 + 1, H, stride_h, col_off, cols, limit, VEC)
                v2 = _hc_row(x_ptr + src_off, h0 + 2, H, stride_h, col_off, cols, limit, VEC)
                v3 = _hc_row(x_ptr + src_off, h0 + 3, H, stride_h, col_off, cols, limit, VEC)
                bad_read += _nonfinite(v0) + _nonfinite(v1) + _nonfinite(v2) + _nonfinite(v3)
                # A row past H loaded as 0.0, and acc + 0.0 == acc (acc is never -0.0).
                acc += v0
                acc += v1
                acc += v2
                acc += v3
            # div_rn: IEEE division, the same rounding as torch's CPU division.
            val = tl.math.div_rn(acc, tl.full([BLOCK], H, tl.float32))
            tl.store(out_ptr + dest + cols, val, mask=mask_cols)
        else:
            for h in range(H):
                h_off = h * stride_h
                h_dest = h * D
                if VEC > 1:
                    h_off = tl.multiple_of(h_off, VEC)
                    h_dest = tl.multiple_of(h_dest, STORE_VEC)
                v = tl.load(x_ptr + src_off + h_off + col_off, mask=mask_cols, other=0.0)
                if IS_INT:
                    v = v.to(tl.int32)
                else:
                    v = v.to(tl.float32)
                    bad_read += _nonfinite(v)
                tl.store(out_ptr + dest + h_dest + cols, v, mask=mask_cols)

    # COMPILEDUMP_NONFINITE=all: every element of the input, whatever was kept.
    bad_all = tl.zeros([BLOCK], dtype=tl.int32)
    if not IS_INT:
        all_blocks = tl.cdiv(tl.where(check_all, D, 0), BLOCK)
        for tile in range(pid, T * H * all_blocks, programs):
            th = tile // all_blocks
            t = th // H
            cols = (tile - th * all_blocks) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + t * stride_t + (th - t * H) * stride_h + cols * stride_d, mask=cols < D, other=0.0)
            bad_all += _nonfinite(v.to(tl.float32))
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


@triton.jit
def _read_registers(ctrl_ptr, row_reg, BLOCK: tl.constexpr):
    """The header registers this call's decision depends on, one snapshot for the whole program:
    (enabled, rows within COMPILEDUMP_MAX_ROWS, the gather row's register as int64, check-all).

    Every thread loads the registers itself, and a register write from another stream that
    overlaps this launch could let threads see different values: one would gather another row,
    or skip the write that thread 0's claim committed (a torn row). The reads are packed into
    one int64 per thread and reduced with a block-wide max, so every thread of the program acts
    on one thread's snapshot, as every thread acts on thread 0's claim. (Programs of a
    multi-program launch each agree within themselves only: docs/compiling.md.)"""
    enabled = (tl.load(ctrl_ptr + L.REG_ENABLED) != 0).to(tl.int64)
    rows_ok = (tl.load(ctrl_ptr + L.REG_ROWS) <= tl.load(ctrl_ptr + L.REG_MAX_ROWS)).to(tl.int64)
    row = tl.load(ctrl_ptr + tl.maximum(row_reg, 0)).to(tl.int64) & 0xFFFFFFFF  # the int32's bits
    check_all = (tl.load(ctrl_ptr + L.REG_CHECK_ALL) != 0).to(tl.int64)
    packed = row | (enabled << 32) | (rows_ok << 33) | (check_all << 34)
    packed = tl.max(tl.full([BLOCK], 0, tl.int64) + packed, axis=0)
    row = (packed & 0xFFFFFFFF).to(tl.int32).to(tl.int64)  # back to the signed register value
    return ((packed >> 32) & 1) != 0, ((packed >> 33) & 1) != 0, row, ((packed >> 34) & 1) != 0


@triton.jit
def _split_decision(claim_ptr, phase, write, check_all, bad_step, row_ok, pid):
    """A split capture's decision (layout.SLOT_CLAIM): the claim launch publishes its own and
    copies nothing; every program of the copy launch takes the published one (whether it writes,
    the whole-input check, the date that is also the step index). Stream order makes the claim
    launch's word visible to the copy launch, so every program acts on the same claim. A copy
    program still checks its own gather row (a register write racing on another stream could have
    moved it out of range): it never reads past the input. A whole capture keeps its own.
    The word is per slot: two split captures of one tag in flight at once on two streams can
    cross (docs/compiling.md says so and names the fix, a tag per stream)."""
    published = (tl.minimum(bad_step, L.CLAIM_WRITES - 1) | tl.where(write, L.CLAIM_WRITES, 0)
                 | tl.where(check_all, L.CLAIM_CHECK_ALL, 0))
    tl.atomic_xchg(claim_ptr, published.to(tl.int32), mask=(pid == 0) & (phase == L.LAUNCH_CLAIM), sem="relaxed")
    copying = phase == L.LAUNCH_COPY
    claimed = tl.load(claim_ptr, mask=copying, other=0).to(tl.int64)
    write = tl.where(copying, ((claimed & L.CLAIM_WRITES) != 0) & row_ok, write & (phase != L.LAUNCH_CLAIM))
    check_all = tl.where(copying, (claimed & L.CLAIM_CHECK_ALL) != 0, check_all & (phase != L.LAUNCH_CLAIM))
    bad_step = tl.where(copying, claimed & (L.CLAIM_WRITES - 1), bad_step)
    return write, check_all, bad_step


@triton.jit
def _nonfinite(v):
    """1 where v is NaN or +-Inf (v in fp32), else 0."""
    return (~(tl.abs(v) < float("inf"))).to(tl.int32)


@triton.jit
def _hc_row(src, h, H, stride_h, col_off, cols, limit, VEC: tl.constexpr):
    """Row h of the hc axis as fp32 (0.0 where h >= H or past the row's end)."""
    h_off = h * stride_h
    row_limit = tl.where(h < H, limit, 0)
    if VEC > 1:
        h_off = tl.multiple_of(h_off, VEC)
        row_limit = tl.multiple_of(row_limit, VEC)
    return tl.load(src + h_off + col_off, mask=cols < row_limit, other=0.0).to(tl.float32)


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
                RELEASE=v.release, BLOCK=BLOCK)


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
        import triton

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
                                                    variants.commit_is_release(host_arena)), _prepare)
