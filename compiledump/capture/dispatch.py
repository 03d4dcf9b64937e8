"""What runs when a capture point runs: the kernels of `compiledump::capture_v1`, its eager fast
path, and the capture of a program being exported.

`capture_v1` is the op that eager and compiled code call. Its kernels live here, not in ops/,
because they look the tag's arena region up in this process's registry (`Runtime.resolve`,
from the real tensor's shape) before handing the capture to the kernel layer
(ops/register.py). An exported program cannot consult the registry when it runs, so while a
program is exported each capture point becomes `capture_export_v1` with its region fixed now.
"""

from __future__ import annotations

import torch

from ..ops import register, schemas
from .arena import Runtime
from .state import STATE


def _runtime_of(x: torch.Tensor, arena: torch.Tensor, ctrl: torch.Tensor) -> Runtime:
    # The region table is the process's runtime; the tensors passed in are normally its own
    # (opcheck passes same-sized clones, which is fine: the op writes where it is told).
    rt = STATE.runtime
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


def _capture_cpu(x, arena, ctrl, slot, kind, reason):
    register.run_cpu_kernel(x, arena, ctrl, kind, _runtime_of(x, arena, ctrl).resolve(slot, kind, x, reason))


def _capture_cuda(x, arena, ctrl, slot, kind, reason):
    register.run_cuda_kernel(x, arena, ctrl, kind, _runtime_of(x, arena, ctrl).resolve(slot, kind, x, reason))


# `capture_resolve_v1` is the Python implementation the native `capture_v1` falls back to for a
# call its region table cannot decide (kernels/capture_table.cpp); for a device the native
# library does not serve, Python serves `capture_v1` itself.
for _device_type, _impl in (("cpu", _capture_cpu), ("cuda", _capture_cuda)):
    schemas.LIB.impl(schemas.RESOLVE, _impl, _device_type.upper())
    if not register.native_holds_key(_device_type):
        schemas.LIB.impl(schemas.CAPTURE, _impl, _device_type.upper())


def capture_eager(x, arena, ctrl, slot, kind, reason) -> None:
    """The op's kernel without the dispatcher: the eager fast path.

    Outside torch.compile the dispatcher adds nothing to what the op does (no autograd, no
    functionalization) but a few microseconds per call, so eager capture calls come straight
    here; traced code always emits the op. The input is detached so autograd never sees the
    arena writes. With the native library, a CPU call is one dispatcher call into C++, whose
    region table decides it (kernels/capture_table.cpp); so is a CUDA call when the library was
    built with CUDA and COMPILEDUMP_CUDA_KERNEL=native.
    """
    if x.requires_grad:
        x = x.detach()
    device_type = x.device.type
    if register.native_owns_capture(device_type):
        schemas.capture(x, arena, ctrl, slot, kind, reason)  # one call into C++ (its region table)
    elif device_type == "cuda":
        _capture_cuda(x, arena, ctrl, slot, kind, reason)
    else:
        _capture_cpu(x, arena, ctrl, slot, kind, reason)



def emit_export(rt: Runtime, index: int, kind: int, reason: int, x: torch.Tensor) -> None:
    """The capture op of a program being exported (compiledump.aot.export): region fixed now."""
    if STATE.export_binding is None:
        raise RuntimeError(
            "compiledump: a model with capture points is being exported without its arena; export it "
            "with compiledump.aot.export(model, args), which makes the arena and the control block inputs"
        )
    arena, ctrl = STATE.export_binding
    offset, payload, capacity = -1, [], 0
    if reason == 0 and index != 0:
        offset, payload, capacity = rt.place(index, kind, x)
    schemas.capture_export(x, arena, ctrl, index, kind, reason, offset, schemas.encode_payload(payload), capacity,
                           rt.config.fixed_tokens)
