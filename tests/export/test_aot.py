"""Exported programs (compiledump.aot): torch.export, AOTInductor packages run from Python, and
the C++-only run (kernels/aoti_driver.cpp with the native library's flush).

The reference is the same engine session run eagerly in Python, whose dump the seed-equivalence
tests already tie to the seed. "Same dump" means: the same npz keys, equal values (the compiled
program may round differently: rtol 1e-5), equal int ids, and the same per-tag counters and drops
in the manifest.
"""

import dataclasses
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump import aot
from compiledump.ops import native, schemas
from compiledump.capture.recover import recover_live
from compiledump.capture.state import STATE
from compiledump.ops import layout as L
from compiledump.demo.model import ModelConfig, TinyMoE, export_session, run_session, session_forward

REPO = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("export_aoti", REPO / "examples" / "export_aoti.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _example()


def _manifest(npz: str) -> dict:
    return json.loads(Path(npz).with_suffix(".json").read_text())


def assert_same_dump(reference: str, run: str) -> None:
    with np.load(reference) as ref, np.load(run) as got:
        assert sorted(got.files) == sorted(ref.files)
        for key in ref.files:
            assert got[key].dtype == ref[key].dtype and got[key].shape == ref[key].shape, key
            if ref[key].dtype == np.int32:
                np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
            else:
                np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    want, have = _manifest(reference), _manifest(run)
    assert have["tags"] == want["tags"]
    assert have["drops"] == want["drops"] and have["filtered_tags"] == want["filtered_tags"]
    for key, entry in want["keys"].items():
        # A dimension left dynamic in the exported program has no single source size (null).
        source = [None if got is None else want_dim
                  for want_dim, got in zip(entry["source_shape"], have["keys"][key]["source_shape"])]
        assert have["keys"][key] == {**entry, "source_shape": source}, key


# --------------------------------------------------------------------------------------------
# The export contract


def test_layout_header_matches_python():
    constants = dict(re.findall(r"constexpr int64_t (\w+) = (-?\d+);", (REPO / "kernels" / "layout.h").read_text()))
    assert len(constants) >= 20
    for name, value in constants.items():
        assert getattr(L, name) == int(value), name


def test_schemas_header_is_current():
    spec = importlib.util.spec_from_file_location("write_schemas_header", REPO / "scripts" / "write_schemas_header.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.HEADER.read_text() == script.render(), (
        "kernels/schemas.h is stale: run python scripts/write_schemas_header.py")
    # Every op name carries its version, and each schema defines the op it names.
    for name, schema in schemas.SCHEMAS.items():
        assert re.fullmatch(r"[a-z_]+_v\d+", name) and schema.startswith(f"{name}(")


def test_opcheck_capture_export():
    g = torch.Generator().manual_seed(5)
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32)
    ctrl[L.REG_ENABLED], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, -1
    samples = [
        (torch.randn(7, 4, 33, generator=g).to(torch.bfloat16), L.KIND_RECORD, [33], 7),
        (torch.randn(7, 33, 4, generator=g).transpose(1, 2), L.KIND_RECORD, [33], 5),  # token-gated
        (torch.randn(3, 9, generator=g).half(), L.KIND_STEP, [9], 0),
        (torch.randint(0, 99, (7, 2), generator=g), L.KIND_IDS, [7, 2], 7),
        (torch.randn(5, 10, generator=g), L.KIND_RECORD, [11], 0),  # shape changed
        (torch.randn((), generator=g), L.KIND_STEP, [], 0),  # 0-d: an empty payload shape
    ]
    for x, kind, payload, tokens in samples:
        args = (x, torch.zeros(512), ctrl.clone(), 1, kind, 0, 16, schemas.encode_payload(payload), 4, tokens)
        torch.library.opcheck(schemas.capture_export, args)


