"""The comparator's per-array metrics against independent formulas.

Expected values are computed here with numpy (float64) or exactly with fractions, never with
compiledump.compare; data is random (never zeros) and sizes are odd where it matters.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiledump.compare import bf16_spacing, compare_float_arrays, compare_id_arrays


def cancelling_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """rel_diff's definition, 1 - 2<x,y>/(|x|^2+|y|^2): fine for clearly different vectors."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(1 - 2 * a.dot(b) / (a.dot(a) + b.dot(b)))


def exact_sums(a: np.ndarray, b: np.ndarray) -> tuple[Fraction, Fraction, Fraction]:
    """|x-y|^2, |x|^2 and |y|^2 in exact rational arithmetic on the float64 values."""
    xs = [Fraction(float(v)) for v in np.ravel(a)]
    ys = [Fraction(float(v)) for v in np.ravel(b)]
    return (sum((x - y) ** 2 for x, y in zip(xs, ys)), sum(x * x for x in xs), sum(y * y for y in ys))


def exact_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """|x-y|^2/(|x|^2+|y|^2), exactly."""
    dd, xx, yy = exact_sums(a, b)
    return float(dd / (xx + yy))


def test_float_metrics_match_numpy_formulas_across_chunks():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(10_007).astype(np.float32) * 3 + 1
    y = (x + rng.standard_normal(x.size).astype(np.float32) * 0.05).astype(np.float32)
    got = compare_float_arrays(x, y, margins=True, chunk=1000)
    a, b = x.astype(np.float64), y.astype(np.float64)
    assert got.rel_diff == pytest.approx(cancelling_rel_diff(a, b), rel=1e-9)
    assert got.cosine == pytest.approx(a.dot(b) / np.sqrt(a.dot(a) * b.dot(b)), rel=1e-12)
    assert got.max_abs == pytest.approx(np.max(np.abs(a - b)), rel=1e-12)
    assert got.mean_abs == pytest.approx(np.mean(np.abs(a - b)), rel=1e-9)
    assert got.rel_l2 == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(a), rel=1e-9)
    ref_sorted, run_sorted = np.sort(a), np.sort(b)
    assert got.margins.ref.argmax == int(np.argmax(a)) and got.margins.run.argmax == int(np.argmax(b))
    assert got.margins.ref.margin == pytest.approx(ref_sorted[-1] - ref_sorted[-2], abs=1e-12)
    assert got.margins.run.margin == pytest.approx(run_sorted[-1] - run_sorted[-2], abs=1e-12)
    assert got.margins.ref.top1 == ref_sorted[-1]
    assert got.nan_ref == got.nan_run == got.nonfinite_mismatch == 0
    assert got.compared_elements == x.size


