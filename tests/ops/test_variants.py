"""The Triton kernel's compiled variants: what a CUDA graph capture may launch.

CUDA refuses to compile or load a kernel while a stream is being captured. Triton compiles one
kernel per distinct specialization of its arguments, so the flows below (the README's engine
flow, the demo's `--device cuda` flow and examples/cuda_graph_runner.py) are replayed on CPU
with a stand-in for `torch.cuda`'s streams and graphs, and every launch is keyed by Triton's own
binder (the function Triton runs on each launch to choose the compiled kernel). A capture must
only need keys that launches outside the capture already created, and the host-side guard
(ops/variants.py) must agree.

Every layout class against the reference kernel, and the sm_90 compile:
tests/ops/test_triton_layout_classes.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from compiledump.ops import layout as L
from compiledump.ops import variants

from helpers.triton_stand_in import stand_in_jit

K = pytest.importorskip("compiledump.ops.triton_kernel")
ROOT = Path(__file__).resolve().parents[2]


class FakeCuda:
    """`torch.cuda`'s streams and graphs for a CPU run: a graph capture only sets `capturing`."""

    capturing = False
    replays = 0

    class Stream:
        def wait_stream(self, other):
            return None

    @staticmethod
    @contextlib.contextmanager
    def stream(_stream):
        yield

    @staticmethod
    def current_stream():
        return FakeCuda.Stream()

    class CUDAGraph:
        def replay(self):
            FakeCuda.replays += 1  # a replay re-issues recorded launches: it compiles nothing

    @staticmethod
    @contextlib.contextmanager
    def graph(_graph):
        FakeCuda.capturing = True
        try:
            yield
        finally:
            FakeCuda.capturing = False


