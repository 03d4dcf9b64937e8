"""Triton's JIT as it behaves on a GPU, for the Triton kernel run by the interpreter on CPU.

`TritonKeys` wraps the interpreted capture kernel: every launch is keyed by Triton's own binder
(the function Triton runs on each launch to choose the compiled kernel), and returns what the JIT
returns on a GPU, the compiled kernel of that specialization (`CompiledStandIn`), which
ops/triton_kernel.py then launches directly. Used by tests/ops/test_variants.py (which launches a
CUDA graph capture may make), tests/ops/test_triton_layout_classes.py (every layout class
launched directly) and tests/repo/test_gpu_scripts.py (gpu_check's launch check).
"""

from __future__ import annotations

import contextlib

from compiledump.ops import triton_kernel, variants
from compiledump.ops.triton_kernel import INT_ARGS


@contextlib.contextmanager
def stand_in_jit(monkeypatch, compiled=None, capturing=lambda: False):
    """The capture kernel behind a `TritonKeys` (whose launches return `compiled`, default
    `CompiledStandIn`) for the block, with the prepared variants forgotten before and after."""
    keys = TritonKeys(triton_kernel.capture_kernel, capturing)
    keys.compiled = compiled or CompiledStandIn
    monkeypatch.setattr(triton_kernel, "capture_kernel", keys)
    variants.forget()
    try:
        yield keys
    finally:
        variants.forget()


class TritonKeys:
    """Wraps the kernel: keys every launch with Triton's binder, tagged with the capture phase.

    A launch returns what Triton's JIT returns on a GPU, the compiled kernel of the launch's
    specialization (CompiledStandIn), which ops/triton_kernel.py then launches directly."""

    def __init__(self, kernel, capturing=lambda: False):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        self.kernel = kernel
        self.capturing = capturing  # whether a CUDA graph is being captured now
        self.arg_names = kernel.arg_names
        jit = JITFunction(kernel.fn, do_not_specialize=INT_ARGS)
        self.binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        self.outside, self.during = set(), set()
        self.first_needed_during = set()  # keys a capture launched before any launch outside one did
        self.direct = 0  # launches that went straight to a compiled kernel
        self.compiled = CompiledStandIn  # what a JIT launch returns

    def note(self, key):
        if self.capturing():
            self.during.add(key)
            if key not in self.outside:
                self.first_needed_during.add(key)
        else:
            self.outside.add(key)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            key = str(specialization) + str(sorted(options.items()))
            self.note(key)
            self.kernel[grid](*args, **kwargs)
            return self.compiled(self, specialization, options, key)

        return run


class CompiledStandIn:
    """The compiled kernel of one specialization, as Triton's JIT returns it on a GPU:
    `kernel[grid](*args)` launches it with every argument (constexprs included) in the kernel's
    parameter order, and no binder runs. The stand-in runs the binder anyway: a direct launch whose
    arguments Triton would have compiled another kernel for fails, and so does one whose arguments
    are not the kernel's, in its order."""

    def __init__(self, keys, specialization, options, key):
        self.keys, self.specialization, self.options, self.key = keys, specialization, options, key

    def __getitem__(self, grid):
        assert len(grid) == 3, "a compiled kernel's launcher reads grid[0], grid[1] and grid[2]"

        def runner(*args):
            names = self.keys.kernel.arg_names
            assert len(args) == len(names), f"{len(args)} arguments for a kernel of {len(names)}"
            _, specialization, _ = self.keys.binder(*args)
            assert specialization == self.specialization, "a direct launch of a kernel compiled for other arguments"
            self.keys.note(self.key)
            self.keys.direct += 1
            self.keys.kernel[grid](**dict(zip(names, args)), **self.options)

        return runner
