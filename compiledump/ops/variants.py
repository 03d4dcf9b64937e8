"""Which compiled variant of the Triton capture kernel a launch uses, and making sure it exists
before a CUDA graph capture needs it.

Triton compiles one kernel per distinct specialization of its arguments. The kernel
(ops/triton_kernel.py) declares every integer argument as an unspecialized 64-bit value, so
what still selects a variant is decided here, on the host, from facts a model keeps fixed:

- the input dtype (a pointer's element type);
- the layout class: hc mean or copy, int or float store;
- VEC: the contiguous fast path (16-byte vector loads), when the input is 16-byte aligned,
  has unit column stride and row/hc strides and width that are multiples of a vector;
- the input's 16-byte alignment, which Triton specializes pointers on by itself;
- the commit's memory order: system scope into a host-mapped arena, else a release (a relaxed
  one only while a benchmark sets COMMIT_RELEASE off);
- whether the payload's first tile is loaded before the claim (always, but while a benchmark sets
  PAYLOAD_FIRST off).

A CUDA graph capture must not compile or load a kernel ("operation not permitted when stream
is capturing"). So the first launch of a (device, dtype, layout class) family outside a capture
compiles all the variants of that family at once (fast path, aligned, unaligned), by launching
each on scratch buffers with the device flag off, which also loads the module on the device. A
capture that meets a family no eager call has prepared fails here, on the host, with an error
that says what to do, instead of inside CUDA.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from . import layout as L

BLOCK = 2048  # columns per tile (8 per thread with NUM_WARPS warps)
NUM_WARPS = 8
ALIGN_WORDS = L.REGION_ALIGN_WORDS
MAX_PROGRAMS = 1024  # tiles beyond this are looped over by the programs


@dataclass(frozen=True)
class Variant:
    """What selects a compiled kernel (besides the fixed BLOCK and NUM_WARPS)."""

    dtype: torch.dtype
    mean: bool
    is_int: bool
    vec: int  # elements per 16-byte vector on the fast path, else 1
    aligned: bool  # input pointer 16-byte aligned
    host_arena: bool = False  # the arena is host memory (crash-proof capture): commit at system scope
    release: bool = True  # a device arena's commit orders the payload before it (COMMIT_RELEASE)
    payload_first: bool = True  # the first tile is loaded before the claim (PAYLOAD_FIRST)

    def family(self) -> Variant:
        """The fast-path member of this variant's family (same dtype and layout class)."""
        return replace(self, vec=vector_width(self.dtype), aligned=True)

    def siblings(self) -> tuple[Variant, ...]:
        """Every variant of this family: what one eager launch prepares for later captures."""
        fast = self.family()
        return (fast, replace(fast, vec=1), replace(fast, vec=1, aligned=False))


