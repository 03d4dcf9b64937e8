"""The reference capture kernel: plain numpy and torch on CPU tensors, with the Triton kernel's
exact semantics and accumulation order (ops/triton_kernel.py is the device twin,
kernels/capture_cpu.cpp the native one; tests hold all three bit-identical). Dtypes numpy can view
are written through numpy views (cheaper per call: this kernel is the capture path where no native
library is built); bfloat16, fp8 and the wide unsigned types through torch.

Reading the control block here is a plain CPU memory read: there is no device to sync with.
The caller (ops/register.py) holds the kernel lock, so the counter update and the write are one
step, as the device kernel's atomic makes them.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import layout as L
from .geometry import geometry


def capture_reference(x, arena, ctrl, kind, base, offset, capacity, reason) -> None:
    """Run one capture: pick and bump exactly one counter of the slot at `base` (the claim), then
    (if the capture is kept) write its payload at arena word `offset` (+ step x payload for steps),
    for the record kinds its token count T into the slot's SLOT_KEPT_TOKENS word, and bump
    SLOT_COMMITTED (the commit). Non-finite input values are counted in SLOT_NONFINITE, the first
    call that saw one dated in SLOT_BAD_STEP/SLOT_BAD_TOKENS (ops/layout.py)."""
    src, (T, H, D, st, sh, sd, row_reg, mean) = geometry(x, kind)
    all_rows = row_reg == L.ROW_ALL
    regs = _numpy_view(ctrl)
    enabled = regs[L.REG_ENABLED] != 0
    rows_ok = kind != L.KIND_STEP or regs[L.REG_ROWS] <= regs[L.REG_MAX_ROWS]
    row = 0 if row_reg < 0 else int(regs[row_reg])
    if row < 0:
        row += T
    row_ok = 0 <= row < T

    # Exactly one counter per call; this order is the precedence of the reasons.
    if not enabled:
        counter = L.CNT_SUSPENDED
    elif reason != 0:
        counter = reason
    elif not rows_ok:
        counter = L.CNT_ROWS_GATE
    elif not row_ok:
        counter = L.CNT_ROW_OUT_OF_RANGE
    else:
        counter = L.CNT_WRITTEN
    old = int(regs[base + counter])
    regs[base + counter] = old + 1
    live = counter == L.CNT_WRITTEN
    step_now = int(regs[L.REG_STEPS])
    if live and kind == L.KIND_STEP:
        regs[L.REG_STEPS] = max(step_now, old + 1)
    write = live and not (kind == L.KIND_RECORD_ONCE and old != 0) and not (kind == L.KIND_STEP and old >= capacity)
    check_all = enabled and regs[L.REG_CHECK_ALL] != 0
    bad = _nonfinite(src) if check_all and kind != L.KIND_IDS else 0
    tokens = T if row_reg != L.ROW_FIXED_ZERO else 0  # the call's token count; a tensor stored whole has none
    if write:
        if kind in L.RECORD_KINDS:  # the kept call's token count
            regs[base + L.SLOT_KEPT_TOKENS] = tokens
        read_bad = _write(src, arena, kind, old, offset, T, H, D, st, sh, sd, row_reg, row, mean, all_rows)
        regs[base + L.SLOT_COMMITTED] += 1
        if not check_all:
            bad = read_bad
    if bad:
        # Added only below the cap, at most the cap at once (the device kernels' rule: a check
        # and an add, no compare-and-swap loop): the count stays below 2^31.
        if regs[base + L.SLOT_NONFINITE] < L.NONFINITE_CAP:
            regs[base + L.SLOT_NONFINITE] += min(bad, L.NONFINITE_CAP)
        if regs[base + L.SLOT_BAD_STEP] == 0:
            regs[base + L.SLOT_BAD_STEP] = 1 + (old if live and kind == L.KIND_STEP else step_now)
            regs[base + L.SLOT_BAD_TOKENS] = tokens


def _write(src, arena, kind, old, offset, T, H, D, st, sh, sd, row_reg, row, mean, all_rows) -> int:
    """Store a kept capture's payload; returns the non-finite elements among the values read."""
    step = old if kind == L.KIND_STEP else 0
    rows = T if all_rows else 1
    words = D if mean else H * D
    dest = offset + step * words
    if src.dtype in _NUMPY_DTYPES:
        if src.requires_grad:  # below autograd the flag may still be set; numpy() refuses it
            src = src.detach()
        return _write_numpy(src.numpy(), _numpy_view(arena), kind, dest, rows, words, row_reg, row, mean)
    # The row(s) as [rows, H, D] with the caller's strides (no copy).
    view = src.as_strided((rows, H, D), (st, sh, sd), src.storage_offset() + (0 if all_rows else row) * st)
    if kind == L.KIND_IDS:
        arena.view(torch.int32)[dest : dest + words].view(H, D).copy_(view[0])
    elif mean:
        # As the kernels: each element to fp32 (exact for every input dtype), then
        # ((h0 + h1) + h2) + ... and one division, through numpy in h order (torch.mean's
        # vectorized order differs by an ulp for hc_mult above 4).
        with np.errstate(all="ignore"):  # Inf - Inf is NaN, as in the kernels
            _store_numpy(view.to(torch.float32).numpy(), _numpy_view(arena)[dest : dest + rows * words], True)
    else:
        arena[dest : dest + rows * words].view(rows, H, D).copy_(view)
    # A non-finite input makes its stored value (copy or hc mean) non-finite: check the fp32 output
    # first (cheap), count the inputs only when it is not all finite (a finite sum may overflow).
    if kind == L.KIND_IDS or np.isfinite(_numpy_view(arena)[dest : dest + rows * words]).all():
        return 0
    return _nonfinite(view)


