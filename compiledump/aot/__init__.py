"""Capture points in exported programs: torch.export, AOTInductor packages, C++-only runs.

An exported program cannot consult this process's tag registry when it runs (it may run in a
process without Python), so exporting differs from compiling in two ways:

- the arena and the control block are explicit inputs of the program (AOTInductor would
  otherwise copy them into the package as constants, and the host would read stale copies);
- each capture point is a `compiledump::capture_export_v1` call whose arena region, payload
  shape and token gate are arguments, fixed while exporting: the region is claimed from the
  traced shape then, as a CUDA graph capture claims it.

The registry that the flush needs to name the arena's regions (tags, kinds, regions, shapes) is
written into the package as metadata (the "plan", plan.py), which `load` (program.py, with
`export` and `package`) and the native library's C++ flush (kernels/dump.cpp) read back.
docs/export.md is the contract.

    ep = compiledump.aot.export(model, (tokens,))          # inputs become (arena, ctrl, tokens)
    path = compiledump.aot.package(ep, "model.pt2")        # AOTInductor + the plan
    run = compiledump.aot.load(path)                        # another process: registry restored
    logits = run(tokens)                                    # arena and ctrl passed for you
    compiledump.flush()
"""

from .plan import CONFIG_KEY, PLAN_HEADER, PLAN_KEY, plan_metadata, plan_text, restore_plan
from .program import LoadedProgram, export, load, package

__all__ = ["CONFIG_KEY", "PLAN_HEADER", "PLAN_KEY", "LoadedProgram", "export", "load", "package", "plan_metadata",
           "plan_text", "restore_plan"]
