"""The optional native op library: builds with CMake against this torch, and its CPU kernel
matches the Python reference kernel on every sample (skipped where no compiler/cmake exists)."""

import importlib
import re

import pytest
import torch

from compiledump.ops import layout as L
from compiledump.ops import geometry, native, reference, register, schemas

from helpers.samples import DTYPES, GEOMETRIES, REGISTERS, assert_matches_reference, int_samples, run_kernel


@pytest.fixture(scope="module")
def native_library(request):
    if native.native_available():
        yield native._loaded
        return
    library = request.getfixturevalue("native_build") / native.LIBRARY_NAME
    # Python's kernels first, then the library's over them, in the order a run with the library
    # has them (test_kernel_owner); whether an earlier test file of this worker had imported
    # capture/dispatch.py decided it before, so this file alone failed in the pure lane.
    importlib.import_module("compiledump.capture.dispatch")
    assert native.load(library)
    yield str(library)
    # The rest of the suite runs the Python capture path again. The kernels stay registered; the
    # native capture_export_v1 replaces the Python one (same semantics: tests/export/test_aot.py).
    native._loaded = None


def _native_kernel(x, arena, ctrl, kind, base, offset, capacity, reason):
    register.capture_native(x, arena, ctrl, kind, base, offset, capacity, reason)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_RECORD_ROWS])
def test_native_matches_reference(native_library, geometry, dtype, kind):
    if kind == L.KIND_RECORD_ROWS and geometry == "1d":
        pytest.skip("all-rows records are 2-D or 3-D (record() stores a 1-D tensor whole)")
    g = torch.Generator().manual_seed(11)
    x = GEOMETRIES[geometry](g, dtype)
    assert_matches_reference(_native_kernel, x, kind, calls=3)


@pytest.mark.parametrize("name", list(int_samples()))
def test_native_ids_match_reference(native_library, name):
    x = int_samples()[name]
    assert_matches_reference(_native_kernel, x, L.KIND_IDS, calls=2)


def test_opcheck_native_kernel(native_library):
    x = torch.randn(5, 33, 4).transpose(1, 2)
    arena = torch.zeros(256)
    ctrl = torch.zeros(L.control_words(2), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, -1
    _, geo = geometry.geometry(x, L.KIND_RECORD)
    torch.library.opcheck(schemas.capture_kernel, (x, arena, ctrl, L.KIND_RECORD, L.slot_base(1), 0, 1, 0, *geo))


def test_kernel_owner(native_library):
    assert native.kernel_owner(schemas.KERNEL, "CPU") == "native"
    # capture_v1 from the library's region table, which falls back to Python's registry.
    importlib.import_module("compiledump.capture.dispatch")  # registers the Python kernels
    assert native.kernel_owner(schemas.CAPTURE, "CPU") == "native"
    assert native.kernel_owner(schemas.RESOLVE, "CPU") == "python"
    assert native.kernel_owner(schemas.KERNEL, "Meta") == "python"  # fake implementations stay Python's


def test_native_loader_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", None)
    with pytest.raises(RuntimeError, match="native library not found"):
        native.load(tmp_path / "missing.so")
    monkeypatch.setenv("COMPILEDUMP_NATIVE", "0")
    assert native.load() is False and not native.native_available()


@pytest.mark.parametrize("body, why", [
    ("", "predates the control-layout check"),
    ('extern "C" long long compiledump_control_layout() { return 8013; }', "built for control layout 8013"),
    # Built against another torch: refused before it is loaded (it might load, with another ABI).
    ('extern "C" const char compiledump_built_for_torch[] = "compiledump-built-for-torch=1.0.0;";',
     rf"was built for torch 1\.0\.0, and this is torch {re.escape(torch.__version__)}"),
    # A library that cannot be loaded at all (before the version stamp: torch's symbols missing).
    ('extern "C" void compiledump_gone(); extern "C" void compiledump_calls() { compiledump_gone(); }',
     r"cannot be loaded \(.*undefined symbol: compiledump_gone"),
])
def test_a_library_built_for_another_control_layout_or_torch_is_not_loaded(monkeypatch, tmp_path, body, why):
    """A library from older sources (an editable install not rebuilt after a pull) would count in
    the wrong control-block words, and one built against another torch would not load or would
    disagree with it on the C++ ABI: it is refused, loudly when required, else with one warning
    and the Python path; the library the suite built reports this package's layout and torch."""
    import shutil
    import subprocess

    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source, stale = tmp_path / "stale.cpp", tmp_path / "libstale.so"
    source.write_text(body + "\nextern \"C\" int compiledump_unrelated() { return 0; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(stale)], check=True, timeout=120)
    monkeypatch.setattr(native, "_loaded", None)
    with pytest.raises(RuntimeError, match=why + ".*rebuild it"):
        native.load(stale)
    monkeypatch.delenv("COMPILEDUMP_NATIVE", raising=False)  # the library built into the package: optional
    monkeypatch.setattr(native, "_candidate", lambda: stale)
    with pytest.warns(RuntimeWarning, match=why + ".*using the Python capture path"):
        assert native.load() is False
    assert native._loaded is None


def test_the_built_library_reports_this_control_layout(native_library):
    import ctypes

    reported = ctypes.CDLL(native_library).compiledump_control_layout
    reported.restype = ctypes.c_int64
    assert reported() == L.CONTROL_LAYOUT == L.HEADER_WORDS * 1000 + L.SLOT_WORDS
    release = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__).groups())
    assert native.built_for_torch(native_library) == release


