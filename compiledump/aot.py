"""Capture points in exported programs: torch.export, AOTInductor packages, C++-only runs.

An exported program cannot consult this process's tag registry when it runs (it may run in a
process without Python), so exporting differs from compiling in two ways:

- the arena and the control block are explicit inputs of the program (AOTInductor would
  otherwise copy them into the package as constants, and the host would read stale copies);
- each capture point is a `compiledump::capture_export_v1` call whose arena region, payload
  shape and token gate are arguments, fixed while exporting: the region is claimed from the
  traced shape then, as a CUDA graph capture claims it.

The registry that the flush needs to name the arena's regions (tags, kinds, regions, shapes) is
written into the package as metadata (the "plan"), which `load` (Python) and the native
library's C++ flush (kernels/dump.cpp) read back. docs/EXPORT.md is the contract.

    ep = compiledump.aot.export(model, (tokens,))          # inputs become (arena, ctrl, tokens)
    path = compiledump.aot.package(ep, "model.pt2")        # AOTInductor + the plan
    run = compiledump.aot.load(path)                        # another process: registry restored
    logits = run(tokens)                                    # arena and ctrl passed for you
    compiledump.flush()
"""

from __future__ import annotations

import json
import os

import torch

from . import arena as _arena
from . import config as _config
from . import layout as L
from . import ops
from . import runtime as _runtime

PLAN_KEY = "compiledump.plan"  # package metadata: the tag registry, one line per slot
CONFIG_KEY = "compiledump.config"  # package metadata: the settings (JSON, without "dir")
PLAN_HEADER = "compiledump-plan 1"

# The arena and control block of the program being exported (set only while it is traced).
_BOUND: tuple[torch.Tensor, torch.Tensor] | None = None


