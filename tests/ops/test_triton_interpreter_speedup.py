"""tests/helpers/triton_interpreter.py: an interpreted launch patches triton.language once, however
many nested @triton.jit calls its programs make, and computes what it computed before."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from helpers import triton_interpreter


@triton.jit
def _scaled(x, k):
    return x * k + 1.0


@triton.jit
def _kernel(src, dst, n, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask)
    for _ in tl.static_range(CALLS):
        x = _scaled(x, 0.5)
    tl.store(dst + offs, x, mask=mask)


def _launch(x, calls):
    out = torch.empty_like(x)
    _kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), CALLS=calls, BLOCK=16)
    return out


def test_installed_where_the_suite_runs():
    # conftest installs it; False here means Triton's interpreter changed shape and the suite
    # runs at the shipped interpreter's speed: see the helper's docstring.
    assert triton_interpreter.install() and interpreter._patch_lang.skips_nested


@pytest.mark.parametrize("calls", [1, 7])
def test_one_language_patch_per_launch(calls, monkeypatch):
    patched = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (patched.append(a[0]), real(*a))[1])
    x = torch.randn(37, generator=torch.Generator().manual_seed(calls))  # 3 programs, the last one partial
    want = x.clone()
    for _ in range(calls):
        want = want * 0.5 + 1.0
    torch.testing.assert_close(_launch(x, calls), want, rtol=0, atol=0)
    per_patch = len(patched)
    patched.clear()
    _launch(x, 1)
    assert len(patched) == per_patch  # the same for 1 and 7 nested calls x 3 programs
    assert hasattr(tl, "load") and not getattr(tl.load, "__name__", "") == "<lambda>"  # restored after the launch
