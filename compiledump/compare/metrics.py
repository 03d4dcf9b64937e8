"""The numbers the comparator reports for one pair of arrays: float metrics accumulated in
float64 chunk by chunk, exact integer-id comparison, top-1/top-2 margins."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Elements converted to float64 at once per side; bounds memory for arbitrarily large keys.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class Top2:
    """Argmax and top-1 minus top-2 margin of one side's logits."""

    argmax: int | None
    top1: float
    margin: float  # NaN with fewer than two elements


@dataclass(frozen=True)
class Margins:
    """Argmax, margin and top-1 of both sides."""

    ref: Top2
    run: Top2


@dataclass(frozen=True)
class FloatMetrics:
    """:func:`compare_float_arrays`'s result."""

    rel_diff: float
    cosine: float | None
    max_abs: float | None
    mean_abs: float | None
    rel_l2: float | None
    nan_ref: int
    nan_run: int
    inf_ref: int
    inf_run: int
    nonfinite_mismatch: int
    compared_elements: int
    margins: Margins | None = None
    # |‖y‖ − ‖x‖| / ‖x‖ (x = REF): the scale error; None when REF is all zero and RUN is not.
    norm_diff: float | None = None


@dataclass(frozen=True)
class IdMetrics:
    """:func:`compare_id_arrays`'s result; the fields after ``total_elements`` are set when the
    ids differ (``first_mismatch_row`` is None for arrays of rank <= 1)."""

    ids_equal: bool
    mismatched_elements: int
    total_elements: int
    first_mismatch_row: int | None = None
    first_mismatch_index: int | None = None
    mismatched_rows: int | None = None
    rows: int | None = None
    overlap: int | None = None
    k: int | None = None
    same_set: bool | None = None
    ref_ids: list[int] | None = None
    run_ids: list[int] | None = None


class _RunningTop2:
    """Running top-1 (first index on ties, like np.argmax) and top-2 values over chunks.
    NaN never wins: a NaN logit cannot be sampled, so it is treated as -inf."""

    def __init__(self) -> None:
        self.best = -math.inf
        self.best_index = -1
        self.second = -math.inf
        self.seen = 0

    def update(self, chunk: np.ndarray, start: int, may_have_nan: bool = True) -> None:
        if chunk.size == 0:
            return
        values = np.where(np.isnan(chunk), -np.inf, chunk) if may_have_nan else chunk
        index = int(np.argmax(values))
        top = float(values[index])
        # Hide the winner to find the runner-up, then put it back (values may be the caller's data).
        values[index] = -np.inf
        runner_up = float(values.max()) if values.size > 1 else -math.inf
        values[index] = top
        if self.best_index < 0 or top > self.best:
            self.second = max(self.best, runner_up)
            self.best, self.best_index = top, start + index
        else:
            self.second = max(self.second, top)
        self.seen += chunk.size

    def result(self) -> Top2:
        margin = self.best - self.second if self.seen >= 2 else math.nan
        return Top2(self.best_index if self.seen else None, self.best, margin)


class Workspace:
    """Reusable float64 and mask buffers for :func:`compare_float_arrays`.

    Converting each chunk into the same buffers instead of fresh arrays avoids a malloc/free and
    page-fault cycle per key: with fresh ~1 MB arrays glibc returns the memory to the OS after
    every key, and the benchmark measured 0.8 s instead of 0.33 s for that churn alone.
    """

    def __init__(self, size: int) -> None:
        self.size = max(int(size), 1)
        self.ref = np.empty(self.size, np.float64)
        self.run = np.empty(self.size, np.float64)
        self.diff = np.empty(self.size, np.float64)
        self.finite_ref = np.empty(self.size, np.bool_)
        self.finite_run = np.empty(self.size, np.bool_)
        self.finite_both = np.empty(self.size, np.bool_)