@pytest.fixture
def simulated_cuda(monkeypatch, dump_dir):
    monkeypatch.setenv("COMPILEDUMP_CPU_KERNEL", "triton")
    for name in ("Stream", "stream", "current_stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(FakeCuda, name))
    monkeypatch.setattr(variants, "stream_capturing", lambda device: FakeCuda.capturing)
    with stand_in_jit(monkeypatch, capturing=lambda: FakeCuda.capturing) as keys:
        FakeCuda.capturing, FakeCuda.replays = False, 0
        compiledump.reset()
        torch._dynamo.reset()
        yield keys
    compiledump.reset()


def _assert_capture_compiles_nothing(keys):
    assert keys.during, "the flow captured nothing"
    assert keys.direct, "no launch went straight to its compiled kernel"
    assert not keys.first_needed_during, f"variants first needed during a capture: {keys.first_needed_during}"


class EngineModel(torch.nn.Module):
    """The capture calls of the README engine flow: hc mean, 2-D record, keep-first, step, ids."""

    def __init__(self, dtype, dim=40):
        super().__init__()
        self.proj = torch.nn.Linear(dim, 4 * dim).to(dtype)
        self.head = torch.nn.Linear(dim, 96).to(dtype)
        self.dim = dim

    def forward(self, h):
        streams = self.proj(h).view(h.shape[0], 4, self.dim)  # [tokens, hc_mult, dim]
        compiledump.record("layer0", streams)
        compiledump.record("layer0_out", streams.mean(1))
        compiledump.record("embed", h, once=True)
        logits = self.head(streams.sum(1))
        compiledump.record_ids("layer0_topk", logits.topk(2, -1).indices)
        compiledump.record_step("logits", logits.float())
        for extra in range(3):  # past max_tags: the host decides tag_table_full
            compiledump.record(f"extra{extra}", logits)
        return logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_flow_capture_needs_no_new_variant(simulated_cuda, dtype):
    """vLLM order: profile run and warm-up under profiling() (suspended, no region yet), then the
    capture claims regions (reason 0, real offsets), replays, then a real prefill (token gate)."""
    compiledump.configure(tokens=7, max_tags=5)
    compiledump.init(torch.device("cpu"))
    torch.manual_seed(0)
    model = EngineModel(dtype)
    with torch.no_grad():
        with compiledump.profiling():
            model(torch.randn(16, 40, dtype=dtype))  # profile run: max tokens
        static = torch.randn(4, 40, dtype=dtype)
        with torch.cuda.stream(torch.cuda.Stream()), compiledump.profiling():
            for _ in range(2):
                model(static)
        graph = torch.cuda.CUDAGraph()
        with compiledump.profiling(), torch.cuda.graph(graph):
            model(static)
        for _ in range(3):
            compiledump.set_rows(1)
            graph.replay()
        model(torch.randn(7, 40, dtype=dtype))  # prefill: 7 tokens pass the gate
    _assert_capture_compiles_nothing(simulated_cuda)
    manifest_path = compiledump.flush()
    assert manifest_path is not None


def test_cuda_graph_runner_example_needs_no_new_variant(simulated_cuda):
    spec = importlib.util.spec_from_file_location("runner", ROOT / "examples" / "cuda_graph_runner.py")
    runner_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner_module)
    compiledump.init(torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.compile(runner_module.TinyDecoder(), fullgraph=True)
    with torch.no_grad():
        runner = runner_module.DecodeRunner(model, 4, 32, torch.device("cpu"))
        runner._capture()  # what the runner does on a CUDA device
        for _ in range(3):
            runner.step(torch.randint(0, 64, (4,)), torch.zeros(4, 32), real_rows=1)
    assert FakeCuda.replays == 3
    _assert_capture_compiles_nothing(simulated_cuda)


def test_demo_cuda_graph_flow_needs_no_new_variant(simulated_cuda):
    """The demo's `--device cuda` engine: bf16, compiled, decode step in a CUDA graph."""
    from compiledump.demo.model import (
        ModelConfig,
        TinyMoE,
        make_session,
        run_session_cuda_graph,
    )
    from compiledump.demo.run import engine_forward

    compiledump.configure(tokens=7)
    compiledump.init(torch.device("cpu"))
    cfg = ModelConfig(layers=1, captures_per_layer=3)  # every kind of capture; compiles in seconds
    session = make_session(cfg, prompt_len=7, steps=3, pad_rows=3)
    engine = TinyMoE(cfg, dump=compiledump).to(torch.bfloat16)
    run_session_cuda_graph(engine_forward(engine), compiledump, session)
    assert FakeCuda.replays >= 3
    _assert_capture_compiles_nothing(simulated_cuda)


def test_capture_of_an_unprepared_variant_fails_on_the_host(simulated_cuda):
    compiledump.init(torch.device("cpu"))
    ctrl_before = compiledump.capture.state.STATE.runtime.ctrl.clone()
    with pytest.raises(compiledump.VariantNotPrepared, match="outside the graph first"):
        with compiledump.profiling(), torch.cuda.graph(torch.cuda.CUDAGraph()):
            compiledump.record("h", torch.randn(3, 4, 16, dtype=torch.float16))
    assert torch.equal(compiledump.capture.state.STATE.runtime.ctrl, ctrl_before)  # nothing launched
    assert not simulated_cuda.during
    # prepare_kernels() outside the capture makes the same capture work.
    compiledump.prepare_kernels(torch.device("cpu"), [torch.float16])
    with compiledump.profiling(), torch.cuda.graph(torch.cuda.CUDAGraph()):
        compiledump.record("h", torch.randn(3, 4, 16, dtype=torch.float16))
    _assert_capture_compiles_nothing(simulated_cuda)


def test_a_kernel_triton_cannot_compile_is_one_clear_error(simulated_cuda):
    """A Triton failure while preparing a variant (the first H200 run met one, SystemError from its
    LLVM lowering) reaches the caller as KernelUnavailable naming the variant and what to try, with
    the cause chained; the variant is not marked prepared, so a later call tries again."""
    dtype = torch.float16

    def failing(device, variant):
        raise SystemError("<built-in method run> returned NULL without setting an exception")

    variant = variants.Variant(dtype, True, False, variants.vector_width(dtype), True)
    with pytest.raises(compiledump.KernelUnavailable, match=r"float16 \(hc mean, vector width 8, aligned\).*"
                       r"SystemError.*TRITON_CACHE_DIR.*COMPILEDUMP_CUDA_KERNEL=native") as caught:
        variants.ensure_prepared(torch.device("cpu"), variant, failing)
    assert isinstance(caught.value.__cause__, SystemError)
    assert all(v.dtype != dtype for _, v in variants.prepared())
    launched = []
    variants.ensure_prepared(torch.device("cpu"), variant, lambda device, v: launched.append(v))
    assert set(launched) == set(variant.siblings()) and (torch.device("cpu"), variant) in variants.prepared()


@pytest.mark.parametrize("switch, field, constexpr", [("COMMIT_RELEASE", "release", "RELEASE"),
                                                     ("PAYLOAD_FIRST", "payload_first", "PAYLOAD_FIRST")])
def test_a_benchmark_switch_is_a_variant_of_its_own_prepared_before_the_capture(simulated_cuda, monkeypatch, switch,
                                                                                field, constexpr):
    """gpu_bench's graphs with relaxed commits or the payload loaded after the claim (the switch
    off in ops/variants.py while it is warmed up and captured): their launches are another
    compiled variant, prepared by the warm-up like any other, that stores and counts what the
    default variant does."""
    compiledump.configure(tokens=0)
    compiledump.init(torch.device("cpu"))
    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    geometry = (5, 4, 64, 256, 64, 1, L.REG_RECORD_ROW, True)
    assert getattr(variants.variant_for(x, geometry, L.KIND_RECORD), field)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(variants, switch, on)
        assert getattr(variants.variant_for(x, geometry, L.KIND_RECORD), field) == on
        assert variants.variant_for(x, geometry, L.KIND_RECORD, host_arena=True).release  # always
        compiledump.clear()
        with torch.cuda.stream(torch.cuda.Stream()), compiledump.profiling():
            compiledump.record("h", x)  # the warm-up
        with compiledump.profiling(), torch.cuda.graph(torch.cuda.CUDAGraph()):
            compiledump.record("h", x)
        compiledump.record("h", x)  # what a replay would store (the stand-in graph replays nothing)
        with np.load(compiledump.flush()) as data:
            results[on] = data["h"]
    _assert_capture_compiles_nothing(simulated_cuda)
    # The captures launched two compiled kernels, one with the switch's constexpr on, one off.
    names = [name for name in K.capture_kernel.arg_names if name in K.constexprs(variants.variant_for(
        x, geometry, L.KIND_RECORD))]
    launched = {re.findall(r"\('constexpr', (\w+)\)", key)[names.index(constexpr)] for key in simulated_cuda.during}
    assert launched == {"True", "False"}
    want = x[-1].float().mean(0).numpy()
    np.testing.assert_array_equal(results[True], results[False])
    np.testing.assert_allclose(results[False], want, rtol=1e-6)


def test_variant_choice():
    aligned = torch.randn(5, 4, 64).to(torch.bfloat16)
    geo = (5, 4, 64, 256, 64, 1, L.REG_RECORD_ROW, True)
    assert variants.variant_for(aligned, geo, L.KIND_RECORD).vec == 8
    unaligned = torch.randn(5 * 4 * 64 + 1).to(torch.bfloat16)[1:]
    slow = variants.Variant(torch.bfloat16, True, False, 1, False)
    assert variants.variant_for(unaligned, geo, L.KIND_RECORD) == slow
    assert variants.variant_for(aligned, (5, 4, 63, 252, 63, 1, L.REG_RECORD_ROW, True), L.KIND_RECORD).vec == 1
    whole, claim, copy = L.LAUNCH_WHOLE, L.LAUNCH_CLAIM, L.LAUNCH_COPY
    assert variants.launches_for((3, 4, 4100, 0, 0, 1, L.REG_RECORD_ROW, True), L.KIND_RECORD) == ((whole, 3),)
    assert variants.launches_for((9, 4, 2100, 0, 0, 1, L.ROW_ALL, True), L.KIND_RECORD_ROWS) == ((whole, 18),)
    # Steps and keep-first records: one program claims; a wide row (5 tiles or more) is copied by a
    # second launch over every tile. A 129280-wide logits row: 64 programs.
    assert variants.launches_for((3, 1, 4500, 0, 0, 1, L.REG_STEP_ROW, False), L.KIND_STEP) == ((whole, 1),)
    assert variants.launches_for((3, 1, 8192, 0, 0, 1, L.REG_STEP_ROW, False), L.KIND_STEP) == ((whole, 1),)
    assert variants.launches_for((3, 1, 8193, 0, 0, 1, L.REG_STEP_ROW, False), L.KIND_STEP) == ((claim, 1), (copy, 5))
    assert variants.launches_for((64, 1, 129280, 0, 0, 1, L.REG_STEP_ROW, False), L.KIND_STEP) == (
        (claim, 1), (copy, 64))
    assert variants.launches_for((3, 4, 10000, 0, 0, 1, L.REG_RECORD_ROW, True), L.KIND_RECORD_ONCE) == (
        (claim, 1), (copy, 5))
    # Into a host-mapped arena: one program, whatever the width.
    assert variants.launches_for((64, 1, 129280, 0, 0, 1, L.REG_STEP_ROW, False), L.KIND_STEP, True) == ((whole, 1),)
    assert variants.launches_for((3, 4, 4100, 0, 0, 1, L.REG_RECORD_ROW, True), L.KIND_RECORD, True) == ((whole, 1),)


def test_amd_fp8_is_refused_on_cuda_before_triton_compiles():
    """Triton has no NVIDIA type for the fnuz fp8 formats: a clear error instead of a compile error."""

    def launched(*_):
        raise AssertionError("nothing may be launched")

    variant = variants.Variant(torch.float8_e4m3fnuz, True, False, 1, True)
    with pytest.raises(TypeError, match="cannot be captured on CUDA"):
        variants.ensure_prepared(torch.device("cuda", 0), variant, launched)
