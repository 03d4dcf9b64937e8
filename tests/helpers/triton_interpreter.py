"""A faster Triton interpreter for the suite: each launch patches triton.language once, not again
on every nested @triton.jit call.

Triton's interpreter (3.6 and 3.9 alike) patches triton.language for the whole grid when a launch
starts (`GridExecutor.__call__` -> `_patch_lang`, restored when the grid is done), and then again
at every call of a nested @triton.jit function (`InterpretedFunction.__call__` -> `_patch_lang`,
never restored). What `_patch_lang` patches are the language modules themselves (`triton.language`
and `triton.language.core`, whichever the function's module imports), shared by every module. So
a nested call whose module imports no language module the launched kernel's module did not
(compiledump/ops/triton_steps.py's helpers, called from triton_kernel.py's kernel) finds them
patched already, and its patch walks them with `inspect.getmembers` to re-wrap nothing: about a
third of every interpreted kernel case. Here such a call skips it; any other patches as before
(a module with a language module the kernel's lacks: once per launch).

It also stops the interpreter from computing 32-bit overflow checks that it never asserts (see
`set_overflow_checks`); the tests whose sizes could pass 2^31 turn them on, asserted.

Only speed changes: every interpreted test compares the kernel with the reference kernel bit for
bit, so a patch that changed what the interpreter computes would fail them. Where Triton's
internals differ from what this expects, nothing is installed and the interpreter runs as
shipped (tests/ops/test_triton_interpreter_speedup.py then fails, to say the speed-up is gone).
"""

import contextlib
import dataclasses
import threading

# The running launch of this thread: its kernel (`fn`) and the language modules patched for it
# (`languages`, None until the kernel's own patch). The patch itself is process-wide, as Triton's
# is; Triton's interpreter runs one launch at a time (its builder is a global), so per-thread
# bookkeeping only keeps a launch in another thread from reading this one's.
_launch = threading.local()


def _languages(fn) -> set:
    """The language modules `_patch_lang(fn)` patches: those `fn`'s module imports."""
    import triton.language as tl

    return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` and `GridExecutor.__call__`; True where installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter._patch_lang, "skips_nested", False):
        return True
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def _patch_lang(fn):
        launched, patched = getattr(_launch, "fn", None), getattr(_launch, "languages", None)
        languages = _languages(fn)
        if patched is not None and languages and languages <= patched:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's patch stands
        scope = patch_lang(fn)  # (no language module at all: Triton's own assertion says so)
        if fn is launched and patched is None:
            _launch.languages = languages  # the kernel's own patch, restored when the grid is done
        elif patched is not None:
            patched |= languages  # a nested module with a language module the kernel's lacks
        return scope

    def __call__(self, *args, **kwargs):
        outer = getattr(_launch, "fn", None), getattr(_launch, "languages", None)
        _launch.fn, _launch.languages = self.fn, None
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch.fn, _launch.languages = outer

    _patch_lang.skips_nested = True
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__
    set_overflow_checks(False)
    return True


def set_overflow_checks(on: bool) -> bool:
    """Turn the interpreter's 32-bit overflow checks on or off; returns whether they were on.

    Triton checks every 32-bit integer add, sub and mul for overflow (recomputed in 64 bits and
    compared) where `sanitize_overflow` is set, and its interpreter sets it; but the check ends in a
    device_assert, which does nothing unless `debug` is set too, and the interpreter leaves that off.
    As shipped, the interpreter pays for every check (about a third of an interpreted kernel case)
    and asserts none. Off, nothing else changes (the 32-bit value is what is computed either way);
    on, both are set, so an overflow fails on the assertion naming the operation: the tests whose
    sizes could pass 2^31 (tests/ops/test_offsets64.py, the NaN/Inf count's cap) run that way."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return on  # no Triton: nothing is interpreted
    builder = interpreter.interpreter_builder
    was = builder.options.sanitize_overflow and builder.options.debug
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=on, debug=on)
    return was


@contextlib.contextmanager
def overflow_checks():
    """The interpreter's 32-bit overflow checks on inside the block (see `set_overflow_checks`)."""
    was = set_overflow_checks(True)
    try:
        yield
    finally:
        set_overflow_checks(was)
