"""GPU check of the capture runtime: CUDA graphs, reduce-overhead, no syncs, same dump as eager.

Run on a machine with a GPU:

    python scripts/gpu_check.py --out gpu_check.json

Phases (each writes its own dump and is compared with the eager one):
  eager          the built-in model, eager, the engine-like session (reference);
  cuda_graph     decode step captured once with torch.cuda.graph (warm-up and capture under
                 profiling(), as engines capture with dummy data) and replayed for every step;
  reduce_overhead torch.compile(mode="reduce-overhead", fullgraph=True): Inductor's CUDA graph
                 trees; the run must report zero cudagraph skips;
  aoti           prefill and decode exported with compiledump.aot (dynamic prompt length and
                 batch), packaged with AOTInductor and run from Python (tests/export/test_aot.py covers
                 the CPU run and the C++-only driver);
  native_cuda_kernel  if the native library was built against this CUDA torch (CMakeLists.txt),
                 its CUDA capture kernel against the Triton kernel on random samples;
and the decode loops of cuda_graph, reduce_overhead and aoti run under
torch.cuda.set_sync_debug_mode("error"). `--device cpu` runs the phases that need no GPU (eager
and a default-mode compile), so the script itself is tested without one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import compiledump
from compiledump.demo.model import (ModelConfig, TinyMoE, export_session, make_session, run_session,
                               run_session_cuda_graph, session_forward)

PROMPT = 7


def _fresh_dump(directory: Path) -> None:
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(directory), tokens=PROMPT)


def _load(path: str) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def compare_dumps(reference: dict, other: dict, rtol: float) -> dict:
    """Key set equality and the worst relative error over float keys (ids must be equal)."""
    worst = 0.0
    mismatched = []
    for key, want in reference.items():
        have = other.get(key)
        if have is None or have.shape != want.shape or have.dtype != want.dtype:
            mismatched.append(key)
            continue
        if want.dtype.kind == "f":
            scale = max(float(np.abs(want).max()), 1e-30)
            worst = max(worst, float(np.abs(have.astype(np.float64) - want).max() / scale))
        elif not np.array_equal(have, want):
            mismatched.append(key)
    missing = sorted(set(other) ^ set(reference))
    ok = not mismatched and not missing and worst <= rtol
    return {"ok": ok, "keys": len(reference), "max_rel_err": worst, "mismatched": mismatched, "missing": missing}


def phase_eager(cfg, session, device, out_dir):
    _fresh_dump(out_dir / "eager")
    model = TinyMoE(cfg, dump=compiledump).to(device)
    start = time.perf_counter()
    run_session(model, compiledump, session)
    return compiledump.flush(), {"seconds": time.perf_counter() - start}


def phase_compiled(cfg, session, device, out_dir, mode):
    from torch._dynamo.utils import counters

    _fresh_dump(out_dir / f"compiled_{mode}")
    model = TinyMoE(cfg, dump=compiledump).to(device)
    compiled = torch.compile(model, fullgraph=True, mode=None if mode == "default" else mode)

    def forward(*args):
        # CUDA graph trees reuse output memory on the next replay: keep our own copies.
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in compiled(*args))

    counters.clear()
    start = time.perf_counter()
    sync_debug = device.type == "cuda"
    run_session(forward, compiledump, session, on_step=_sync_debug_after_first if sync_debug else None)
    if sync_debug:
        torch.cuda.set_sync_debug_mode(0)
    info = {
        "seconds": time.perf_counter() - start,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }
    return compiledump.flush(), info


def _sync_debug_after_first(step):
    # The first decode steps compile and record graphs (allowed to sync); from then on, none.
    if step == 2:
        torch.cuda.set_sync_debug_mode("error")


def phase_cuda_graph(cfg, session, device, out_dir):
    _fresh_dump(out_dir / "cuda_graph")
    model = TinyMoE(cfg, dump=compiledump).to(device)
    start = time.perf_counter()
    run_session_cuda_graph(model, compiledump, session, on_step=_sync_debug_after_first)
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return compiledump.flush(), {"seconds": time.perf_counter() - start, "replays": session.decode_tokens.shape[0] + 1}


def phase_aoti(cfg, session, device, out_dir):
    from compiledump import aot
    from compiledump.ops import native, schemas

    _fresh_dump(out_dir / "aoti_export")
    start = time.perf_counter()
    prefill, decode = export_session(TinyMoE(cfg, dump=compiledump).to(device), session)
    paths = aot.package(prefill, out_dir / "prefill.pt2"), aot.package(decode, out_dir / "decode.pt2")
    compile_seconds = time.perf_counter() - start
    _fresh_dump(out_dir / "aoti")
    forward = session_forward(*(aot.load(path) for path in paths))
    start = time.perf_counter()
    on_cuda = device.type == "cuda"
    run_session(forward, compiledump, session, on_step=_sync_debug_after_first if on_cuda else None)
    if on_cuda:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return compiledump.flush(), {"seconds": time.perf_counter() - start, "compile_seconds": compile_seconds,
                                 "capture_export_owner": native.kernel_owner(schemas.EXPORT, device.type.upper())}


def check_native_cuda_kernel(device) -> dict:
    """The native CUDA kernel (kernels/capture_cuda.cu) against the Triton kernel."""
    from compiledump.ops import layout as L
    from compiledump.ops import native, register, schemas

    if native.kernel_owner(schemas.KERNEL, "CUDA") != "native":
        return {"ok": None, "skipped": "the native library is not loaded or was built without CUDA"}
    g = torch.Generator(device=device).manual_seed(0)
    samples = {
        "record_3d_bf16": (torch.randn(7, 4, 1031, generator=g, device=device).bfloat16(), L.KIND_RECORD),
        "record_noncontig": (torch.randn(7, 33, 4, generator=g, device=device).transpose(1, 2), L.KIND_RECORD),
        "once_2d_fp16": (torch.randn(5, 700, generator=g, device=device).half(), L.KIND_RECORD_ONCE),
        "step_2d": (torch.randn(4, 32000, generator=g, device=device), L.KIND_STEP),
        "ids": (torch.randint(-5, 1000, (7, 8), generator=g, device=device), L.KIND_IDS),
    }
    mismatched = []
    for name, (x, kind) in samples.items():
        results = []
        for launch in (register.capture_triton, register.capture_native):  # capture_native: the dispatcher's kernel
            arena = torch.full((70000,), float("nan"), device=device)
            ctrl = torch.zeros(L.control_words(4), dtype=torch.int32, device=device)
            ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, 1, -1
            for _ in range(3):
                launch(x, arena, ctrl, kind, L.slot_base(2), 16, 2, 0)
            results.append((arena.cpu(), ctrl.cpu()))
        (a1, c1), (a2, c2) = results
        if not (torch.equal(c1, c2) and torch.equal(a1.view(torch.int32), a2.view(torch.int32))):
            mismatched.append(name)
    return {"ok": not mismatched, "keys": len(samples), "mismatched": mismatched}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", default="gpu_check.json", help="full results (JSON)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig(layers=args.layers, captures_per_layer=4)
    session = make_session(cfg, prompt_len=PROMPT, steps=args.steps).to(device)
    results = {"device": str(device), "torch": torch.__version__, "phases": {}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.set_device(device)

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        reference_path, info = phase_eager(cfg, session, device, out_dir)
        reference = _load(reference_path)
        results["phases"]["eager"] = {**info, "ok": True, "keys": len(reference)}
        phases = [("compiled_default", lambda: phase_compiled(cfg, session, device, out_dir, "default"), 1e-4)]
        if device.type == "cuda":
            phases += [
                ("cuda_graph", lambda: phase_cuda_graph(cfg, session, device, out_dir), 1e-6),
                ("reduce_overhead", lambda: phase_compiled(cfg, session, device, out_dir, "reduce-overhead"), 1e-4),
                ("aoti", lambda: phase_aoti(cfg, session, device, out_dir), 1e-4),
            ]
        else:
            for name in ("cuda_graph", "reduce_overhead", "aoti", "native_cuda_kernel"):
                results["phases"][name] = {"ok": None, "skipped": "needs a CUDA device"}
        for name, run, rtol in phases:
            try:
                path, info = run()
                verdict = compare_dumps(reference, _load(path), rtol)
                if info.get("cudagraph_skips"):
                    verdict["ok"] = False
                results["phases"][name] = {**info, **verdict, "rtol": rtol}
            except Exception as error:  # noqa: BLE001 - report every phase, then fail
                torch.cuda.set_sync_debug_mode(0) if device.type == "cuda" else None
                results["phases"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        if device.type == "cuda":
            try:
                results["phases"]["native_cuda_kernel"] = check_native_cuda_kernel(device)
            except Exception as error:  # noqa: BLE001
                results["phases"]["native_cuda_kernel"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}

    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"{'phase':<18}{'ok':<6}{'keys':>6}{'max_rel_err':>13}{'graphs':>8}{'cg_skips':>10}{'seconds':>9}  note")
    for name, r in results["phases"].items():
        print(
            f"{name:<18}{str(r.get('ok')):<6}{r.get('keys', ''):>6}"
            f"{r.get('max_rel_err', float('nan')):>13.2e}{r.get('unique_graphs', ''):>8}"
            f"{r.get('cudagraph_skips', ''):>10}{r.get('seconds', float('nan')):>9.3f}  "
            f"{r.get('error', r.get('skipped', ''))}"
        )
    failed = [n for n, r in results["phases"].items() if r.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "all phases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
