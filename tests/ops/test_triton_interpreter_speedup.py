"""tests/helpers/triton_interpreter.py: an interpreted launch patches triton.language once, however
many nested @triton.jit calls its programs make; a nested module with another language module
(triton.language.core) gets its own patch, once; and the kernels compute what they did. The
interpreter's 32-bit overflow checks are off in the suite and on, asserted, inside
`overflow_checks()`."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from helpers import triton_interpreter
from helpers.triton_core_only import absolute


@triton.jit
def _scaled(x, k):
    return x * k + 1.0


@triton.jit
def _kernel(src, dst, n, CALLS: tl.constexpr, CORE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask)
    for _ in tl.static_range(CALLS):
        x = _scaled(x, -0.5)
        if CORE:
            x = absolute(x)
    tl.store(dst + offs, x, mask=mask)


def test_installed_where_the_suite_runs():
    # conftest installs it; False here means Triton's interpreter changed shape and the suite
    # runs at the shipped interpreter's speed: see the helper's docstring.
    assert triton_interpreter.install() and interpreter._patch_lang.skips_nested


@pytest.mark.parametrize("core", [False, True], ids=["same_languages", "core_only_helper"])
def test_patches_per_launch_do_not_grow_with_nested_calls(core, monkeypatch):
    patched = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (patched.append(a[0]), real(*a))[1])
    x = torch.randn(37, generator=torch.Generator().manual_seed(5))  # 3 programs, the last one partial
    counts = {}
    # The first launch of a module's functions adds the interpreter's globals to that module
    # (Triton's rewriter), which can change what later patches walk: one launch first.
    for calls in (1, 1, 7):
        want = x.clone()
        for _ in range(calls):
            want = want * -0.5 + 1.0
            want = want.abs() if core else want
        out = torch.empty_like(x)
        patched.clear()
        _kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), CALLS=calls, CORE=core, BLOCK=16)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        counts[calls] = len(patched)
    assert counts[1] == counts[7], counts  # 3 programs x 1 or 7 nested calls: the same patches
    if core:  # triton.language.core patched for the helper once per launch, not at every call
        assert sum(module is tl.core for module in patched) == 1, patched


@triton.jit
def _times(src, dst, k):
    tl.store(dst, tl.load(src) * k)


def test_overflow_checks_only_inside_the_block_and_the_values_are_the_same():
    x = torch.tensor([1 << 20], dtype=torch.int32)
    out = torch.zeros_like(x)
    _times[(1,)](x, out, 1 << 12)  # 2^32 in 32 bits: it wraps, as a GPU build without debug does
    assert out.item() == 0
    with triton_interpreter.overflow_checks():
        with pytest.raises(Exception, match="overflow detected for operation mul"):
            _times[(1,)](x, out, 1 << 12)
        _times[(1,)](x, out, 3)
        assert out.item() == 3 << 20
    _times[(1,)](x, out, 1 << 12)
    assert out.item() == 0 and not interpreter.interpreter_builder.options.sanitize_overflow
