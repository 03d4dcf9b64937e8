"""The `compiledump` operator library: every op schema, defined once, with its fake.

Python owns the schemas (as torchao does); kernels are registered elsewhere: the Python ones by
`ops/register.py` and `capture/dispatch.py`, the native ones by the optional library
(`ops/native.py`). Ops are defined with `torch.library.Library` define/impl rather than
`torch.library.custom_op`: the latter costs about ten times more per eager call.

Why the schemas look the way they do:
- every tensor the op writes is a declared mutated argument, or torch.compile drops the call;
- the arena and the control block are separate full allocations, passed whole with integer
  offsets, so Inductor never clones them;
- integer arguments are fixed per capture site (slot, kind, host-decided drop reason), so they
  never recompile; everything that changes between calls of one shape is read by the kernel
  from `ctrl`.

Versioning is the export contract (docs/export.md): a schema never changes under its name; a
changed one gets a new version suffix (Inductor's FX cache does not notice a changed mutation
annotation). kernels/schemas.h carries the same strings for C++-only processes
(`scripts/write_schemas_header.py` writes it; a test keeps it current).
"""

from __future__ import annotations

import torch

NAMESPACE = "compiledump"
CAPTURE = "capture_v1"
SET_REGISTER = "set_register_v1"
KERNEL = "capture_kernel_v1"
EXPORT = "capture_export_v1"
RESOLVE = "capture_resolve_v1"
TABLE_GATE = "table_gate_v1"
TABLE_REGION = "table_region_v1"
SNAPSHOT = "snapshot_v1"

SCHEMAS = {
    # The capture op of eager and torch.compile code: the arena region is looked up from the
    # slot in this process's tag registry when the op runs (capture/dispatch.py).
    CAPTURE: f"{CAPTURE}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason) -> ()",
    SET_REGISTER: f"{SET_REGISTER}(Tensor(a!) ctrl, int index, SymInt value) -> ()",
    # The kernel layer alone (region and geometry decided by the caller): what a native library
    # implements (kernels/capture_cpu.cpp, kernels/capture_cuda.cu).
    KERNEL: f"{KERNEL}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int kind, int base, int offset,"
    " int capacity, int reason, int T, int H, int D, int stride_t, int stride_h, int stride_d, int row_reg,"
    " bool mean) -> ()",
    # The capture of exported programs (torch.export / AOTInductor): the arena region and the
    # token gate are arguments, fixed when the program was exported, so running it needs no
    # Python registry (a C++-only process runs it with the native library). See compiledump/aot.
    # `payload` is the stored shape with its length first ([ndim, *dims]): never an empty list,
    # which AOTInductor's proxy executor hands to the op as None.
    EXPORT: f"{EXPORT}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason,"
    " int offset, int[] payload, int capacity, int tokens) -> ()",
    # The native library's region table (kernels/capture_table.cpp), with which it serves
    # `capture_v1` itself: Python's registry binds a new arena's control block (`bind`), then
    # pushes the prompt length of the token gate and each claimed region; a call the table
    # cannot decide goes to `capture_resolve_v1` (the Python implementation, same arguments as
    # `capture_v1`). Called at run time only, never traced.
    RESOLVE: f"{RESOLVE}(Tensor x, Tensor(a!) arena, Tensor(b!) ctrl, int slot, int kind, int reason) -> ()",
    TABLE_GATE: f"{TABLE_GATE}(Tensor ctrl, int prompt_tokens, bool gate_on, bool bind) -> ()",
    TABLE_REGION: f"{TABLE_REGION}(Tensor ctrl, int slot, int kind, int offset, int capacity, int[] payload,"
    " bool check_layout) -> ()",
    # A copy of the used arena and of the control block, taken under the native CPU kernel's lock.
    SNAPSHOT: f"{SNAPSHOT}(Tensor arena, Tensor ctrl, int words) -> (Tensor, Tensor)",
}

LIB = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    LIB.define(_schema)


def _no_output(*_args) -> None:
    # Every op returns nothing and only writes its declared mutated arguments.
    return None


def _fake_snapshot(arena, ctrl, words):
    return arena.new_empty(words), ctrl.new_empty(ctrl.shape)


for _name in SCHEMAS:
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake_snapshot if _name == SNAPSHOT else _no_output,
                                lib=LIB)

capture = getattr(torch.ops.compiledump, CAPTURE).default
set_register = getattr(torch.ops.compiledump, SET_REGISTER).default
capture_kernel = getattr(torch.ops.compiledump, KERNEL).default
capture_export = getattr(torch.ops.compiledump, EXPORT).default
capture_resolve = getattr(torch.ops.compiledump, RESOLVE).default
table_gate = getattr(torch.ops.compiledump, TABLE_GATE).default
table_region = getattr(torch.ops.compiledump, TABLE_REGION).default
snapshot = getattr(torch.ops.compiledump, SNAPSHOT).default


def encode_payload(shape) -> list[int]:
    """`capture_export_v1`'s payload argument: [ndim, *dims] (never empty)."""
    return [len(shape), *shape]


def has_kernel(op: str, key: str) -> bool:
    """True when some library already registered a kernel of `compiledump::<op>` for `key`."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key)