# Input dtypes numpy can view; the others (bfloat16, fp8, uint16-64) are written by torch above.
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.uint8, torch.bool})


def _write_numpy(src, out, kind, dest, rows, words, row_reg, row, mean) -> int:
    """`_write` through numpy views of the input and the arena: the values of the torch calls
    above, with the hc mean in the kernel's exact order, for a few microseconds less per call.
    Returns the non-finite elements among the values read.

    `src` is the tensor `geometry` returned, as numpy: `[T, D]` or `[T, H, D]` rows, or a tensor
    stored whole (ROW_FIXED_ZERO: every element, in order).
    """
    if row_reg == L.ROW_FIXED_ZERO:
        value = src.reshape(-1)
    elif row_reg == L.ROW_ALL:
        value = src
    else:
        value = src[row]
    target = out[dest : dest + rows * words]
    if kind == L.KIND_IDS:
        target.view(np.int32)[:] = value.reshape(-1)
        return 0
    bad = _nonfinite(value)
    if bad:  # Inf - Inf in the hc mean is NaN, as in the kernels: no numpy warning about it
        with np.errstate(all="ignore"):
            _store_numpy(value, target, mean)
    else:
        _store_numpy(value, target, mean)
    return bad


def _store_numpy(value, target, mean) -> None:
    if mean:
        # The kernel's order: each element to fp32, then ((h0 + h1) + h2) + ..., then one division.
        # Row by row, not np.add.reduce: when numpy's iterator makes the hc axis its inner loop
        # (a transposed input, or dim 1) it sums that axis pairwise, in another order.
        acc = target.reshape(value.shape[:-2] + value.shape[-1:])
        np.copyto(acc, value[..., 0, :], casting="unsafe")
        for h in range(1, value.shape[-2]):
            np.add(acc, value[..., h, :], out=acc, dtype=np.float32, casting="unsafe")
        np.divide(acc, np.float32(value.shape[-2]), out=acc)
    else:
        target[:] = value.reshape(-1)


# The numpy views of the live arenas and control blocks: `Tensor.numpy()` costs about as much as
# the rest of a small capture, and a process writes into the same two tensors every call. An entry
# goes with its tensor (the weak reference's callback), so a reset arena is freed as before.
_views: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    key = id(t)
    entry = _views.get(key)
    if entry is not None and entry[0]() is t:
        return entry[1]
    view = t.numpy()
    _views[key] = (weakref.ref(t, lambda _ref, key=key: _views.pop(key, None)), view)
    return view


def _nonfinite(t) -> int:
    """Non-finite elements of a tensor or array as the kernels store them, in fp32 (a float64
    past fp32's range counts); 0 for integer and bool dtypes."""
    if isinstance(t, np.ndarray):
        if t.dtype.kind != "f":
            return 0
        if t.dtype == np.float64:
            with np.errstate(over="ignore"):
                t = t.astype(np.float32)
        finite = np.isfinite(t)
        return 0 if finite.all() else int(t.size - np.count_nonzero(finite))
    if not t.dtype.is_floating_point:
        return 0
    return int(t.numel() - torch.isfinite(t.float()).sum())