class _WithArena(torch.nn.Module):
    """`model` with the arena and the control block as its first two inputs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, arena, ctrl, *args, **kwargs):
        global _BOUND
        _BOUND = (arena, ctrl)
        try:
            return self.model(*args, **kwargs)
        finally:
            _BOUND = None


def export(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, dynamic_shapes=None,
           device: str | torch.device | None = None) -> torch.export.ExportedProgram:
    """`torch.export.export` (non-strict) of `model` with its capture points kept.

    The program's inputs are `(arena, ctrl, *args)`. `dynamic_shapes`, if given, is a tuple with
    one entry per element of `args` (as torch.export takes it for positional inputs). Capture must
    be configured (`COMPILEDUMP_DIR` or `configure(dir=...)`); the arena is created on `device`
    (default: the device of the first tensor in `args`). Each captured tag's region is claimed
    from its traced shape; with `COMPILEDUMP_TOKENS` set, the token dim of `record`/`record_ids`
    is sized by it (the only token count such a capture keeps), so it may be dynamic. Raises
    ValueError for any other dynamic dimension in a stored payload.
    """
    if not _runtime.enabled():
        raise RuntimeError("compiledump.aot.export: capture is not configured: set COMPILEDUMP_DIR or call "
                           "compiledump.configure(dir=...) before exporting (and not inside profiling())")
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    _runtime.init(device)
    rt = _arena.ACTIVE
    if dynamic_shapes is not None:
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise TypeError("compiledump.aot.export: dynamic_shapes must be a tuple with one entry per "
                            "positional argument")
        dynamic_shapes = (None, None, tuple(dynamic_shapes))  # forward(arena, ctrl, *args)
    with torch.no_grad():
        return torch.export.export(_WithArena(model), (rt.arena, rt.ctrl, *args), kwargs,
                                   dynamic_shapes=dynamic_shapes, strict=False)


def emit_capture(rt: _arena.Runtime, index: int, kind: int, reason: int, x: torch.Tensor) -> None:
    """The capture op of a traced export (called by runtime._capture): region fixed now."""
    if _BOUND is None:
        raise RuntimeError(
            "compiledump: a model with capture points is being exported without its arena; export it "
            "with compiledump.aot.export(model, args), which makes the arena and the control block inputs"
        )
    arena, ctrl = _BOUND
    offset, payload, capacity = -1, [], 0
    if reason == 0 and index != 0:
        offset, payload, capacity = rt.place(index, kind, x)
    ops.capture_export(x, arena, ctrl, index, kind, reason, offset, ops.encode_payload(payload), capacity,
                       rt.config.tokens)


def package(ep: torch.export.ExportedProgram, path: str | os.PathLike,
            inductor_configs: dict | None = None) -> str:
    """AOTInductor-compile `ep` (from `export`) into the package `path`, with the plan; returns it.

    Each package carries the plan of the whole registry as it stands when packaged (at least
    this program's tags); loading several packages (`load`, or `Plan::merge` in C++) merges them.
    `inductor_configs` are passed on; compiledump adds its entries to "aot_inductor.metadata".
    """
    configs = dict(inductor_configs or {})
    metadata = dict(configs.pop("aot_inductor.metadata", {}) or {})
    metadata.update(plan_metadata())
    configs["aot_inductor.metadata"] = metadata
    return torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path), inductor_configs=configs)


def plan_metadata(rt: _arena.Runtime | None = None) -> dict[str, str]:
    """The package metadata that describes the arena: {PLAN_KEY: plan text, CONFIG_KEY: json}."""
    rt = rt or _arena.ACTIVE
    if rt is None:
        raise RuntimeError("compiledump.aot: nothing was exported yet (no arena)")
    settings = _config.dataclasses.asdict(rt.config)
    settings.pop("dir")
    return {PLAN_KEY: plan_text(rt), CONFIG_KEY: json.dumps(settings, separators=(",", ":"))}


def plan_text(rt: _arena.Runtime) -> str:
    """The registry as lines of space-separated fields (docs/EXPORT.md; parsed by kernels/dump.cpp).

    `slot <index> <kind> <order> <offset> <capacity> <source_dtype> <ndim> <dims...> <source_ndim>
    <source dims, -1 = dynamic...> <tag>` (an ndim of -1: unknown, no dims follow), then `filtered <tag> <reason>` and `overflow <tag>`.
    """
    lines = [
        PLAN_HEADER,
        f"version {_runtime._version()}",
        f"arena_words {rt.arena.numel()}",
        f"ctrl_words {rt.ctrl.numel()}",
        f"used_words {rt.used_words}",
        f"max_rows {rt.config.max_rows}",
        f"device_type {rt.device.type}",
    ]
    for slot in sorted(rt.slots.values(), key=lambda s: s.order):
        if slot.index == 0:
            continue
        shape = list(slot.payload_shape) if slot.payload_shape is not None else None
        source = [-1 if d is None else d for d in slot.source_shape] if slot.source_shape is not None else None
        fields = [slot.index, slot.kind, slot.order, slot.offset if shape is not None else -1, slot.capacity,
                  slot.source_dtype or "-", -1 if shape is None else len(shape), *(shape or []),
                  -1 if source is None else len(source), *(source or []), slot.tag]
        lines.append("slot " + " ".join(str(f) for f in fields))
    lines += [f"filtered {tag} {reason}" for tag, reason in _runtime._STATE.filtered_tags.items()]
    lines += [f"overflow {tag}" for tag in rt.overflow_tags]
    return "\n".join(lines) + "\n"


def restore_plan(text: str, rt: _arena.Runtime) -> None:
    """Recreate the registry a package was exported with (a fresh process), or check that the
    one in place agrees with it (the exporting process)."""
    lines = text.splitlines()
    if not lines or lines[0] != PLAN_HEADER:
        raise ValueError(f"compiledump.aot: not a compiledump plan (first line {lines[:1]!r})")
    header = _plan_header(text)
    if int(header["arena_words"]) != rt.arena.numel() or int(header["ctrl_words"]) != rt.ctrl.numel():
        raise RuntimeError("compiledump.aot: the package was exported for another arena size; "
                           "load it before any other capture")
    for line in lines[1:]:
        kind_of_line, _, rest = line.partition(" ")
        if kind_of_line == "filtered":
            tag, reason = rest.split(" ")
            _runtime._STATE.filtered_tags[tag] = reason
        elif kind_of_line == "overflow" and rest not in rt.overflow_tags:
            rt.overflow_tags.append(rest)
        elif kind_of_line == "slot":
            _restore_slot(rt, rest.split(" "))
    rt.used_words = max(rt.used_words, int(header["used_words"]))


def _plan_header(text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in text.splitlines()[1:]
                if line and not line.startswith(("slot ", "filtered ", "overflow ")))


def _restore_slot(rt: _arena.Runtime, f: list[str]) -> None:
    index, kind, order, offset, capacity = (int(v) for v in f[:5])
    source_dtype = None if f[5] == "-" else f[5]
    ndim = int(f[6])
    shape = tuple(int(v) for v in f[7 : 7 + max(ndim, 0)]) if ndim >= 0 else None
    at = 7 + max(ndim, 0)
    source = None if int(f[at]) < 0 else [None if int(v) < 0 else int(v) for v in f[at + 1 : at + 1 + int(f[at])]]
    tag = f[-1]
    existing = rt.slots.get((tag, kind == L.KIND_STEP))
    if existing is not None:
        if (existing.index, existing.offset, existing.payload_shape) != (index, offset, shape):
            raise RuntimeError(f"compiledump.aot: tag {tag!r} already has another arena region in this process")
        return
    slot = _arena.Slot(tag=tag, kind=kind, index=index, order=order, payload_shape=shape, offset=offset,
                       capacity=capacity, source_dtype=source_dtype, source_shape=source)
    rt.slots[(tag, kind == L.KIND_STEP)] = slot
    rt.by_index.setdefault(index, slot)
    rt.next_slot = max(rt.next_slot, index + 1)


class LoadedProgram:
    """An AOTInductor package with the arena inputs filled in: call it with the model's inputs."""

    def __init__(self, runner, rt: _arena.Runtime):
        self.runner = runner
        self.runtime = rt

    def __call__(self, *args):
        return self.runner(self.runtime.arena, self.runtime.ctrl, *args)


def load(path: str | os.PathLike, device: str | torch.device | None = None) -> LoadedProgram:
    """Load a package written by `package`; restore (or check) the registry from its plan.

    Capture must be configured (the dump directory comes from this process's settings); the
    arena's capacity settings come from the package. Returns a callable taking the model's inputs.
    """
    if not _runtime.get_config().active:
        raise RuntimeError("compiledump.aot.load: set COMPILEDUMP_DIR or call compiledump.configure(dir=...) "
                           "first: the package writes into a compiledump arena")
    runner = torch._inductor.aoti_load_package(os.fspath(path))
    metadata = runner.get_metadata()
    if PLAN_KEY not in metadata:
        raise ValueError(f"compiledump.aot.load: {path} has no compiledump plan; package it with compiledump.aot.package")
    settings = json.loads(metadata[CONFIG_KEY])
    if _arena.ACTIVE is None:
        # Capacities size the program's inputs; tokens and moe_layers were applied when it was
        # exported, so the manifest must say so too.
        _runtime.configure(**{k: settings[k] for k in (*_config.CAPACITY_FIELDS, "tokens", "moe_layers")})
    if device is None:
        device = _plan_header(metadata[PLAN_KEY]).get("device_type", "cpu")
    _runtime.init(device)
    rt = _arena.ACTIVE
    restore_plan(metadata[PLAN_KEY], rt)
    return LoadedProgram(runner, rt)
