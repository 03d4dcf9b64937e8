"""The capture kernel's steps, as Triton device functions (ops/triton_kernel.py calls them in order).

Inlined into the kernel when it compiles. All offset math is 64-bit; on the contiguous fast path
(VEC > 1) the `tl.multiple_of` hints let Triton emit 16-byte vector loads and stores.
"""

import triton
import triton.language as tl

from . import layout as L

HC_BLOCK = tl.constexpr(4)  # hc rows loaded together (hc_mult is 4 in the models this targets); unrolled below


@triton.jit
def read_registers(ctrl_ptr, row_reg, BLOCK: tl.constexpr):
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
def split_decision(claim_ptr, phase, write, check_all, bad_step, row_ok, pid):
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
def nonfinite(v):
    """1 where v is NaN or +-Inf (v in fp32), else 0."""
    return (~(tl.abs(v) < float("inf"))).to(tl.int32)


@triton.jit
def tile_at(tile, col_blocks, row, stride_t, stride_d, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Tile `tile` of the rows stored (col_blocks tiles a row): its columns, the word offset of
    its input row, and the columns' offsets in it."""
    r = tile // col_blocks
    cols = (tile - r * col_blocks) * BLOCK + tl.arange(0, BLOCK)
    src_off = (row + r) * stride_t
    if VEC > 1:
        return cols, tl.multiple_of(src_off, VEC), cols  # stride_d == 1: contiguous, so Triton can vectorize
    return cols, src_off, cols * stride_d


@triton.jit
def hc_row(x_ptr, src_off, h, H, stride_h, col_off, cols, limit, VEC: tl.constexpr):
    """Row h of the hc axis, in the input's type (0 where h >= H or past `limit`)."""
    off = src_off + h * stride_h
    row_limit = tl.where(h < H, limit, 0)
    if VEC > 1:
        # On the sum: with h a constant 1, h * stride_h folds to the argument, which takes no hint.
        off = tl.multiple_of(off, VEC)
        row_limit = tl.multiple_of(row_limit, VEC)
    return tl.load(x_ptr + off + col_off, mask=cols < row_limit, other=0.0)


@triton.jit
def copy_tile(x_ptr, out_ptr, tile, col_blocks, row, step, offset, limit, H, D, stride_t, stride_h, stride_d,
              e0, e1, e2, e3, reuse, EARLY: tl.constexpr, MEAN: tl.constexpr, IS_INT: tl.constexpr,
              VEC: tl.constexpr, STORE_VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Store tile `tile` of the rows kept (columns below `limit`; none when it is 0) at step `step`
    of the region at `offset`: averaged over the hc axis in fp32 (MEAN) or copied, cast to float32
    (int32 for ids). Returns the NaN/Inf values read, per lane. With VEC > 1, `limit` is a multiple
    of VEC, hinted by the caller: a hint needs the operation that makes the value, which an
    argument is not.

    With EARLY, where `reuse` is true the tile's first hc rows are e0..e3 (or e0 alone without
    MEAN), loaded before the claim, instead of being loaded again."""
    cols, src_off, col_off = tile_at(tile, col_blocks, row, stride_t, stride_d, VEC, BLOCK)
    dest = offset + (step + tile // col_blocks) * (D if MEAN else H * D)
    if VEC > 1:
        dest = tl.multiple_of(dest, STORE_VEC)
    mask_cols = cols < limit
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    if MEAN:
        # HC_BLOCK hc rows are loaded before any is added, so their loads are in flight
        # together; they are then added one by one, in the reference kernel's order.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for h0 in range(0, H, HC_BLOCK):
            take = reuse & (h0 == 0)
            v0 = _row(e0, take, x_ptr, src_off, h0, H, stride_h, col_off, cols, limit, EARLY, VEC).to(tl.float32)
            v1 = _row(e1, take, x_ptr, src_off, h0 + 1, H, stride_h, col_off, cols, limit, EARLY, VEC).to(tl.float32)
            v2 = _row(e2, take, x_ptr, src_off, h0 + 2, H, stride_h, col_off, cols, limit, EARLY, VEC).to(tl.float32)
            v3 = _row(e3, take, x_ptr, src_off, h0 + 3, H, stride_h, col_off, cols, limit, EARLY, VEC).to(tl.float32)
            bad += nonfinite(v0) + nonfinite(v1) + nonfinite(v2) + nonfinite(v3)
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
            h_dest = h * D
            if VEC > 1:
                h_dest = tl.multiple_of(h_dest, STORE_VEC)
            v = _row(e0, reuse & (h == 0), x_ptr, src_off, h, H, stride_h, col_off, cols, limit, EARLY, VEC)
            if IS_INT:
                v = v.to(tl.int32)
            else:
                v = v.to(tl.float32)
                bad += nonfinite(v)
            tl.store(out_ptr + dest + h_dest + cols, v, mask=mask_cols)
    return bad


@triton.jit
def _row(early, take, x_ptr, src_off, h, H, stride_h, col_off, cols, limit, EARLY: tl.constexpr, VEC: tl.constexpr):
    """Row h of the hc axis: `early` where `take` (then not loaded again), else loaded now."""
    if EARLY:
        v = tl.where(take, early, hc_row(x_ptr, src_off, h, H, stride_h, col_off, cols, tl.where(take, 0, limit), VEC))
    else:
        v = hc_row(x_ptr, src_off, h, H, stride_h, col_off, cols, limit, VEC)
    return v
