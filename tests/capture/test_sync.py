"""Acceptance 4: no host sync inside any capture call.

The detector watches every aten op dispatched inside compiledump's ops (it re-enters itself
for them) and the Python-level ways to read device memory on the host. The Triton launch is the
device work itself (an asynchronous launch on a GPU), so it is exempt: the interpreter that runs
it on CPU reads memory on the host by design.
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compiledump
from compiledump.ops import native, reference, register
from compiledump.demo.model import ModelConfig, TinyMoE, make_session, run_session
from compiledump.ops.triton_kernel import launch

from helpers.seed import load_seed

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.equal, aten.allclose}


class SyncDetector(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits = []
        self.inside_capture = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if func.overloadpacket in SYNC_OPS:
                self.hits.append(str(func))
            if func in (aten._to_copy.default, aten.copy_.default):
                devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
                if "device" in kwargs and kwargs["device"] is not None:
                    devices.add(torch.device(kwargs["device"]))
                if len(devices) > 1:
                    self.hits.append(f"{func} across {devices}")
        if func.namespace == "compiledump":
            self.inside_capture += 1
            try:
                # Run our op's backend kernel with this mode still active, so the aten ops it
                # dispatches are seen too (a plain `func(...)` would hide them).
                keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                with self:
                    return func.redispatch(keys, *args, **kwargs)
            finally:
                self.inside_capture -= 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def detect_syncs(monkeypatch):
    detector = SyncDetector()

    def flag(name, original):
        def wrapper(*args, **kwargs):
            if not detector.paused:
                detector.hits.append(name)
            return original(*args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, flag(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", flag("cuda.synchronize", torch.cuda.synchronize))

    def exempt_launch(*args):
        detector.paused = True
        try:
            launch(*args)
        finally:
            detector.paused = False

    monkeypatch.setattr(register, "_triton_launch", exempt_launch)
    with detector:
        yield detector
    monkeypatch.undo()


CFG = ModelConfig(layers=4)


def test_no_host_sync_in_capture_calls(dump_dir, monkeypatch):
    monkeypatch.setenv("COMPILEDUMP_CPU_KERNEL", "triton")  # the path CUDA tensors take
    compiledump.configure(tokens=7)
    model = TinyMoE(CFG, dump=compiledump)
    session = make_session(CFG, prompt_len=7, steps=3)
    with detect_syncs(monkeypatch) as detector:
        run_session(model, compiledump, session)
    assert detector.inside_capture == 0
    assert detector.hits == []
    assert compiledump.flush() is not None


def test_compiled_graph_has_no_host_sync(dump_dir):
    """A dispatch mode cannot run under torch.compile; check the generated code instead: the
    compiled graph calls the same op implementation the eager test watched, and nothing else
    of ours."""
    from torch._inductor.utils import run_and_get_code

    model = torch.compile(TinyMoE(CFG, dump=compiledump), fullgraph=True)
    state = torch.randn(CFG.layers, 4, CFG.dim)
    with torch.no_grad():
        _, codes = run_and_get_code(model, torch.randint(0, CFG.vocab, (4,)), state)
    code = "\n".join(codes)
    assert "compiledump.capture_v1" in code
    for sync in ("_local_scalar_dense", ".item()", ".cpu()", ".tolist()", "synchronize"):
        assert sync not in code


def test_detector_catches_the_seed(dump_dir, monkeypatch, tmp_path):
    """Negative control: the seed copies to the host inside the forward, and is caught."""
    seed = load_seed(tmp_path / "seed")
    model = TinyMoE(CFG, dump=seed)
    with detect_syncs(monkeypatch) as detector:
        with torch.no_grad():
            model(torch.randint(0, CFG.vocab, (5,)))
    assert any("cpu" in hit for hit in detector.hits)
    seed._CAPTURED.clear()


def test_detector_sees_inside_compiledump_ops(dump_dir, monkeypatch):
    """Negative control: a sync inside the capture op's implementation would be caught."""
    monkeypatch.setattr(native, "_loaded", None)  # the Python reference kernel is the one patched
    original = reference.capture_reference

    def syncing_kernel(x, arena, ctrl, *rest):
        ctrl[0].item()
        return original(x, arena, ctrl, *rest)

    monkeypatch.setattr(register, "capture_reference", syncing_kernel)
    with detect_syncs(monkeypatch) as detector:
        compiledump.record("t", torch.randn(3, 4))
    assert "Tensor.item" in detector.hits