@pytest.mark.parametrize("size,chunk", [(1001, 1001), (1001, 7), (999, 256)])
def test_rel_diff_of_nearly_equal_vectors_does_not_cancel(size, chunk):
    """y = x(1+1e-9): rel_diff is about 5e-19. The cancelling form 1 - 2<x,y>/(...) gives 0 or
    a rounding error of order 1e-16 instead; the computed value must match the exact one."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(size) * 2.5 + 0.3
    y = x * (1 + 1e-9)
    expected = exact_rel_diff(x, y)
    assert 1e-19 < expected < 1e-18
    got = compare_float_arrays(x, y, chunk=chunk)
    assert 0 < got.rel_diff < 1e-15
    assert got.rel_diff == pytest.approx(expected, rel=1e-6, abs=0)  # approx's default abs=1e-12 would pass anything
    # rel_l2 and mean_abs see the same tiny difference, not zero.
    dd, xx, _ = exact_sums(x, y)
    assert got.rel_l2 == pytest.approx(math.sqrt(dd / xx), rel=1e-6, abs=0)
    assert got.mean_abs == pytest.approx(np.mean(np.abs(x - y)), rel=1e-9, abs=0)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(2, 3000), chunk=st.integers(1, 700), seed=st.integers(0, 2**31 - 1))
def test_chunking_never_changes_the_result(size, chunk, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size)
    y = x + rng.standard_normal(size) * rng.uniform(0, 2)
    whole = compare_float_arrays(x, y, margins=True, chunk=size)
    parts = compare_float_arrays(x, y, margins=True, chunk=chunk)
    for name in ("rel_diff", "cosine", "max_abs", "mean_abs", "rel_l2"):
        assert getattr(parts, name) == pytest.approx(getattr(whole, name), rel=1e-9, abs=1e-12)
    for side in ("ref", "run"):
        assert getattr(parts.margins, side).margin == pytest.approx(getattr(whole.margins, side).margin,
                                                                    rel=1e-9, abs=1e-12)
    assert (parts.margins.ref.argmax, parts.margins.run.argmax) == (int(np.argmax(x)), int(np.argmax(y)))
    assert 0.0 <= whole.rel_diff <= 2.0


def test_nonfinite_values_are_counted_and_only_one_sided_ones_diverge():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(501)
    y = x + rng.standard_normal(501) * 1e-4
    x[[3, 9]] = -np.inf  # masked logits on both sides agree
    y[[3, 9]] = -np.inf
    x[17] = y[17] = np.nan
    same = compare_float_arrays(x, y)
    assert (same.nan_ref, same.nan_run, same.inf_ref, same.inf_run) == (1, 1, 2, 2)
    assert same.nonfinite_mismatch == 0 and same.compared_elements == 501 - 3
    finite = np.isfinite(x)
    assert same.rel_diff == pytest.approx(exact_rel_diff(x[finite], y[finite]), rel=1e-9)
    y[40] = np.nan
    y[41] = np.inf
    y[3] = np.inf  # -inf vs +inf disagrees
    worse = compare_float_arrays(x, y)
    assert worse.nonfinite_mismatch == 3
    assert (worse.nan_run, worse.inf_run) == (2, 3)


def test_nan_never_wins_the_argmax():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(333)
    x[[0, 100]] = np.nan
    got = compare_float_arrays(x, x.copy(), margins=True, chunk=50)
    finite = np.where(np.isnan(x), -np.inf, x)
    ordered = np.sort(finite)
    assert got.margins.ref.argmax == int(np.argmax(finite))
    assert got.margins.ref.margin == pytest.approx(ordered[-1] - ordered[-2], abs=1e-12)


def test_id_comparison_reports_first_row_and_overlap():
    rng = np.random.default_rng(3)
    ref = np.stack([rng.choice(64, 7, replace=False) for _ in range(5)]).astype(np.int32)
    run = ref.copy()
    run[3, [1, 5]] = [100, 101]
    run[4] = run[4][::-1]  # same set, other order: still a mismatch, overlap 7/7
    got = compare_id_arrays(ref, run)
    assert not got.ids_equal
    assert got.first_mismatch_row == 3
    assert got.overlap == len(set(ref[3]) & set(run[3])) == 5 and got.k == 7
    assert got.mismatched_rows == 2 and got.rows == 5
    assert got.mismatched_elements == int((ref != run).sum())
    assert got.first_mismatch_index == int(np.flatnonzero(ref.ravel() != run.ravel())[0])
    assert got.ref_ids == sorted(set(ref[3].tolist())) and got.run_ids == sorted(set(run[3].tolist()))
    same = compare_id_arrays(ref, ref.copy())
    assert same.ids_equal and same.mismatched_elements == 0 and same.total_elements == ref.size
    assert same.first_mismatch_row is None


def test_one_dimensional_ids_are_one_row():
    rng = np.random.default_rng(5)
    ref = rng.integers(0, 1000, 17).astype(np.int32)
    run = ref.copy()
    run[[4, 11]] += 1
    got = compare_id_arrays(ref, run)
    assert got.first_mismatch_row is None and got.first_mismatch_index == 4
    assert got.rows == 1 and got.mismatched_rows == 1 and got.mismatched_elements == 2


def test_bf16_spacing():
    for value in (0.3, 1.0, 12.4, 31.9, 40.0, -17.0):
        # bf16 keeps 8 significant bits: spacing is 2^(floor(log2|v|) - 7).
        assert bf16_spacing(value) == 2.0 ** (math.floor(math.log2(abs(value))) - 7)
    assert bf16_spacing(0.0) == 0.0 and bf16_spacing(math.inf) == 0.0


def test_zero_vectors_have_defined_metrics():
    rng = np.random.default_rng(52)
    x = rng.standard_normal(63)
    both_zero = compare_float_arrays(np.zeros(63), np.zeros(63))
    assert (both_zero.rel_diff, both_zero.cosine, both_zero.rel_l2) == (0.0, 1.0, 0.0)
    one_zero = compare_float_arrays(np.zeros(63), x)
    assert one_zero.rel_diff == pytest.approx(1.0) and one_zero.cosine is None and one_zero.rel_l2 is None
    opposite = compare_float_arrays(x, -x)
    assert opposite.rel_diff == pytest.approx(2.0) and opposite.cosine == pytest.approx(-1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rows_of_zeros_on_both_sides_read_as_equal(dtype):
    """A row that is zero on both sides (an indexer's first token after ReLU, or all masked -inf)
    beside nonzero rows: norm_diff 0 there (it divided by zero before), the other rows as numpy says."""
    from compiledump.compare.metrics import compare_rows

    rng = np.random.default_rng(7)
    ref = rng.standard_normal((5, 13)).astype(dtype)
    run = (ref * (1 + 1e-2 * rng.standard_normal((5, 13)))).astype(dtype)
    ref[2] = run[2] = 0
    ref[3, 4:] = run[3, 4:] = -np.inf
    ref[3, :4] = run[3, :4] = 0
    rows = compare_rows(ref, run)
    assert rows.norm_diff[2] == 0.0 and rows.norm_diff[3] == 0.0 and rows.rel_diff[2] == 0.0
    x, y = ref.astype(np.float64), run.astype(np.float64)
    median = float(np.median([np.dot(r[np.isfinite(r)], r[np.isfinite(r)]) for r in x]))
    for row in (0, 1, 4):
        nx, ny = np.linalg.norm(x[row]), np.linalg.norm(y[row])
        assert rows.norm_diff[row] == pytest.approx(abs(ny - nx) / max(nx, math.sqrt(median)), rel=1e-9)