# --------------------------------------------------------------------------------------------
# torch.export, run by the exported program's own module (no AOTInductor compile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exported_program_writes_the_eager_dump(tmp_path, dtype):
    cfg = ModelConfig(layers=2, captures_per_layer=5)
    session = EX.make_session(cfg, prompt_len=EX.PROMPT_LEN, steps=5)

    def model():
        return TinyMoE(cfg, dump=compiledump, dtype=dtype)

    EX._start(tmp_path / "eager")
    run_session(model(), compiledump, session)
    eager = compiledump.flush()

    EX._start(tmp_path / "export")
    programs = [ep.module() for ep in export_session(model(), session)]
    rt = STATE.runtime
    prefill, decode = (functools.partial(program, rt.arena, rt.ctrl) for program in programs)
    run_session(session_forward(prefill, decode), compiledump, session)
    assert_same_dump(eager, compiledump.flush())
    compiledump.reset()


def test_plan_round_trip(tmp_path):
    EX._start(tmp_path)
    session = EX.SESSION
    aot.export(TinyMoE(EX.MODEL, dump=compiledump), (session.prompt,))
    rt = STATE.runtime
    text = aot.plan_text(rt)
    exported = {key: vars(slot) for key, slot in rt.slots.items()}
    compiledump.reset()
    compiledump.configure(dir=str(tmp_path))
    compiledump.init("cpu")
    aot.restore_plan(text, STATE.runtime)
    assert {key: vars(slot) for key, slot in STATE.runtime.slots.items()} == exported
    assert aot.plan_text(STATE.runtime) == text
    compiledump.reset()


