"""Exporting, packaging and loading programs with capture points (see the package docstring)."""

from __future__ import annotations

import json
import os
import warnings

import torch

from .. import config as _config
from ..capture import api, registers
from ..capture.arena import Runtime
from ..capture.state import STATE
from ..ops import native
from .plan import CONFIG_KEY, PLAN_KEY, plan_header, plan_metadata, restore_plan

SHIMS_KEY = "compiledump.native_shims"  # package metadata: "1" when its captures call the C shims


def _archive_metadata(path) -> dict:
    """The package's AOTInductor metadata (its metadata.json files merged), read without loading it."""
    import zipfile

    merged = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith("metadata.json"):
                    try:
                        found = json.loads(archive.read(name))
                    except ValueError:
                        continue
                    if isinstance(found, dict):
                        merged.update(found)
    except (OSError, zipfile.BadZipFile):
        pass
    return merged


def _uses_shims(metadata: dict) -> bool:
    """True when a package's metadata (`_archive_metadata`) says its generated code calls the
    native C shims (known before loading: loading it without the library fails on the symbols)."""
    return metadata.get(SHIMS_KEY) == "1"


_warned_cuda_proxy = False


def _warn_cuda_proxy_package(path, metadata: dict) -> None:
    """Warn once, before loading, that a CUDA package whose captures go through AOTInductor's
    proxy executor killed the process on the first GPU run: printed before a crash, it says why."""
    global _warned_cuda_proxy
    if _warned_cuda_proxy:
        return
    if metadata.get("AOTI_DEVICE_KEY") != "cuda" or _uses_shims(metadata):
        return
    _warned_cuda_proxy = True
    warnings.warn(
        f"compiledump.aot.load: {path} is a CUDA package whose captures run through AOTInductor's proxy "
        "executor (packaged without the native library). On the first H200 run (torch 2.11.0+cu130) loading "
        "such a package killed the process (SIGSEGV in torch's AOTIModelPackageLoader, before any capture ran). "
        "If this process dies here, run the model with torch.compile and CUDA graphs instead, or try a package "
        "made with the native library loaded (its C shims; not yet run on a GPU): docs/export.md",
        RuntimeWarning, stacklevel=3)


class _WithArena(torch.nn.Module):
    """`model` with the arena and the control block as its first two inputs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, arena, ctrl, *args, **kwargs):
        # While traced: the capture points read these (capture/dispatch.py emit_export).
        STATE.export_binding = (arena, ctrl)
        try:
            return self.model(*args, **kwargs)
        finally:
            STATE.export_binding = None


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
    if not registers.enabled():
        raise RuntimeError("compiledump.aot.export: capture is not configured: set COMPILEDUMP_DIR or call "
                           "compiledump.configure(dir=...) before exporting (and not inside profiling())")
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    api.init(device)
    rt = STATE.runtime
    if dynamic_shapes is not None:
        if not isinstance(dynamic_shapes, (tuple, list)) or len(dynamic_shapes) != len(args):
            raise TypeError("compiledump.aot.export: dynamic_shapes must be a tuple with one entry per "
                            "positional argument")
        dynamic_shapes = (None, None, tuple(dynamic_shapes))  # forward(arena, ctrl, *args)
    with torch.no_grad():
        return torch.export.export(_WithArena(model), (rt.arena, rt.ctrl, *args), kwargs,
                                   dynamic_shapes=dynamic_shapes, strict=False)


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
    # With the native library loaded, the generated code calls its C shim for each capture
    # (kernels/aoti_shim.cpp) instead of the proxy executor; loading the package then needs the
    # library (`load` checks, the C++ driver links it).
    shims = native.c_shims(STATE.runtime.device.type if STATE.runtime is not None else "cpu")
    if shims and "aot_inductor.custom_ops_to_c_shims" not in configs:
        configs["aot_inductor.custom_ops_to_c_shims"] = shims
        metadata[SHIMS_KEY] = "1"
    configs["aot_inductor.metadata"] = metadata
    return torch._inductor.aoti_compile_and_package(ep, package_path=os.fspath(path), inductor_configs=configs)


class LoadedProgram:
    """An AOTInductor package with the arena inputs filled in: call it with the model's inputs."""

    def __init__(self, runner, rt: Runtime):
        self.runner = runner
        self.runtime = rt

    def __call__(self, *args):
        return self.runner(self.runtime.arena, self.runtime.ctrl, *args)


def load(path: str | os.PathLike, device: str | torch.device | None = None) -> LoadedProgram:
    """Load a package written by `package`; restore (or check) the registry from its plan.

    Capture must be configured (the dump directory comes from this process's settings); the
    arena's capacity settings come from the package. Returns a callable taking the model's inputs.
    """
    if not api.get_config().active:
        raise RuntimeError("compiledump.aot.load: set COMPILEDUMP_DIR or call compiledump.configure(dir=...) "
                           "first: the package writes into a compiledump arena")
    archived = _archive_metadata(path)
    if _uses_shims(archived) and not native.native_available():
        raise RuntimeError(f"compiledump.aot.load: {path} calls the native library's C shims (it was packaged "
                           "with the library loaded); load the library (COMPILEDUMP_NATIVE) or re-package "
                           "it in a process without it")
    _warn_cuda_proxy_package(path, archived)
    runner = torch._inductor.aoti_load_package(os.fspath(path))
    metadata = runner.get_metadata()
    if PLAN_KEY not in metadata:
        raise ValueError(f"compiledump.aot.load: {path} has no compiledump plan; package it with compiledump.aot.package")
    settings = json.loads(metadata[CONFIG_KEY])
    if STATE.runtime is None:
        # Capacities size the program's inputs; tokens and moe_layers were applied when it was
        # exported, so the manifest must say so too.
        api.configure(**{k: settings[k] for k in (*_config.CAPACITY_FIELDS, "tokens", "moe_layers")})
    if device is None:
        device = plan_header(metadata[PLAN_KEY]).get("device_type", "cpu")
    api.init(device)
    rt = STATE.runtime
    restore_plan(metadata[PLAN_KEY], rt)
    return LoadedProgram(runner, rt)
