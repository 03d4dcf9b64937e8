"""The capture kernel: one Triton program per capture call.

One launch fuses everything a capture needs, so a CUDA graph holds exactly one node per capture
point and every decision that may change between replays is read from device memory:

1. read the header registers (enabled flag, rows gate, gather row) from the control block;
2. pick exactly one counter of the tag's slot and `atomic_add` it; the old value of the
   written-counter is the step index (append) or tells whether this is the first write (keep-first);
3. gather the row, average over the hc axis in fp32 (or copy it), cast, and store into the arena.

The payload is one row (hc_mult x dim at most), so a single program that walks the row in blocks
is enough; it also makes the counter update and the write trivially ordered.

Under `TRITON_INTERPRET=1` the same kernel runs on CPU tensors, which is how the tests check it
against the CPU implementation without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout as L

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["T", "H", "D", "stride_t", "stride_h", "stride_d", "base", "offset", "capacity"])
def capture_kernel(
    x_ptr,
    arena_ptr,
    ctrl_ptr,
    T,
    H,
    D,
    stride_t,
    stride_h,
    stride_d,
    base,  # word index of the slot's counters in the control block
    offset,  # word offset of the slot's region in the arena (-1: no region)
    capacity,  # steps the region holds (1 unless KIND == STEP)
    kind,  # layout.KIND_*
    reason,  # host-decided drop counter (0: none)
    row_reg,  # header register holding the row to gather (ROW_FIXED_ZERO: row 0; ROW_ALL: every row)
    MEAN: tl.constexpr,  # average over H (else copy H x D)
    IS_INT: tl.constexpr,  # record_ids: store int32 (any other kind converts to float32)
    BLOCK: tl.constexpr,
):
    enabled = tl.load(ctrl_ptr + L.REG_ENABLED) != 0
    rows_ok = tl.load(ctrl_ptr + L.REG_ROWS) <= tl.load(ctrl_ptr + L.REG_MAX_ROWS)
    rows_ok = rows_ok | (kind != L.KIND_STEP)
    row = tl.load(ctrl_ptr + tl.maximum(row_reg, 0))
    row = tl.where(row_reg < 0, 0, row)
    row = tl.where(row < 0, row + T, row)
    row_ok = (row >= 0) & (row < T)

    # Exactly one counter per call; the order is the precedence of the reasons.
    counter = tl.where(row_ok, L.CNT_WRITTEN, L.CNT_ROW_OUT_OF_RANGE)
    counter = tl.where(rows_ok, counter, L.CNT_ROWS_GATE)
    counter = tl.where(reason != 0, reason, counter)
    counter = tl.where(enabled, counter, L.CNT_SUSPENDED)
    old = tl.atomic_add(ctrl_ptr + base + counter, 1)

    live = counter == L.CNT_WRITTEN
    # keep-first writes only on the first live call; append only while the region has room.
    write = live & ((kind != L.KIND_RECORD_ONCE) | (old == 0))
    write = write & ((kind != L.KIND_STEP) | (old < capacity))
    # The record kinds note the token count of the capture the dump now holds.
    is_record = (kind == L.KIND_RECORD) | (kind == L.KIND_RECORD_ONCE) | (kind == L.KIND_RECORD_ROWS)
    kept_tokens = tl.where(row_reg == L.ROW_FIXED_ZERO, 0, T)  # a tensor stored whole has no token count
    tl.atomic_xchg(ctrl_ptr + base + L.SLOT_KEPT_TOKENS, kept_tokens.to(tl.int32), mask=write & is_record)
    step = tl.where(kind == L.KIND_STEP, old, 0)
    row_words = D if MEAN else H * D
    rows = tl.where(row_reg == L.ROW_ALL, T, 1)  # rows stored: all of them, or the one gathered

    if IS_INT:
        out_ptr = arena_ptr.to(tl.pointer_type(tl.int32))
    else:
        out_ptr = arena_ptr
    # A skipped call reads and writes nothing: the loop bounds are zero. (Also sidesteps the
    # interpreter's dislike of scalar booleans broadcast into a mask.)
    limit = tl.where(write, D, 0)
    for r in range(0, tl.where(write, rows, 0)):
        src = x_ptr + (row + r) * stride_t
        dest = offset + (step + r) * row_words
        for d0 in range(0, limit, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            mask = cols < limit
            if MEAN:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for h in range(0, H):
                    acc += tl.load(src + h * stride_h + cols * stride_d, mask=mask, other=0).to(tl.float32)
                # div_rn: IEEE division, the same rounding as torch's CPU division.
                val = tl.math.div_rn(acc, tl.full([BLOCK], H, tl.float32))
                tl.store(out_ptr + dest + cols, val, mask=mask)
            else:
                for h in range(0, H):
                    v = tl.load(src + h * stride_h + cols * stride_d, mask=mask, other=0)
                    if IS_INT:
                        v = v.to(tl.int32)
                    else:
                        v = v.to(tl.float32)
                    tl.store(out_ptr + dest + h * D + cols, v, mask=mask)


def launch(x, arena, ctrl, geometry, base, offset, capacity, kind, reason):
    """Launch the capture kernel for one call (grid of one program)."""
    T, H, D, st, sh, sd, row_reg, mean = geometry
    capture_kernel[(1,)](
        x, arena, ctrl, T, H, D, st, sh, sd, base, offset, capacity, kind, reason, row_reg,
        MEAN=mean, IS_INT=kind == L.KIND_IDS, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