def compare_float_arrays(ref: np.ndarray, run: np.ndarray, margins: bool = False,
                         chunk: int = CHUNK_ELEMENTS, workspace: Workspace | None = None) -> FloatMetrics:
    """Metrics between two float arrays of equal size, accumulated in float64 chunk by chunk.

    ``rel_diff`` = 1 − 2⟨x,y⟩/(‖x‖²+‖y‖²), computed as ‖x−y‖²/(‖x‖²+‖y‖²) (the same quantity
    without the cancellation). ``cosine`` = ⟨x,y⟩/(‖x‖‖y‖). ``max_abs``/``mean_abs`` of x−y,
    ``rel_l2`` = ‖x−y‖/‖x‖ (x is the reference), ``norm_diff`` = |‖y‖−‖x‖|/‖x‖ (a uniform scale
    error s gives norm_diff = s but rel_diff only ≈ s²/2). All of them use the positions finite on
    both sides; ``nonfinite_mismatch`` counts positions where the sides are not the same non-finite
    value (NaN vs NaN and equal infinities agree, e.g. masked logits). With ``margins``, also the
    argmax and top-1 minus top-2 margin of each side (for 1-D logits).
    """
    x = np.ravel(ref)
    y = np.ravel(run)
    if x.size != y.size:
        raise ValueError(f"sizes differ: {x.size} vs {y.size}")
    chunk = max(1, min(chunk, x.size))
    if workspace is None or workspace.size < chunk:
        workspace = Workspace(chunk)
    dot = xx = yy = dd = abs_sum = 0.0
    max_abs = 0.0
    compared = 0
    nan_ref = nan_run = inf_ref = inf_run = mismatch = 0
    top_ref, top_run = _RunningTop2(), _RunningTop2()
    for start in range(0, x.size, chunk):
        n = min(chunk, x.size - start)
        a, b = workspace.ref[:n], workspace.run[:n]
        np.copyto(a, x[start:start + n])
        np.copyto(b, y[start:start + n])
        finite_a = np.isfinite(a, out=workspace.finite_ref[:n])
        finite_b = np.isfinite(b, out=workspace.finite_run[:n])
        both = np.logical_and(finite_a, finite_b, out=workspace.finite_both[:n])
        all_finite = bool(both.all())
        if margins:
            top_ref.update(a, start, may_have_nan=not all_finite)
            top_run.update(b, start, may_have_nan=not all_finite)
        if not all_finite:
            nan_a, nan_b = np.isnan(a), np.isnan(b)
            nan_ref += int(nan_a.sum())
            nan_run += int(nan_b.sum())
            inf_ref += int((~finite_a & ~nan_a).sum())
            inf_run += int((~finite_b & ~nan_b).sum())
            odd = ~both
            same = (nan_a[odd] & nan_b[odd]) | (a[odd] == b[odd])
            mismatch += int((~same).sum())
            a, b = a[both], b[both]
        if a.size == 0:
            continue
        d = np.subtract(a, b, out=workspace.diff[:a.size])
        dot += _dot(a, b)
        xx += _dot(a, a)
        yy += _dot(b, b)
        dd += _dot(d, d)
        np.abs(d, out=d)
        abs_sum += float(d.sum())
        max_abs = max(max_abs, float(d.max()))
        compared += a.size
    denominator = xx + yy
    return FloatMetrics(
        rel_diff=dd / denominator if denominator > 0 else 0.0,
        cosine=_cosine(dot, xx, yy),
        max_abs=max_abs if compared else None,
        mean_abs=abs_sum / compared if compared else None,
        rel_l2=math.sqrt(dd / xx) if xx > 0 else (0.0 if dd == 0 else None),
        nan_ref=nan_ref, nan_run=nan_run, inf_ref=inf_ref, inf_run=inf_run,
        nonfinite_mismatch=mismatch,
        compared_elements=compared,
        margins=Margins(top_ref.result(), top_run.result()) if margins else None,
        norm_diff=norm_diff_of(xx, yy),
    )


def norm_diff_of(xx: float, yy: float, floor: float = 0.0) -> float | None:
    """|‖y‖ − ‖x‖| / ‖x‖ from the sums of squares ``xx`` = ‖x‖² and ``yy`` = ‖y‖², written as
    |yy − xx| / ((‖x‖ + ‖y‖)·‖x‖) so the difference of two close norms keeps its digits; with a
    ``floor`` (a squared norm), divided by the larger of ‖x‖ and √floor instead."""
    if yy == xx:  # equal norms (a row of zeros on both sides too, which the floor would divide by zero)
        return 0.0
    scale = max(xx, floor)
    if scale > 0:
        return abs(yy - xx) / ((math.sqrt(xx) + math.sqrt(yy)) * math.sqrt(scale))
    return 0.0 if yy == 0 else None


@dataclass(frozen=True)
class RowMetrics:
    """Per-row rel_diff and norm_diff of a ``[rows, dim]`` key (all-rows records: one row per
    token position), over the positions finite on both sides."""

    rel_diff: list[float]
    norm_diff: list[float | None]
    scale: float = 0.0  # the squared norm m² a smaller row was judged relative to

    @property
    def max_rel_diff(self) -> float:
        return max(self.rel_diff, default=0.0)

    @property
    def max_norm_diff(self) -> float | None:
        values = [value for value in self.norm_diff if value is not None]
        return max(values) if values else None


