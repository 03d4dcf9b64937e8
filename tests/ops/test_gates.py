"""Gate precedence in every kernel: exactly one counter per call, in a fixed order.

suspended > host-decided reason (token gate, shape changed, arena full, tag table full) >
rows gate (steps only) > row out of range > written. Each case sets two gates at once and
names the one that must win; docs/api.md states the same order.
"""

import pytest
import torch

from compiledump.ops import layout as L
from compiledump.ops import native, reference, register

KERNELS = {"reference": reference.capture_reference, "triton": register.capture_triton}
if native.native_available():
    KERNELS["native"] = register.capture_native

# (case, kind, enabled, host reason, rows reported, gather row, expected counter)
CASES = [
    ("suspended beats a host reason", L.KIND_RECORD, 0, L.CNT_TOKEN_GATE, 1, -1, L.CNT_SUSPENDED),
    ("suspended beats the rows gate", L.KIND_STEP, 0, 0, 9, 0, L.CNT_SUSPENDED),
    ("host reason beats the rows gate", L.KIND_STEP, 1, L.CNT_SHAPE_CHANGED, 9, 0, L.CNT_SHAPE_CHANGED),
    ("host reason beats a bad row", L.KIND_RECORD, 1, L.CNT_ARENA_FULL, 1, 40, L.CNT_ARENA_FULL),
    ("rows gate beats a bad row", L.KIND_STEP, 1, 0, 9, 40, L.CNT_ROWS_GATE),
    ("rows gate is for steps only", L.KIND_RECORD, 1, 0, 9, -1, L.CNT_WRITTEN),
    ("bad row alone", L.KIND_STEP, 1, 0, 1, -7, L.CNT_ROW_OUT_OF_RANGE),
    ("a kept step", L.KIND_STEP, 1, 0, 1, 2, L.CNT_WRITTEN),
    ("a kept all-rows record", L.KIND_RECORD_ROWS, 1, 0, 9, 40, L.CNT_WRITTEN),  # no row to be out of range
    ("negative rows count from the end", L.KIND_RECORD, 1, 0, 1, -5, L.CNT_WRITTEN),
    ("one past the end", L.KIND_RECORD, 1, 0, 1, 5, L.CNT_ROW_OUT_OF_RANGE),
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case, kind, enabled, reason, rows, row, expected", CASES, ids=[c[0] for c in CASES])
def test_gate_precedence(kernel, case, kind, enabled, reason, rows, row, expected):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 3, generator=g)
    arena = torch.full((64,), float("nan"))  # room for all 5 x 3 rows
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS] = enabled, rows, 1
    ctrl[L.REG_RECORD_ROW] = ctrl[L.REG_STEP_ROW] = row
    KERNELS[kernel](x, arena, ctrl, kind, L.slot_base(1), 8, 4, reason)
    counters = ctrl[L.slot_base(1) : L.slot_base(1) + L.SLOT_COUNTERS].tolist()
    assert counters == [int(c == expected) for c in range(L.SLOT_COUNTERS)], case
    kept_tokens = int(ctrl[L.slot_base(1) + L.SLOT_KEPT_TOKENS])
    if expected == L.CNT_WRITTEN:
        want = x.reshape(-1) if kind == L.KIND_RECORD_ROWS else x[row]
        torch.testing.assert_close(arena[8 : 8 + want.numel()], want, rtol=0, atol=0)
        # A kept record notes the token count of the call it came from; a step does not.
        assert kept_tokens == (5 if kind in L.RECORD_KINDS else 0)
    else:
        assert torch.isnan(arena).all(), "a gated capture wrote"
        assert kept_tokens == 0
