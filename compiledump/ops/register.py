"""Which kernel runs a capture, and the Python kernels of the ops that need no tag registry.

- `run_cpu_kernel` / `run_cuda_kernel` choose the kernel layer for one capture whose region and
  gates are already decided: on CPU the native kernel when the library is loaded, else the
  reference kernel (or the Triton kernel interpreted, for tests: COMPILEDUMP_CPU_KERNEL=triton);
  on CUDA the Triton kernel, or the native CUDA kernel when the library was built with CUDA and
  COMPILEDUMP_CUDA_KERNEL=native.
- `set_register_v1` and `capture_export_v1` get their Python kernels here, for the dispatch keys
  the native library does not serve. `capture_v1`'s kernels are registered by
  capture/dispatch.py, because its arena region comes from the process's tag registry.

Importing this module loads the native library (ops/native.py) first, so ownership is decided
once: one owner per (op, dispatch key).
"""

from __future__ import annotations

import threading

import torch

from .. import config
from . import layout as L
from . import native, schemas
from .geometry import geometry, payload_shape, token_gated
from .reference import capture_reference

# Held while a CPU capture counts and writes, and by flush() while it copies a CPU arena: a
# capture from another thread is never half-written in a dump.
KERNEL_LOCK = threading.Lock()


class _KernelDepth(threading.local):
    depth = 0


_in_kernel = _KernelDepth()


def inside_kernel() -> bool:
    """True while this thread runs a capture kernel (the signal handler defers its flush then)."""
    return _in_kernel.depth > 0


def use_triton_on_cpu() -> bool:
    """True when tests route CPU tensors through the Triton kernel (COMPILEDUMP_CPU_KERNEL=triton)."""
    return config.env("COMPILEDUMP_CPU_KERNEL") == "triton"


_triton_launch = None  # imported on first use: importing triton costs ~1 s


def capture_triton(x, arena, ctrl, kind, base, offset, capacity, reason) -> None:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    global _triton_launch
    if _triton_launch is None:
        from .triton_kernel import launch

        _triton_launch = launch
    src, geo = geometry(x, kind)
    _triton_launch(src, arena, ctrl, geo, base, offset, capacity, kind, reason)


def capture_native(x, arena, ctrl, kind, base, offset, capacity, reason) -> None:
    """The native kernel (kernels/capture_cpu.cpp; capture_cuda.cu for CUDA tensors), with the
    reference kernel's arguments."""
    src, geo = geometry(x, kind)
    schemas.capture_kernel(src, arena, ctrl, kind, base, offset, capacity, reason, *geo)


def run_cpu_kernel(x, arena, ctrl, kind, args) -> None:
    """Run the CPU kernel layer with (ctrl base, arena offset, capacity, drop reason) = `args`."""
    _in_kernel.depth += 1
    try:
        with KERNEL_LOCK:
            if use_triton_on_cpu():
                capture_triton(x, arena, ctrl, kind, *args)
            elif native.native_available():
                capture_native(x, arena, ctrl, kind, *args)
            else:
                capture_reference(x, arena, ctrl, kind, *args)
    finally:
        _in_kernel.depth -= 1


def run_cuda_kernel(x, arena, ctrl, kind, args) -> None:
    """Run the CUDA kernel layer on the input's device with `args` as `run_cpu_kernel`: the native
    CUDA kernel when the library serves `capture_v1` on CUDA (COMPILEDUMP_CUDA_KERNEL=native; one
    kernel for a whole run), else the Triton kernel."""
    with torch.cuda.device(x.device):
        if _NATIVE_CAPTURE["cuda"]:
            capture_native(x, arena, ctrl, kind, *args)
        else:
            capture_triton(x, arena, ctrl, kind, *args)


def export_gates(x, slot, kind, reason, offset, payload, capacity, tokens) -> tuple[int, int, int, int]:
    """`capture_export_v1`'s host-side gates: (ctrl base, arena offset, capacity, drop reason).

    The same decisions as the tag registry's `Runtime.resolve`, from the op's arguments instead
    (kernels/capture_cpu.cpp has the C++ twin): token gate, then the payload shape the region
    was sized for, then a region that could not be placed.
    """
    base = L.slot_base(slot)
    if reason == 0 and slot != 0:
        if token_gated(x.shape, kind, tokens):
            reason = L.CNT_TOKEN_GATE
        elif schemas.encode_payload(payload_shape(tuple(x.shape), kind)) != list(payload):
            reason = L.CNT_SHAPE_CHANGED
        elif offset < 0:
            reason = L.CNT_ARENA_FULL
    if reason:
        return base, -1, 0, reason
    return base, offset, capacity, 0


def _capture_export_cpu(x, arena, ctrl, slot, kind, reason, offset, payload, capacity, tokens):
    run_cpu_kernel(x, arena, ctrl, kind, export_gates(x, slot, kind, reason, offset, payload, capacity, tokens))


def _capture_export_cuda(x, arena, ctrl, slot, kind, reason, offset, payload, capacity, tokens):
    run_cuda_kernel(x, arena, ctrl, kind, export_gates(x, slot, kind, reason, offset, payload, capacity, tokens))


def _set_register(ctrl, index, value):
    # A fill of one word: a tiny kernel on CUDA, never a host copy or a sync.
    ctrl[index].fill_(value)


def native_owns_capture(device_type: str = "cpu") -> bool:
    """True when the native library decides and runs `capture_v1` for tensors on `device_type`
    ("cpu" or "cuda") from its region table (kernels/capture_table.cpp); the tag registry then
    pushes its decisions there. CUDA needs a library built against a CUDA torch with nvcc, and
    COMPILEDUMP_CUDA_KERNEL=native."""
    return _NATIVE_CAPTURE.get(device_type, False)


def native_holds_key(device_type: str) -> bool:
    """True when the native library registered `capture_v1` for `device_type`'s dispatch key, so
    Python cannot register its own there. With COMPILEDUMP_CUDA_KERNEL=triton the library's CUDA
    `capture_v1` finds its table unbound and hands every call to `capture_resolve_v1` (Python)."""
    return _NATIVE_KEYS.get(device_type, False)


native.load()
# Decided before capture/dispatch.py registers Python's kernel for the keys left free.
_NATIVE_KEYS = {device_type: schemas.has_kernel(schemas.CAPTURE, device_type.upper())
                for device_type in ("cpu", "cuda")}
_NATIVE_CAPTURE = {"cpu": _NATIVE_KEYS["cpu"],
                   "cuda": _NATIVE_KEYS["cuda"] and config.env("COMPILEDUMP_CUDA_KERNEL") == "native"}
for _key in ("CPU", "CUDA"):
    schemas.LIB.impl(schemas.SET_REGISTER, _set_register, _key)
for _key, _impl in (("CPU", _capture_export_cpu), ("CUDA", _capture_export_cuda)):
    if not schemas.has_kernel(schemas.EXPORT, _key):
        schemas.LIB.impl(schemas.EXPORT, _impl, _key)