def test_export_errors(tmp_path):
    class Ids(torch.nn.Module):
        def forward(self, x):
            compiledump.record_ids("ids", x)
            return x + 1

    compiledump.reset()
    previous = compiledump.get_config()
    try:
        compiledump.configure(dir=None)
        with pytest.raises(RuntimeError, match="capture is not configured"):
            aot.export(Ids(), (torch.arange(6),))
        compiledump.configure(dir=str(tmp_path), tokens=0)
        x = torch.arange(6)
        with pytest.raises(RuntimeError, match="exported without its arena"):
            torch.export.export(Ids(), (x,), strict=False)
        with pytest.raises(ValueError, match="dynamic shape"):
            aot.export(Ids(), (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
        with pytest.raises(TypeError, match="one entry per"):
            aot.export(Ids(), (x,), dynamic_shapes=({0: None}, {0: None}))
    finally:
        compiledump.reset()
        compiledump.configure(dir=previous.dir, tokens=previous.tokens)


def test_export_is_told_from_compile_by_torch_export_alone():
    """Captures take the export path only under torch.export (strict or not), never under a plain
    torch.compile: torch 2.11's Dynamo folds torch.compiler.is_exporting() to True in both, which
    sent every compiled capture to the export path ("exported without its arena")."""
    from compiledump.capture import api

    def branch(x):
        return x + 1 if api._exporting() else x - 1

    class Branch(torch.nn.Module):
        def forward(self, x):
            return branch(x)

    x = torch.randn(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(branch, fullgraph=True)(x), x - 1)
    assert torch.equal(branch(x), x - 1)
    for strict in (False, True):
        program = torch.export.export(Branch(), (x,), strict=strict)
        assert torch.equal(program.module()(x), x + 1), f"strict={strict}"
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# AOTInductor packages: from Python, and from the C++-only driver


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    out = tmp_path_factory.mktemp("aoti")
    eager = EX.run_eager(out, EX.SESSION)
    prefill, decode = EX.export_packages(out, EX.SESSION)
    yield out, eager, prefill, decode
    compiledump.reset()


def test_aoti_package_from_python(packages):
    out, eager, prefill, decode = packages
    # aot.load in a process whose registry is empty (reset): the plan restores it.
    assert_same_dump(eager, EX.run_packages(out, prefill, decode, EX.SESSION))


def test_aoti_package_from_cpp_driver(packages, native_build, tmp_path):
    out, eager, prefill, decode = packages
    driver = native_build / "compiledump_aoti_driver"
    cpp = EX.run_driver(str(driver), tmp_path, prefill, decode, EX.SESSION)
    assert Path(cpp).parent == tmp_path / "cpp"
    assert_same_dump(eager, cpp)
    assert _manifest(cpp)["writer"] == "native"

    # The CLI reads the C++ dump: inspect lists it, compare finds no divergence ...
    cli = [sys.executable, "-m", "compiledump"]
    shown = subprocess.run([*cli, "inspect", cpp], capture_output=True, text=True)
    assert shown.returncode == 0 and "logits_7" in shown.stdout, shown.stdout + shown.stderr
    same = subprocess.run([*cli, "compare", eager, cpp], capture_output=True, text=True)
    assert same.returncode == 0 and "no divergence" in same.stdout, same.stdout + same.stderr
    # ... and names the broken layer when the reference has a bug there.
    buggy = EX.run_eager(tmp_path / "buggy", EX.SESSION, ModelConfig(**{**vars(EX.MODEL), "bug_layer": 1}))
    diff = subprocess.run([*cli, "compare", buggy, cpp], capture_output=True, text=True)
    assert diff.returncode == 1 and "first divergence: layer1" in diff.stdout, diff.stdout + diff.stderr
    compiledump.reset()


def test_native_packages_call_the_c_shim(packages, monkeypatch):
    """Packaged with the native library loaded, the generated code calls its C shim for every
    capture (no proxy executor), and loading such a package without the library is refused."""
    if not native.native_available():
        pytest.skip("the native library is not loaded: packages use the proxy executor")
    import zipfile

    out, eager, prefill, decode = packages
    with zipfile.ZipFile(prefill) as archive:
        wrapper = "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith(".wrapper.cpp"))
    assert wrapper.count("aoti_torch_cpu_capture_export_v1(") > 10
    assert "proxy_executor_call_function(" not in wrapper
    monkeypatch.setattr(native, "native_available", lambda: False)
    with pytest.raises(RuntimeError, match="C shims"):
        aot.load(prefill)


def test_driver_usage_and_bad_package(native_build, tmp_path):
    driver = str(native_build / "compiledump_aoti_driver")
    usage = subprocess.run([driver], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
    missing = subprocess.run([driver, str(tmp_path / "no.pt2"), str(tmp_path / "no.pt2"), "x", str(tmp_path)],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "compiledump_aoti_driver:" in missing.stderr


class _Corners(torch.nn.Module):
    """Captures whose export arguments are corner cases: a token-gated record and ids (the traced
    batch is not the token count), a 0-d step (empty payload shape), a layer's step state kept for
    COMPILEDUMP_LAYER_STEPS steps (its later steps, deliberate drops, were counted as
    step_capacity once loaded: the plan lost the reason), a tag past max_tags."""

    def forward(self, x):
        h = x.float().sin()
        compiledump.record("hidden", h)
        compiledump.record_ids("ids", x.long() % 7)
        compiledump.record_step("scalar", h.sum())
        compiledump.record_step("layer0_step", h[:1])
        compiledump.record("overflow", h * 2)
        return h


def test_a_cuda_proxy_package_warns_before_it_loads(tmp_path, monkeypatch):
    """Loading a CUDA package whose captures use the proxy executor killed torch 2.11's loader on
    the first GPU run (benchmarks/gpu/gpu_diag_*.log): load() warns once before loading, so the
    warning is what a user reads above the crash; CPU packages and packages with the C shims load
    without it."""
    import zipfile

    from compiledump.aot import program

    def archive(name, metadata):
        path = tmp_path / name
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("model/data/aotinductor/model/wrapper_metadata.json", json.dumps(metadata))
            zf.writestr("model/data/aotinductor/model/wrapper.so", b"\x7fELF" + bytes(range(37)))
        return path

    class Loaded(Exception):
        pass

    def loader(path):
        raise Loaded(path)

    monkeypatch.setattr(torch._inductor, "aoti_load_package", loader)
    monkeypatch.setattr(program, "_warned_cuda_proxy", False)
    monkeypatch.setattr(native, "native_available", lambda: True)  # the shim package's check
    compiledump.configure(dir=str(tmp_path / "dump"))
    quiet = [archive("cpu.pt2", {"AOTI_DEVICE_KEY": "cpu"}),
             archive("shims.pt2", {"AOTI_DEVICE_KEY": "cuda", program.SHIMS_KEY: "1"})]
    for path in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(Loaded):
                aot.load(path)
    cuda = archive("cuda.pt2", {"AOTI_DEVICE_KEY": "cuda", "other": "7"})
    with pytest.warns(RuntimeWarning, match=r"proxy executor.*SIGSEGV.*torch.compile and CUDA graphs"):
        with pytest.raises(Loaded):
            aot.load(cuda)
    with warnings.catch_warnings():  # once per process
        warnings.simplefilter("error")
        with pytest.raises(Loaded):
            aot.load(cuda)
    assert program._uses_shims(program._archive_metadata(quiet[1]))
    assert not program._uses_shims(program._archive_metadata(cuda))


def test_aoti_corner_cases(tmp_path):
    """Exported alone (no prefill first), these once reached AOTInductor with an empty int list,
    which its proxy executor passes to the op as None."""
    settings = dict(tokens=5, max_tags=4, arena_mb=1, max_steps=8, layer_steps=2)
    inputs = [torch.randn(n, 3) * 4 for n in (5, 4, 5, 6)]

    def run(forward, directory):
        for x in inputs:
            forward(x)
        return compiledump.flush()

    compiledump.reset()
    previous = compiledump.get_config()
    try:
        compiledump.configure(dir=str(tmp_path / "eager"), **settings)
        with pytest.warns(RuntimeWarning):
            eager = run(_Corners(), tmp_path / "eager")
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path / "aoti"), **settings)
        rows = torch.export.Dim("rows", min=2, max=64)
        ep = aot.export(_Corners(), (torch.randn(4, 3),), dynamic_shapes=({0: rows},))
        # The token dim of gated kinds is sized by COMPILEDUMP_TOKENS, whatever was traced.
        assert STATE.runtime.slots[("ids", False)].source_shape == [5, 3]
        assert STATE.runtime.slots[("scalar", True)].source_shape == []
        path = aot.package(ep, tmp_path / "corners.pt2")
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path / "aoti"))
        program = aot.load(path)
        with pytest.warns(RuntimeWarning):
            exported = run(program, tmp_path / "aoti")
        assert_same_dump(eager, exported)
        manifest = _manifest(exported)
        assert manifest["keys"]["scalar_0"]["shape"] == [] and manifest["tags"]["hidden"]["drops"] == {"token_gate": 2}
        assert manifest["drops"]["tag_table_full"] == 4 and manifest["tags"]["layer0_step_<n>"]["drops"] == {"layer_steps": 2}
        # The crash-proof files of a process that loaded the package: the registry the plan restored
        # was never journaled, so recover after a crash found no tag (a review). A copy of them,
        # recovered as a dead process's, gives the dump the flush wrote.
        dead = tmp_path / "dead"
        shutil.copytree(STATE.runtime.live.path, dead / STATE.runtime.live.path.name)
        recovered = recover_live(dead / STATE.runtime.live.path.name, force=True)
        assert sorted(_manifest(str(recovered.npz))["keys"]) == sorted(manifest["keys"])
    finally:
        compiledump.reset()
        compiledump.configure(**dataclasses.asdict(previous))  # not tokens=0: later tests in this process


def test_a_plan_keeps_both_kinds_of_a_name_past_the_table(tmp_path):
    """record(once=True) and record_step of one name, both past max_tags: the plan gave one kind
    for both (keyed by tag), so the loaded registry lost the record's entry (a review)."""
    previous = compiledump.get_config()
    compiledump.reset()
    try:
        compiledump.configure(dir=str(tmp_path), max_tags=1)
        x = torch.randn(2, 3)
        compiledump.record("first", x)
        compiledump.record("logits", x, once=True)
        compiledump.record_step("logits", x)
        text = aot.plan_text(STATE.runtime)
        assert [line for line in text.splitlines() if line.startswith("overflow")] == [
            "overflow logits 1", "overflow logits 2"]
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path), max_tags=1)
        compiledump.init("cpu")
        aot.restore_plan(text, STATE.runtime)
        assert {(slot.tag, slot.kind) for slot in STATE.runtime.slots.values() if slot.index == 0} == {
            ("logits", 1), ("logits", 2)}
        assert aot.plan_text(STATE.runtime) == text
    finally:
        compiledump.reset()
        compiledump.configure(**dataclasses.asdict(previous))