# capture_export_v1: (x, kind, payload the region was sized for, tokens, offset, preset reason)
_EXPORT_CASES = {
    "record_3d": (lambda g: torch.randn(7, 4, 33, generator=g).bfloat16(), L.KIND_RECORD, [33], 7, 16, 0),
    "record_noncontig": (lambda g: torch.randn(7, 33, 4, generator=g).transpose(1, 2), L.KIND_RECORD, [33], 0, 16, 0),
    "token_gated": (lambda g: torch.randn(5, 33, generator=g), L.KIND_RECORD, [33], 7, 16, 0),
    "once_1d": (lambda g: torch.randn(13, generator=g).half(), L.KIND_RECORD_ONCE, [13], 7, 16, 0),
    "step_4d": (lambda g: torch.randn(3, 2, 5, 6, generator=g), L.KIND_STEP, [2, 5, 6], 0, 16, 0),
    "ids": (lambda g: torch.randint(-9, 99, (7, 2), generator=g), L.KIND_IDS, [7, 2], 7, 16, 0),
    "shape_changed": (lambda g: torch.randn(4, 10, generator=g), L.KIND_STEP, [11], 0, 16, 0),
    "arena_full": (lambda g: torch.randn(4, 10, generator=g), L.KIND_RECORD, [10], 0, -1, 0),
    "table_full": (lambda g: torch.randn(4, 10, generator=g), L.KIND_RECORD, [10], 0, 16, L.CNT_TAG_TABLE_FULL),
    "step_0d": (lambda g: torch.randn((), generator=g), L.KIND_STEP, [], 0, 16, 0),
    "ids_0d": (lambda g: torch.tensor(-3, dtype=torch.int32), L.KIND_IDS, [], 5, 16, 0),
}


def _python_capture_export(x, arena, ctrl, slot, kind, reason, offset, payload, capacity, tokens):
    # Python's gates and Python's reference kernel, whatever kernel the library registered.
    reference.capture_reference(x, arena, ctrl, kind, *register.export_gates(x, slot, kind, reason, offset, payload,
                                                                     capacity, tokens))


