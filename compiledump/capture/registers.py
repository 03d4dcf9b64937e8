"""The host-side registers the capture kernels read at run time: whether capture is suspended
(`profiling`), how many rows the sampler produced (`set_rows`) and which row to keep
(`set_gather_rows`). Written outside graphs through small kernels (or kept until the arena
exists), so a graph recorded once behaves as they say each time it replays."""

from __future__ import annotations

import operator

import torch

from ..ops import layout as L
from ..ops import schemas
from . import api
from .state import STATE

__all__ = ["enabled", "profiling", "set_gather_rows", "set_rows"]


def enabled() -> bool:
    """True when capture is configured and not suspended by `profiling()`."""
    return STATE.config.active and STATE.profiling_depth == 0


def _int_argument(call: str, value):
    """An int argument of `set_rows`/`set_gather_rows`, checked here rather than failing later in a
    capture: Python and numpy ints, and SymInts (a graph's shape, under torch.compile); not bools,
    floats, None or tensors (reading a device tensor's value would sync the host)."""
    if isinstance(value, torch.SymInt):
        return value
    if not isinstance(value, (bool, torch.Tensor)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"compiledump.{call}: expected an int, got {type(value).__name__} {value!r}")


def _write_register(index: int, value: int) -> None:
    rt = STATE.runtime
    if rt is None:
        STATE.pending_registers[index] = value
    else:
        rt.set_register(index, value)


class profiling:
    """Suspend every capture while an engine runs its dummy/profile or graph-capture forwards.

    Works inside compiled and CUDA-graph-captured code: it clears a device flag that every
    capture kernel reads, so graphs recorded now replay correctly later. Nestable. Enter and
    exit it outside graph capture, on the stream that replays the graphs (the flag is written on
    the current stream; docs/compiling.md, "Device state").
    """

    def __enter__(self) -> profiling:
        STATE.profiling_depth += 1
        if STATE.profiling_depth == 1:
            _write_register(L.REG_ENABLED, 0)
        return self

    def __exit__(self, *_exc: object) -> None:
        STATE.profiling_depth -= 1
        if STATE.profiling_depth == 0:
            _write_register(L.REG_ENABLED, 1)


def set_rows(rows: int) -> None:
    """Tell the dump how many rows the sampler just produced; `record_step` is skipped while
    this exceeds `max_rows` (warm-up batches). Call it outside graphs, or inside with a value
    fixed by the graph's shape."""
    rows = _int_argument("set_rows", rows)
    if not STATE.config.active:
        return
    rt = STATE.runtime
    if rt is None:
        STATE.pending_registers[L.REG_ROWS] = rows
    else:
        schemas.set_register(rt.ctrl, L.REG_ROWS, rows)


def set_gather_rows(*, record: int | None = None, step: int | None = None) -> None:
    """Choose which row `record` and `record_step` keep (defaults: record -1 = last, step 0).

    For padded batches: e.g. a captured prefill whose real last token is not the last row.
    Negative values count from the end. The kernels read these at run time, so set them outside
    graphs and replay: no recompilation, no re-capture.
    """
    record = None if record is None else _int_argument("set_gather_rows", record)
    step = None if step is None else _int_argument("set_gather_rows", step)
    if not STATE.config.active:
        return
    if record is not None:
        _write_register(L.REG_RECORD_ROW, record)
    if step is not None:
        _write_register(L.REG_STEP_ROW, step)


# With a dump directory set, the flush at exit (with its note when nothing was captured) and the
# signal handlers are registered when the capture API is first used: a runner that only ever calls
# these registers gets them too.
api.register_exit_flush()