def compare_rows(ref: np.ndarray, run: np.ndarray, chunk: int = CHUNK_ELEMENTS,
                 floor: float | None = None) -> RowMetrics:
    """rel_diff and norm_diff of each row (axis 0) of two arrays of equal shape, in float64,
    converting at most about ``chunk`` elements per side at a time. A row's error is taken
    relative to the larger of its own norm and the median REF row norm (docs/compare.md, "All
    rows"): rounding noise follows the scale of what a row was computed from, so a row that is
    small by cancellation (8 router logits near zero) would otherwise read as a large error (the
    lower median for an even count). ``floor``: that median's square given instead (a decode
    step's row against its prompt's rows); the result's ``scale`` is the one used."""
    x = np.asarray(ref).reshape(ref.shape[0], -1)
    y = np.asarray(run).reshape(x.shape)
    step = max(1, chunk // max(1, x.shape[1]))
    sums: list[tuple[float, float, float]] = []
    for start in range(0, x.shape[0], step):
        a = x[start:start + step].astype(np.float64)
        b = y[start:start + step].astype(np.float64)
        both = np.isfinite(a) & np.isfinite(b)
        if not both.all():
            a, b = np.where(both, a, 0.0), np.where(both, b, 0.0)
        d = a - b
        xx, yy, dd = (np.einsum("ij,ij->i", u, u) for u in (a, b, d))
        sums.extend(zip(xx.tolist(), yy.tolist(), dd.tolist()))
    if floor is None:
        floor = lower_median([row_xx for row_xx, _, _ in sums])  # a squared norm
    rel: list[float] = []
    norm: list[float | None] = []
    for row_xx, row_yy, row_dd in sums:
        total = max(row_xx + row_yy, 2 * floor)
        rel.append(row_dd / total if total > 0 else 0.0)
        norm.append(norm_diff_of(row_xx, row_yy, floor))
    return RowMetrics(rel, norm, floor)


def lower_median(values) -> float:
    """The median of ``values``, the lower of the middle two for an even count (0 for none): of a
    prompt's 2 rows, one an attention sink's, the other's, not their mean."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2]) if ordered else 0.0


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum's own loop rather than BLAS: multi-threaded OpenBLAS dot products measured 1-6 s
    # instead of 0.8 s for the benchmark on a loaded 2-core box, and a single-threaded loop sums in
    # a fixed order, so the report is reproducible bit for bit.
    return float(np.einsum("i,i->", a, b))


def _cosine(dot: float, xx: float, yy: float) -> float | None:
    if xx > 0 and yy > 0:
        return dot / math.sqrt(xx * yy)
    return 1.0 if xx == 0 and yy == 0 else None


def id_rows(ids: np.ndarray) -> np.ndarray:
    """An ids array as rows of ids: axis 0 for arrays of rank >= 2 (one top-k set per token), the
    whole array as one row for rank <= 1 (a decode step's ids)."""
    return ids.reshape(ids.shape[0], -1) if ids.ndim >= 2 else ids.reshape(1, -1)


def compare_id_arrays(ref: np.ndarray, run: np.ndarray) -> IdMetrics:
    """Exact comparison of two integer arrays of equal shape.

    On a mismatch: the first mismatching row (axis 0 for arrays of rank ≥ 2, whose rows are
    top-k id sets; the whole array counts as one row for rank ≤ 1), the first mismatching flat
    index, the number of mismatching rows, and for the first mismatching row the overlap
    ``|set(ref row) ∩ set(run row)|`` out of ``k`` = the number of distinct reference ids.
    """
    a = np.asarray(ref)
    b = np.asarray(run)
    differs = a != b
    mismatched = int(differs.sum())
    if mismatched == 0:
        return IdMetrics(True, 0, int(a.size))
    rows_a = id_rows(a)
    rows_b = b.reshape(rows_a.shape)
    row_differs = np.any(rows_a != rows_b, axis=1)
    row = int(np.argmax(row_differs))
    ref_set = set(rows_a[row].tolist())
    run_set = set(rows_b[row].tolist())
    return IdMetrics(
        ids_equal=False, mismatched_elements=mismatched, total_elements=int(a.size),
        first_mismatch_row=row if a.ndim >= 2 else None,
        first_mismatch_index=int(np.argmax(differs.reshape(-1))),
        mismatched_rows=int(row_differs.sum()),
        rows=int(rows_a.shape[0]),
        overlap=len(ref_set & run_set),
        k=len(ref_set),
        same_set=ref_set == run_set,
        ref_ids=sorted(ref_set)[:64],
        run_ids=sorted(run_set)[:64],
    )


def bf16_spacing(value: float) -> float:
    """Distance between adjacent bfloat16 numbers (8-bit significand) at ``value``."""
    if not math.isfinite(value) or value == 0:
        return 0.0
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8)