@pytest.mark.parametrize("case", list(_EXPORT_CASES))
def test_native_capture_export_matches_python(native_library, case):
    make, kind, payload, tokens, offset, reason = _EXPORT_CASES[case]
    x = make(torch.Generator().manual_seed(3))
    assert native.kernel_owner(schemas.EXPORT) == "native", "a stale native library is loaded: rebuild it"
    for registers in REGISTERS:
        results = []
        for impl in (_python_capture_export, schemas.capture_export):  # Python, then the native op
            enabled, rows, record_row, step_row, check_all = (*registers, 0)[:5]
            arena = torch.full((1024,), float("nan"))
            ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
            ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS] = enabled, rows, 1
            ctrl[L.REG_RECORD_ROW], ctrl[L.REG_STEP_ROW], ctrl[L.REG_CHECK_ALL] = record_row, step_row, check_all
            for _ in range(3):
                impl(x, arena, ctrl, 2, kind, reason, offset, schemas.encode_payload(payload), 4, tokens)
            results.append((arena, ctrl))
        (want_arena, want_ctrl), (got_arena, got_ctrl) = results
        assert torch.equal(got_ctrl, want_ctrl)
        assert want_ctrl[L.slot_base(2):L.slot_base(2) + L.SLOT_COUNTERS].sum() == 3  # one counter per call
        assert torch.equal(got_arena.view(torch.int32), want_arena.view(torch.int32))


_PAYLOAD_SHAPES = [(), (5,), (4, 6), (4, 3, 6), (2, 3, 1, 5)]
_PAYLOAD_KINDS = [L.KIND_RECORD, L.KIND_RECORD_ONCE, L.KIND_STEP, L.KIND_IDS, L.KIND_RECORD_ROWS]


@pytest.mark.parametrize(("kind", "shape"), [(kind, shape) for kind in _PAYLOAD_KINDS for shape in _PAYLOAD_SHAPES
                                             # all-rows records take 2-D and 3-D tensors only
                                             if kind != L.KIND_RECORD_ROWS or len(shape) in (2, 3)], ids=str)
def test_native_payload_check_matches_python(native_library, kind, shape):
    """The C++ payload-shape check (it allocates nothing) against Python's `payload_shape`: the
    region's own payload passes, every near miss is counted `shape_changed`, on both paths."""
    x = torch.randint(0, 9, shape) if kind == L.KIND_IDS else torch.randn(shape)
    right = list(geometry.payload_shape(tuple(shape), kind))
    candidates = [right, right + [1], right[:-1], [d + 1 for d in right], [1, *right]]
    for payload in candidates:
        counters = []
        for impl in (_python_capture_export, schemas.capture_export):
            arena = torch.zeros(1024)
            ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
            ctrl[L.REG_ENABLED], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, -1
            impl(x, arena, ctrl, 2, kind, 0, 16, schemas.encode_payload(payload), 4, 0)
            counters.append(ctrl[L.slot_base(2) : L.slot_base(2) + L.SLOT_COUNTERS].tolist())
        assert counters[0] == counters[1], payload
        assert counters[0][L.CNT_SHAPE_CHANGED] == (payload != right), payload


def test_native_available_is_public():
    import compiledump

    assert compiledump.native_available is native.native_available
    assert compiledump.native_available() == (native._loaded is not None)


EXTRA_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.uint8]


@pytest.mark.parametrize("dtype", EXTRA_DTYPES, ids=str)
@pytest.mark.parametrize("kind", [L.KIND_RECORD, L.KIND_STEP, L.KIND_IDS])
def test_fp8_and_unsigned_inputs_match_reference(native_library, dtype, kind):
    """The native CPU kernel takes the dtypes the Triton and CUDA kernels take (fp8, unsigned)."""
    if kind == L.KIND_IDS and dtype.is_floating_point:
        pytest.skip("record_ids takes integer tensors")
    g = torch.Generator().manual_seed(5)
    if dtype.is_floating_point:
        x = (torch.randn(6, 4, 37, generator=g) * 3).to(dtype)
    else:
        x = torch.randint(0, 200, (6, 4, 37), generator=g).to(dtype)
    x = x[:, :, 1:]  # not contiguous
    for registers in REGISTERS[:3]:
        want_arena, want_ctrl = run_kernel(reference.capture_reference, x, kind, registers, calls=2)
        got_arena, got_ctrl = run_kernel(_native_kernel, x, kind, registers, calls=2)
        assert torch.equal(got_ctrl, want_ctrl)
        assert torch.equal(got_arena.view(torch.int32), want_arena.view(torch.int32))
