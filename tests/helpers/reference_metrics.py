"""The comparator's float metrics written out in numpy, from their definitions in docs/compare.md:
the independent reference the compare tests check compiledump's chunked float64 sums against."""

import numpy as np


def rel_diff(x, y) -> float:
    """1 - 2<x, y> / (|x|^2 + |y|^2) over the flattened arrays, in float64, written as
    |x - y|^2 / (|x|^2 + |y|^2) (the same quantity without the cancellation for tiny errors)."""
    x, y = np.ravel(x).astype(np.float64), np.ravel(y).astype(np.float64)
    return float(np.sum((x - y) ** 2) / (x.dot(x) + y.dot(y)))


def norm_diff(x, y) -> float:
    """| |y| - |x| | / |x| over the flattened arrays, in float64: blind to direction, sensitive to scale."""
    x, y = np.ravel(x).astype(np.float64), np.ravel(y).astype(np.float64)
    return float(abs(np.linalg.norm(y) - np.linalg.norm(x)) / np.linalg.norm(x))


def row_metrics(x, y) -> tuple[list[float], list[float]]:
    """Per-row rel_diff and norm_diff of two ``[rows, dim]`` arrays as an all-rows key is judged:
    each row's error relative to the larger of its own REF norm and the median REF row norm
    (``|x_i - y_i|^2 / max(|x_i|^2 + |y_i|^2, 2 m^2)`` and ``| |y_i| - |x_i| | / max(|x_i|, m)``; the
    lower median for an even number of rows)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    squares = np.sort(nx ** 2)
    m = np.sqrt(squares[(len(squares) - 1) // 2])  # the lower median for an even count
    rel = np.sum((x - y) ** 2, axis=1) / np.maximum(nx ** 2 + ny ** 2, 2 * m ** 2)
    norm = np.abs(ny - nx) / np.maximum(nx, m)
    return rel.tolist(), norm.tolist()
