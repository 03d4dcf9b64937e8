"""Shape rules of a capture: what one capture stores, when the token gate skips it, and how the
kernels view the input (`[T, H, D]` plus the row to take).

Pure functions of shapes and kinds, shared by the tag registry (capture/arena.py), the export
gates (ops/register.py) and every kernel, so that they cannot disagree.
"""

from __future__ import annotations

import math

import torch

from . import layout as L

# The kinds COMPILEDUMP_TOKENS gates (record_once and steps are never token-gated).
TOKEN_GATED_KINDS = (L.KIND_RECORD, L.KIND_RECORD_ROWS, L.KIND_IDS)


def token_gated(x_shape, kind: int, tokens: int) -> bool:
    """True when the token gate skips a capture of this shape (`shape[0]` is not the prompt length)."""
    return bool(tokens) and kind in TOKEN_GATED_KINDS and len(x_shape) > 0 and x_shape[0] != tokens


def payload_shape(x_shape: tuple, kind: int) -> tuple:
    """Shape of what one capture of a tensor of shape `x_shape` stores (docs/format.md, "Keys")."""
    if kind == L.KIND_IDS:
        return x_shape
    if kind == L.KIND_STEP:
        return x_shape[1:] if len(x_shape) >= 2 else x_shape
    if kind == L.KIND_RECORD_ROWS:
        return (x_shape[0], x_shape[-1])
    if len(x_shape) in (2, 3):
        return x_shape[-1:]
    return (math.prod(x_shape),)


def geometry(x: torch.Tensor, kind: int) -> tuple[torch.Tensor, tuple]:
    """View `x` as `[T, H, D]` for the kernel: returns (tensor to read, geometry tuple).

    The geometry is (T, H, D, stride_t, stride_h, stride_d, row_reg, mean). `record` of a 3-D
    tensor averages H; all-rows records (2-D or 3-D only) take every row (row_reg ROW_ALL); a
    step of a >=2-D tensor copies row `x[r]` whole (H x D words); anything stored whole is one row. Strides are passed through, so non-contiguous inputs are read in
    place; only tensors of 4 or more dims that cannot be viewed are copied first.
    """
    dim = x.dim()
    if kind == L.KIND_RECORD_ROWS:
        return _rows(x, L.ROW_ALL, mean=dim == 3)
    if kind in (L.KIND_RECORD, L.KIND_RECORD_ONCE) and dim in (2, 3):
        return _rows(x, L.REG_RECORD_ROW, mean=dim == 3)
    if kind == L.KIND_STEP and dim >= 2:
        if dim > 3:
            x = x.reshape(x.shape[0], -1, x.shape[-1])
        return _rows(x, L.REG_STEP_ROW, mean=False)
    # Stored whole: one row of H x D words.
    if dim == 0:
        return x, (1, 1, 1, 0, 0, 0, L.ROW_FIXED_ZERO, False)
    if dim == 1:
        return x, (1, 1, x.shape[0], 0, 0, x.stride(0), L.ROW_FIXED_ZERO, False)
    if x.is_contiguous():
        # One flat row: the kernels copy it as one long contiguous run (no walk row by row).
        return x, (1, 1, x.numel(), 0, 0, 1, L.ROW_FIXED_ZERO, False)
    if dim > 2:
        x = x.reshape(x.shape[0], -1)
    return x, (1, x.shape[0], x.shape[1], 0, x.stride(0), x.stride(1), L.ROW_FIXED_ZERO, False)


def _rows(x: torch.Tensor, row_reg: int, mean: bool) -> tuple[torch.Tensor, tuple]:
    """A 2-D `[T, D]` (as H = 1) or 3-D `[T, H, D]` tensor whose row comes from `row_reg`."""
    if x.dim() == 2:
        return x, (x.shape[0], 1, x.shape[1], x.stride(0), 0, x.stride(1), row_reg, mean)
    return x, (*x.shape, *x.stride(), row_reg, mean)
