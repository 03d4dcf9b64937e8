"""The `compiledump` operator library: schemas, fake implementations, CPU and CUDA kernels.

Python owns the schemas (as torchao does); the optional native library (native.py) adds kernels for
some of them. Ops are registered with `torch.library.Library` define/impl rather than
`torch.library.custom_op`: the latter costs about ten times more per eager call.

Why the schemas look the way they do (see the design notes):
- every tensor the op writes is a declared mutated argument, or torch.compile drops the call;
- the arena and the control block are separate full allocations, passed whole with integer
  offsets, so Inductor never clones them;
- integer arguments are fixed per capture site (slot, kind, host-decided drop reason), so they
  never recompile; the arena region is looked up from the slot when the op runs, and everything
  that changes between calls of one shape is read by the kernel from `ctrl`.
Op names carry a version: Inductor's FX cache does not notice a changed mutation annotation.
"""

from __future__ import annotations

import os
import threading

import torch

from . import arena as _arena
from . import layout as L

NAMESPACE = "compiledump"
CAPTURE = "capture_v1"
SET_REGISTER = "set_register_v1"

KERNEL = "capture_kernel_v1"
EXPORT = "capture_export_v1"

# Every schema of the library: the export contract (docs/EXPORT.md). A schema never changes
# under its name; a changed one gets a new version suffix. kernels/schemas.h carries the same
# strings for C++-only processes (tests/test_aot.py keeps them equal).
SCHEMAS = {
    # The capture op of eager and torch.compile code: the arena region is looked up from the
    # slot in this process's registry when the op runs (arena.Runtime.resolve).
    CAPTURE: f"{CAPTURE}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason) -> ()",
    SET_REGISTER: f"{SET_REGISTER}(Tensor(a!) ctrl, int index, SymInt value) -> ()",
    # The kernel layer alone (region and geometry decided by the caller): what a native library
    # implements. See compiledump/native.py and kernels/capture_cpu.cpp.
    KERNEL: f"{KERNEL}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int kind, int base, int offset,"
    " int capacity, int reason, int T, int H, int D, int stride_t, int stride_h, int stride_d, int row_reg,"
    " bool mean) -> ()",
    # The capture of exported programs (torch.export / AOTInductor): the arena region and the
    # token gate are arguments, fixed when the program was exported, so running it needs no
    # Python registry (a C++-only process runs it with the native library). See aot.py.
    # `payload` is the stored shape with its length first ([ndim, *dims]): never an empty list,
    # which AOTInductor's proxy executor hands to the op as None.
    EXPORT: f"{EXPORT}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason,"
    " int offset, int[] payload, int capacity, int tokens) -> ()",
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def geometry(x: torch.Tensor, kind: int) -> tuple[torch.Tensor, tuple]:
    """View `x` as `[T, H, D]` for the kernel: returns (tensor to read, geometry tuple).

    The geometry is (T, H, D, stride_t, stride_h, stride_d, row_reg, mean). `record` of a 3-D
    tensor averages H; a step of a >=2-D tensor copies row `x[r]` whole (H x D words); anything
    stored whole is one row. Strides are passed through, so non-contiguous inputs are read in
    place; only tensors of 4 or more dims that cannot be viewed are copied first.
    """
    dim = x.dim()
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
    if dim > 2:
        x = x.reshape(x.shape[0], -1)
    return x, (1, x.shape[0], x.shape[1], 0, x.stride(0), x.stride(1), L.ROW_FIXED_ZERO, False)


def _rows(x: torch.Tensor, row_reg: int, mean: bool) -> tuple[torch.Tensor, tuple]:
    """A 2-D `[T, D]` (as H = 1) or 3-D `[T, H, D]` tensor whose row comes from `row_reg`."""
    if x.dim() == 2:
        return x, (x.shape[0], 1, x.shape[1], x.stride(0), 0, x.stride(1), row_reg, mean)
    return x, (*x.shape, *x.stride(), row_reg, mean)


def capture_reference(x, arena, ctrl, kind, base, offset, capacity, reason):
    """CPU kernel with the Triton kernel's exact semantics and accumulation order.

    Reading the control block here is a plain CPU memory read (no device to sync with). The
    lock makes the counter update and the write one step, as the kernel's atomic is, when
    several threads capture at once.
    """
    src, (T, H, D, st, sh, sd, row_reg, mean) = geometry(x, kind)
    regs = ctrl.numpy()
    with CPU_LOCK:
        enabled = regs[L.REG_ENABLED] != 0
        rows_ok = kind != L.KIND_STEP or regs[L.REG_ROWS] <= regs[L.REG_MAX_ROWS]
        row = 0 if row_reg < 0 else int(regs[row_reg])
        if row < 0:
            row += T
        row_ok = 0 <= row < T

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
        if counter != L.CNT_WRITTEN:
            return
        if kind == L.KIND_RECORD_ONCE and old != 0:
            return
        if kind == L.KIND_STEP and old >= capacity:
            return
        step = old if kind == L.KIND_STEP else 0
        words = D if mean else H * D
        dest = offset + step * words
        # The row as [H, D] with the caller's strides (no copy).
        row_view = src.as_strided((H, D), (sh, sd), src.storage_offset() + row * st)
        if kind == L.KIND_IDS:
            arena.view(torch.int32)[dest : dest + words].view(H, D).copy_(row_view)
        elif mean:
            # As the kernel: an fp32 sum over h, then one IEEE division, in one op. torch's CPU
            # mean sums an outer dim in h order for hc_mult <= 4 (bit-identical to the kernel);
            # for larger H its vectorized order can differ by 1 ulp (tests hold 1e-6).
            torch.mean(row_view, 0, dtype=torch.float32, out=arena[dest : dest + words])
        else:
            arena[dest : dest + words].view(H, D).copy_(row_view)


# Held while a CPU capture updates its counter and writes its row, and by flush() while it
# snapshots a CPU arena: a capture from another thread is never half-written in a dump.
CPU_LOCK = threading.Lock()


def _use_triton_on_cpu() -> bool:
    """Tests set COMPILEDUMP_CPU_KERNEL=triton (with TRITON_INTERPRET=1) to run the Triton kernel."""
    return os.environ.get("COMPILEDUMP_CPU_KERNEL") == "triton"


_triton_launch = None  # imported on first use: importing triton costs ~1 s


def capture_triton(x, arena, ctrl, kind, base, offset, capacity, reason):
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    global _triton_launch
    if _triton_launch is None:
        from .triton_kernel import launch

        _triton_launch = launch
    src, geo = geometry(x, kind)
    _triton_launch(src, arena, ctrl, geo, base, offset, capacity, kind, reason)


def _runtime_for(x, arena, ctrl):
    # The region table is the process's runtime; the tensors passed in are normally its own
    # (opcheck passes same-sized clones, which is fine: the op writes where it is told).
    rt = _arena.ACTIVE
    if rt is None or rt.ctrl.shape != ctrl.shape or rt.arena.shape != arena.shape:
        raise RuntimeError(
            "compiledump: this capture belongs to an arena that no longer exists "
            "(compiledump.reset() was called); re-trace compiled functions (torch._dynamo.reset())"
        )
    if x.device != arena.device or ctrl.device != arena.device:
        raise RuntimeError(
            f"compiledump: input on {x.device} but the arena lives on {arena.device}; "
            "call compiledump.init(device) before the first capture"
        )
    return rt


def capture_native(x, arena, ctrl, kind, base, offset, capacity, reason):
    """The native kernel (kernels/capture_cpu.cpp; capture_cuda.cu for CUDA tensors), with the
    Python kernel's arguments."""
    src, geo = geometry(x, kind)
    with CPU_LOCK:
        capture_kernel(src, arena, ctrl, kind, base, offset, capacity, reason, *geo)


def _cpu_kernel(x, arena, ctrl, kind, args) -> None:
    """Run the CPU kernel layer with (ctrl base, arena offset, capacity, drop reason) = `args`."""
    if _use_triton_on_cpu():
        capture_triton(x, arena, ctrl, kind, *args)
    elif _native.native_available():
        capture_native(x, arena, ctrl, kind, *args)
    else:
        capture_reference(x, arena, ctrl, kind, *args)


def _cuda_kernel(x, arena, ctrl, kind, args) -> None:
    """Run the CUDA kernel layer (Triton, on the input's device) with `args` as `_cpu_kernel`."""
    with torch.cuda.device(x.device):
        capture_triton(x, arena, ctrl, kind, *args)


def _capture_cpu(x, arena, ctrl, slot, kind, reason):
    _cpu_kernel(x, arena, ctrl, kind, _runtime_for(x, arena, ctrl).resolve(slot, kind, x, reason))


def encode_payload(shape) -> list[int]:
    """`capture_export_v1`'s payload argument: [ndim, *dims] (never empty)."""
    return [len(shape), *shape]


def export_gates(x, slot, kind, reason, offset, payload, capacity, tokens) -> tuple[int, int, int, int]:
    """`capture_export_v1`'s host-side gates: (ctrl base, arena offset, capacity, drop reason).

    The same decisions as `Runtime.resolve`, from the op's arguments instead of the registry
    (kernels/capture_cpu.cpp has the C++ twin): token gate, then the payload shape the region
    was sized for, then a region that could not be placed.
    """
    base = L.slot_base(slot)
    if reason == 0 and slot != 0:
        if _arena.token_gated(x.shape, kind, tokens):
            reason = L.CNT_TOKEN_GATE
        elif encode_payload(_arena.payload_shape(tuple(x.shape), kind)) != list(payload):
            reason = L.CNT_SHAPE_CHANGED
        elif offset < 0:
            reason = L.CNT_ARENA_FULL
    if reason:
        return base, -1, 0, reason
    return base, offset, capacity, 0


def _capture_export_cpu(x, arena, ctrl, slot, kind, reason, offset, payload, capacity, tokens):
    _cpu_kernel(x, arena, ctrl, kind, export_gates(x, slot, kind, reason, offset, payload, capacity, tokens))


def _capture_export_cuda(x, arena, ctrl, slot, kind, reason, offset, payload, capacity, tokens):
    _cuda_kernel(x, arena, ctrl, kind, export_gates(x, slot, kind, reason, offset, payload, capacity, tokens))


def _capture_cuda(x, arena, ctrl, slot, kind, reason):
    _cuda_kernel(x, arena, ctrl, kind, _runtime_for(x, arena, ctrl).resolve(slot, kind, x, reason))


def capture_eager(x, arena, ctrl, slot, kind, reason):
    """The op's implementation without the dispatcher: the eager fast path.

    Outside torch.compile the dispatcher adds nothing to what the op does (no autograd, no
    functionalization) but a few microseconds per call, so eager capture calls come straight
    here; traced code always emits the op. The input is detached so autograd never sees the
    arena writes.
    """
    if x.requires_grad:
        x = x.detach()
    if x.device.type == "cuda":
        _capture_cuda(x, arena, ctrl, slot, kind, reason)
    else:
        _capture_cpu(x, arena, ctrl, slot, kind, reason)


def _capture_fake(x, arena, ctrl, slot, kind, reason):
    return None


def _set_register(ctrl, index, value):
    # A fill of one word: a tiny kernel on CUDA, never a host copy or a sync.
    ctrl[index].fill_(value)


def _set_register_fake(ctrl, index, value):
    return None


_lib.impl(CAPTURE, _capture_cpu, "CPU")
_lib.impl(CAPTURE, _capture_cuda, "CUDA")
_lib.impl(SET_REGISTER, _set_register, "CPU")
_lib.impl(SET_REGISTER, _set_register, "CUDA")
torch.library.register_fake(f"{NAMESPACE}::{CAPTURE}", _capture_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::{SET_REGISTER}", _set_register_fake, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::{KERNEL}", lambda *args: None, lib=_lib)
torch.library.register_fake(f"{NAMESPACE}::{EXPORT}", lambda *args: None, lib=_lib)

capture = getattr(torch.ops.compiledump, CAPTURE).default
set_register = getattr(torch.ops.compiledump, SET_REGISTER).default
capture_kernel = getattr(torch.ops.compiledump, KERNEL).default
capture_export = getattr(torch.ops.compiledump, EXPORT).default

from . import native as _native  # noqa: E402 - loads the library once the schemas above exist

_native.load()

# One owner per (op, dispatch key): the native library, when loaded, owns the keys it
# implements for `capture_export_v1`; Python implements the rest.
for _key, _impl in (("CPU", _capture_export_cpu), ("CUDA", _capture_export_cuda)):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{EXPORT}", _key):
        _lib.impl(EXPORT, _impl, _key)