def vector_width(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one 16-byte vector (the fast path's load width)."""
    return max(1, 16 // dtype.itemsize)


def variant_for(x: torch.Tensor, geometry: tuple, kind: int, host_arena: bool = False) -> Variant:
    """The variant that launches for `x` viewed as `geometry` (ops/geometry.py), into an arena in
    device memory or (`host_arena`) in host-mapped memory."""
    _T, H, D, stride_t, stride_h, stride_d, _row_reg, mean = geometry
    aligned = x.data_ptr() % 16 == 0
    width = vector_width(x.dtype)
    fast = (aligned and width > 1 and stride_d == 1 and D % width == 0 and stride_t % width == 0
            and (H == 1 or stride_h % width == 0))
    return Variant(x.dtype, bool(mean), kind == L.KIND_IDS, width if fast else 1, aligned, host_arena,
                   commit_is_release(host_arena), PAYLOAD_FIRST)


# A capture's commit (layout.SLOT_COMMITTED) into a device arena is a release: its payload is
# visible before the commit is, for a flush that copies the control block while replays run on
# another thread. That is one memory fence per capture; benchmarks/gpu_bench.py graph_capture_cost
# sets this to False for one graph to time what the fence costs (read at call time; a commit into
# a host-mapped arena is always a system-scope release).
COMMIT_RELEASE = True


def commit_is_release(host_arena: bool) -> bool:
    """Whether a capture into a host-mapped (`host_arena`) or a device arena commits with a release."""
    return COMMIT_RELEASE or host_arena


# The Triton kernel loads each program's first tile before the claim's atomic, so the two round
# trips to memory overlap (ops/triton_kernel.py). benchmarks/gpu_bench.py graph_capture_cost sets
# this to False for one graph, to time the kernel that loads it after the claim beside it (read
# at call time).
PAYLOAD_FIRST = True


# Data pointers of arenas in host-mapped memory (crash-proof capture on CUDA, capture/persist.py):
# their captures run one program (the `host_arena` variant), whose commit then follows every store
# of the capture at system scope, so a capture cut short by a dead context is never read as whole.
MAPPED_ARENAS: set[int] = set()


def launches_for(geometry: tuple, kind: int, host_arena: bool = False) -> tuple[tuple[int, int], ...]:
    """The launches of one capture, in stream order: (layout.LAUNCH_* phase, programs) each.

    One program per (row, column block) tile, up to MAX_PROGRAMS, in one launch. Steps and
    keep-first records write only if (and, for steps, where) the counter value they claim says, so
    one program claims: alone, or, for a wide row (layout.splits), in a launch of
    its own that publishes the decision for a second launch over all the tiles. Captures into a
    host-mapped arena run one program (its commit follows every store of the capture)."""
    T, H, D, *_rest, row_reg, _mean = geometry
    rows = T if row_reg == L.ROW_ALL else 1
    tiles = max(1, min(MAX_PROGRAMS, rows * -(-D // BLOCK)))
    if host_arena:
        return ((L.LAUNCH_WHOLE, 1),)
    if kind in (L.KIND_STEP, L.KIND_RECORD_ONCE):
        if L.splits(H, D):
            return ((L.LAUNCH_CLAIM, 1), (L.LAUNCH_COPY, tiles))
        return ((L.LAUNCH_WHOLE, 1),)
    return ((L.LAUNCH_WHOLE, tiles),)


class VariantNotPrepared(RuntimeError):
    """A CUDA graph capture needs a kernel variant that no call outside a capture compiled."""


class KernelUnavailable(RuntimeError):
    """Triton could not compile or load a capture kernel variant (the cause is chained)."""


# AMD's fp8 formats: Triton compiles them for ROCm only.
_NOT_ON_NVIDIA = frozenset(getattr(torch, name) for name in ("float8_e4m3fnuz", "float8_e5m2fnuz")
                           if hasattr(torch, name))
# (device, Variant) whose kernel is compiled and loaded -> what preparing it returned (the
# launcher straight into the compiled kernel, or None: through Triton's JIT)
_ready: dict[tuple, object] = {}
_NOT_READY = object()
_lock = threading.Lock()


def stream_capturing(device: torch.device) -> bool:
    """True while the current CUDA stream of `device` is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def ensure_prepared(device: torch.device, variant: Variant, prepare):
    """Make sure `variant` is compiled and loaded on `device` before it launches there, and return
    what `prepare` returned for it.

    `prepare(device, variant)` compiles and loads one variant by launching it on scratch buffers
    and returns a launcher straight into its compiled kernel, or None (ops/triton_kernel.py).
    Outside a capture, the first launch of a family prepares all its siblings; during a capture an
    unprepared variant raises VariantNotPrepared before anything reaches CUDA.
    """
    key = (device, variant)
    compiled = _ready.get(key, _NOT_READY)
    if compiled is not _NOT_READY:
        return compiled
    if device.type == "cuda" and variant.dtype in _NOT_ON_NVIDIA:
        raise TypeError(f"compiledump: {variant.dtype} cannot be captured on CUDA (Triton has no NVIDIA type for "
                        "it); record a float8_e4m3fn/float8_e5m2 or float32 view of it instead")
    if stream_capturing(device):
        raise VariantNotPrepared(
            f"compiledump: a capture of a {variant.dtype} tensor ({'hc mean' if variant.mean else 'copy'}) reached a "
            "CUDA graph capture before any call outside the capture compiled its kernel (compiling inside a capture "
            "fails in CUDA). Run the captured function once outside the graph first, as engines do with their "
            "warm-up under compiledump.profiling(), or call compiledump.prepare_kernels(device, dtypes) "
            "before capturing."
        )
    with _lock:
        for sibling in variant.siblings():
            if (device, sibling) not in _ready:
                try:
                    _ready[(device, sibling)] = prepare(device, sibling)
                except Exception as error:
                    raise _unavailable(device, sibling, error) from error
    return _ready[key]


def _unavailable(device: torch.device, variant: Variant, error: Exception) -> KernelUnavailable:
    """The error for a variant Triton failed to compile or load, with what to do about it."""
    import triton

    what = "record_ids" if variant.is_int else "hc mean" if variant.mean else "copy"
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return KernelUnavailable(
        f"compiledump: Triton {triton.__version__} failed to compile or load the capture kernel for {variant.dtype} "
        f"({what}, vector width {variant.vec}, {'aligned' if variant.aligned else 'unaligned'}) on {device}: "
        f"{type(error).__name__}: {first}. Nothing was captured by this call. On the first H200 run such a "
        "failure did not recur in a fresh process with an empty Triton cache: rerun with "
        "TRITON_CACHE_DIR=<a new directory>; with the native library built for CUDA, "
        "COMPILEDUMP_CUDA_KERNEL=native captures without Triton (docs/compiling.md)."
    )


def prepared() -> frozenset:
    """The (device, Variant) pairs prepared so far (for tests and diagnostics)."""
    return frozenset(_ready)


def forget() -> None:
    """Forget what was prepared (tests)."""
    _ready.clear()
