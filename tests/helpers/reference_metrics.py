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
