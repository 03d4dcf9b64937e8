"""A @triton.jit helper in a module that imports triton.language.core and not triton.language,
for tests/ops/test_triton_interpreter_speedup.py: a nested call whose language module the
launched kernel's module does not import, which the interpreter must patch for it."""

import triton
from triton.language import core


@triton.jit
def absolute(x):
    return core.where(x > 0, x, -x)
