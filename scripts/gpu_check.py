"""GPU check of the capture runtime: CUDA graphs, reduce-overhead, no syncs, same dump as eager.

Run on a machine with a GPU (scripts/gpu_run.sh runs it with the benchmark, under time limits):

    python scripts/gpu_check.py --device cuda --out gpu_check.json
    python scripts/gpu_check.py --device cuda --dry-run      # the plan only; CUDA is not initialized

Phases, in run order (each writes its own dump and is compared with the eager one):
  eager          the built-in model, eager, the engine-like session (reference);
  triton_launch  the Triton kernel launched as captures launch it (straight into its compiled
                 kernel) against Triton's JIT launch and the CPU reference kernel, on random
                 samples of every layout class (the eager phase, the others' reference, launches
                 the same way);
  cuda_graph     decode step captured once with torch.cuda.graph (warm-up and capture under
                 profiling(), as engines capture with dummy data) and replayed for every step;
  native_cuda_kernel  if the native library was built against this CUDA torch (CMakeLists.txt),
                 its CUDA capture kernel against the Triton kernel on random samples;
  reduce_overhead torch.compile(mode="reduce-overhead", fullgraph=True): Inductor's CUDA graph
                 trees; the run must report zero cudagraph skips;
  persist        crash-proof capture on CUDA (COMPILEDUMP_PERSIST=1: a host-mapped arena, its
                 files on tmpfs where there is one): a child process replays the CUDA-graph decode
                 step, then a device-side assert kills its context after PERSIST_STEPS steps;
                 `compiledump recover` must give back every step before it, equal to the eager
                 reference (docs/crashes.md);
  compiled_default torch.compile(fullgraph=True), default mode;
  aoti           prefill and decode exported with compiledump.aot (dynamic prompt length and
                 batch), packaged with AOTInductor and run from Python (tests/export/test_aot.py covers
                 the CPU run and the C++-only driver); last, since loading its CUDA package killed
                 the process on torch 2.11 (docs/export.md);
and the decode loops of cuda_graph, reduce_overhead and aoti run under
torch.cuda.set_sync_debug_mode("error"). `--device cpu` runs the phases that need no GPU (eager
and a default-mode compile), so the script itself is tested without one. A failing phase is
recorded (error, the traceback's last line) and the next one runs; the JSON is rewritten after
every phase; one summary table (phase | status | key number) ends the output. Exit status: 0,
1 if a phase failed, 2 for bad options or a CUDA device asked for where there is none.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for _path in (str(Path(__file__).resolve().parent), str(REPO)):  # gpu_common; compiledump uninstalled
    if _path not in sys.path:
        sys.path.insert(0, _path)

import compiledump  # noqa: E402
import gpu_common  # noqa: E402
from compiledump.demo.model import (ModelConfig, TinyMoE, export_session, make_session, run_session,  # noqa: E402
                                    run_session_cuda_graph, session_forward)

PROMPT = 7


def _fresh_dump(directory: Path, device: torch.device) -> None:
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(directory), tokens=PROMPT)
    compiledump.init(device)
    gpu_common.poison_arena()  # a fresh arena may reuse the last phase's memory


_load = gpu_common.load_npz
compare_dumps = gpu_common.compare_dumps


def phase_eager(cfg, session, device, out_dir):
    _fresh_dump(out_dir / "eager", device)
    model = TinyMoE(cfg, dump=compiledump).to(device)
    start = time.perf_counter()
    run_session(model, compiledump, session, device=device)
    return compiledump.flush(), {"seconds": time.perf_counter() - start}


def phase_compiled(cfg, session, device, out_dir, mode):
    from torch._dynamo.utils import counters

    _fresh_dump(out_dir / f"compiled_{mode}", device)
    model = TinyMoE(cfg, dump=compiledump).to(device)
    compiled = torch.compile(model, fullgraph=True, mode=None if mode == "default" else mode)

    def forward(*args):
        # CUDA graph trees reuse output memory on the next replay: keep our own copies.
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in compiled(*args))

    counters.clear()
    start = time.perf_counter()
    sync_debug = device.type == "cuda"
    run_session(forward, compiledump, session, device=device,
                on_step=_sync_debug_after_first if sync_debug else None)
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
    _fresh_dump(out_dir / "cuda_graph", device)
    model = TinyMoE(cfg, dump=compiledump).to(device)
    start = time.perf_counter()
    run_session_cuda_graph(model, compiledump, session, on_step=_sync_debug_after_first)
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return compiledump.flush(), {"seconds": time.perf_counter() - start, "replays": session.decode_tokens.shape[0] + 1}


def phase_aoti(cfg, session, device, out_dir):
    from compiledump import aot
    from compiledump.ops import native, schemas

    _fresh_dump(out_dir / "aoti_export", device)
    start = time.perf_counter()
    prefill, decode = export_session(TinyMoE(cfg, dump=compiledump).to(device), session)
    paths = aot.package(prefill, out_dir / "prefill.pt2"), aot.package(decode, out_dir / "decode.pt2")
    compile_seconds = time.perf_counter() - start
    _fresh_dump(out_dir / "aoti", device)
    forward = session_forward(*(aot.load(path) for path in paths))
    start = time.perf_counter()
    on_cuda = device.type == "cuda"
    run_session(forward, compiledump, session, device=device,
                on_step=_sync_debug_after_first if on_cuda else None)
    if on_cuda:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return compiledump.flush(), {"seconds": time.perf_counter() - start, "compile_seconds": compile_seconds,
                                 "capture_export_owner": native.kernel_owner(schemas.EXPORT, device.type.upper())}


def kernel_samples(device) -> list:
    """(name, input, kind, REG_CHECK_ALL) of the kernel checks: every layout class and kind, on
    both sides of the split rule and of the fast path, with NaN/Inf over many programs."""
    from compiledump.ops import layout as L

    g = torch.Generator(device=device).manual_seed(0)
    samples = {
        "record_3d_bf16": (torch.randn(7, 4, 1031, generator=g, device=device).bfloat16(), L.KIND_RECORD),
        "record_noncontig": (torch.randn(7, 33, 4, generator=g, device=device).transpose(1, 2), L.KIND_RECORD),
        "once_2d_fp16": (torch.randn(5, 700, generator=g, device=device).half(), L.KIND_RECORD_ONCE),
        "step_2d": (torch.randn(4, 32000, generator=g, device=device), L.KIND_STEP),  # split, fast path
        # The fast path (16-byte loads): an hc mean, a step of hc rows, a split keep-first record.
        "record_3d_bf16_vector": (torch.randn(64, 4, 7168, generator=g, device=device).bfloat16(), L.KIND_RECORD),
        "step_3d_bf16_vector": (torch.randn(8, 4, 7168, generator=g, device=device).bfloat16(), L.KIND_STEP),
        "once_wide_fp16": (torch.randn(4, 20000, generator=g, device=device).half(), L.KIND_RECORD_ONCE),
        "ids": (torch.randint(-5, 1000, (7, 8), generator=g, device=device), L.KIND_IDS),
        # Wide rows with NaN/Inf on many blocks (programs): the counts and first bad call too.
        "rows_nonfinite": (torch.randn(3, 4, 2100, generator=g, device=device).log(), L.KIND_RECORD_ROWS),
    }
    return ([(name, x, kind, 0) for name, (x, kind) in samples.items()]
            + [("record_check_all", samples["rows_nonfinite"][0], L.KIND_RECORD, 1)])


def run_sample(launch, x, kind, check_all) -> tuple:
    """Three captures of `x` with `launch` (a kernel layer's signature) into a fresh arena and
    control block on x's device: their final state, on the CPU."""
    from compiledump.ops import layout as L

    arena = torch.full((70000,), float("nan"), device=x.device)
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32, device=x.device)
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, 1, -1
    ctrl[L.REG_CHECK_ALL] = check_all
    for _ in range(3):
        launch(x, arena, ctrl, kind, L.slot_base(2), 16, 2, 0)
    return arena.cpu(), ctrl.cpu()


def _same_words(first, second) -> bool:
    (a1, c1), (a2, c2) = first, second
    return torch.equal(c1, c2) and torch.equal(a1.view(torch.int32), a2.view(torch.int32))


def check_triton_launch(device) -> dict:
    """The Triton kernel as captures launch it, straight into its compiled kernel
    (ops/triton_kernel.py `DirectLaunch`), against the same kernel through Triton's JIT, word for word,
    and against the reference kernel on the CPU (ops/reference.py; SLOT_CLAIM aside, which only a
    split device capture writes). The eager phase is the other phases' reference and launches the
    same way, so this is what would show a direct launch that stores the wrong thing."""
    from compiledump.ops import layout as L
    from compiledump.ops import register
    from compiledump.ops import triton_kernel as K
    from compiledump.ops.geometry import geometry
    from compiledump.ops.reference import capture_reference

    samples = kernel_samples(device)
    direct_differs, reference_differs = [], []
    for name, x, kind, check_all in samples:
        direct = run_sample(register.capture_triton, x, kind, check_all)
        with K.through_the_jit():
            jit = run_sample(register.capture_triton, x, kind, check_all)
        reference = run_sample(capture_reference, x.cpu(), kind, check_all)
        if not _same_words(direct, jit):
            direct_differs.append(name)
        if not _same_words((direct[0], L.without_claims(direct[1])), reference):
            reference_differs.append(name)
    x = samples[0][1]
    _src, geo = geometry(x, L.KIND_RECORD)
    launches_directly = K.direct_launcher(x.device, K.variant_for(x, geo, L.KIND_RECORD)) is not None
    return {"ok": not direct_differs and not reference_differs, "keys": len(samples),
            "launches_directly": launches_directly, "mismatched": direct_differs,
            "reference_mismatched": reference_differs}


def check_native_cuda_kernel(device) -> dict:
    """The native CUDA kernel (kernels/capture_cuda.cu) against the Triton kernel."""
    from compiledump.ops import native, register, schemas

    if native.kernel_owner(schemas.KERNEL, "CUDA") != "native":
        raise gpu_common.SkipPhase("the native library is not loaded or was built without CUDA")
    samples = kernel_samples(device)
    mismatched = []
    for name, x, kind, check_all in samples:
        # Word for word, SLOT_CLAIM included: both kernels split wide steps alike (layout.splits).
        # capture_native: the dispatcher's kernel.
        if not _same_words(run_sample(register.capture_triton, x, kind, check_all),
                           run_sample(register.capture_native, x, kind, check_all)):
            mismatched.append(name)
    return {"ok": not mismatched, "keys": len(samples), "mismatched": mismatched}


PERSIST_STEPS = 5


def _persist_child(directory: str, device: torch.device, layers: int, steps: int) -> None:
    """The persist phase's child: CUDA-graph decode replays, then a device-side assert."""
    compiledump.configure(dir=directory, tokens=PROMPT)  # COMPILEDUMP_PERSIST=1 from the parent
    compiledump.init(device)
    cfg = ModelConfig(layers=layers, captures_per_layer=4)
    session = make_session(cfg, prompt_len=PROMPT, steps=steps).to(device)

    def on_step(step):
        if step == PERSIST_STEPS - 1:
            index = torch.tensor([1 << 20], device=device)
            torch.zeros(4, device=device)[index]  # out of bounds: a device-side assert
            torch.cuda.synchronize()  # raises: the context is dead, the exit flush will fail

    run_session_cuda_graph(TinyMoE(cfg, dump=compiledump).to(device), compiledump, session, on_step=on_step)


def phase_persist(args, device, out_dir, reference, timeout) -> dict:
    import shutil

    # On tmpfs where there is one: Linux 6.5 and later let the driver pin a file mapping long-term
    # only there (docs/crashes.md); elsewhere the child falls back to a device arena and the phase
    # fails, which the recorded filesystem and kernel then explain.
    shm = gpu_common.tmpfs_directory()
    directory = Path(tempfile.mkdtemp(prefix="compiledump-persist-", dir=shm)) if shm else out_dir / "persist"
    try:
        return _persist_in(directory, args, device, reference, timeout)
    finally:
        if shm:
            shutil.rmtree(directory, ignore_errors=True)


def _persist_in(directory: Path, args, device, reference, timeout) -> dict:
    import os
    import subprocess

    from compiledump.capture.recover import recover_directory

    env = {**os.environ, "COMPILEDUMP_PERSIST": "1", "COMPILEDUMP_SIGNALS": "0"}
    env.pop("COMPILEDUMP_DIR", None)
    child = subprocess.run([sys.executable, __file__, "--persist-child", str(directory), "--device", str(device),
                            "--layers", str(args.layers), "--steps", str(args.steps)],
                           env=env, capture_output=True, text=True, timeout=timeout)
    results, errors = recover_directory(directory)
    info = {"live_dir": str(directory), "live_dir_filesystem": gpu_common.filesystem_of(directory.parent),
            "child_exit": child.returncode, "child_stderr_tail": child.stderr[-600:], "errors": errors}
    if errors or len(results) != 1 or results[0].npz is None:
        return {**info, "ok": False, "keys": 0, "max_rel_err": float("nan"), "mismatched": [], "missing": ["*"]}
    got = _load(results[0].npz)
    steps = sorted(int(k.rsplit("_", 1)[1]) for k in got if k.startswith("logits_"))
    before = {k: v for k, v in reference.items() if not k.startswith("logits_") or int(k.rsplit("_", 1)[1]) < PERSIST_STEPS}
    verdict = compare_dumps(before, {k: got[k] for k in before if k in got}, RTOL["cuda_graph"])
    verdict["ok"] = verdict["ok"] and steps[:PERSIST_STEPS] == list(range(PERSIST_STEPS)) and child.returncode != 0
    return {**info, **verdict, "steps_recovered": len(steps), "cause": results[0].cause, "rtol": RTOL["cuda_graph"]}


# (phase, needs CUDA, rough seconds on one H200 with warm caches: the --time-limit estimate).
# compiled_default (the default CUDA path, never run on a GPU: aoti's CUDA package killed the first
# H200 run's process before it) before reduce_overhead, both before persist, which gpu_run.sh runs
# again on the native path: a short budget (~115 s there) should drop what is checked twice.
PHASES = [("eager", False, 10), ("triton_launch", True, 10), ("cuda_graph", True, 15),
          ("native_cuda_kernel", True, 10), ("compiled_default", False, 40), ("reduce_overhead", True, 40),
          ("persist", True, 30), ("aoti", True, 90)]
RTOL = {"cuda_graph": 1e-6, "compiled_default": 1e-4, "reduce_overhead": 1e-4, "aoti": 1e-4}


def _key_number(phase, r):
    if phase == "eager":
        return f"{r['keys']} keys, {r['seconds']:.1f} s"
    if phase == "native_cuda_kernel":
        return f"{len(r['mismatched'])} of {r['keys']} samples differ from the Triton kernel"
    if phase == "triton_launch":
        how = "direct" if r["launches_directly"] else "JIT (no direct launch)"
        return (f"{how}: {len(r['mismatched'])} of {r['keys']} samples differ from the JIT launch, "
                f"{len(r['reference_mismatched'])} from the CPU reference")
    if phase == "persist":
        return (f"{r.get('steps_recovered', 0)} steps recovered after the assert at step {PERSIST_STEPS} "
                f"(max_rel_err {r['max_rel_err']:.1e}); child exit {r['child_exit']}")
    text = f"max_rel_err {r['max_rel_err']:.1e} (rtol {r['rtol']:.0e}), {r['keys']} keys"
    if r["mismatched"] or r["missing"]:
        text += f"; mismatched {r['mismatched'][:3]}, missing {r['missing'][:3]}"
    if "cudagraph_skips" in r:
        text += f", {r['unique_graphs']} graphs, {r['cudagraph_skips']} cudagraph skips"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu_common.add_arguments(parser, default_out="gpu_check.json")
    parser.add_argument("--steps", type=int, default=32, help="decode steps of the session")
    parser.add_argument("--layers", type=int, default=6, help="layers of the built-in model")
    parser.add_argument("--only", nargs="+", choices=[name for name, *_ in PHASES], metavar="PHASE",
                        help="run only these phases")
    parser.add_argument("--persist-child", metavar="DIR", help=argparse.SUPPRESS)
    started = gpu_common.start(parser, argv, "gpu_check")
    if isinstance(started, int):
        return started
    args, device, note = started
    if args.persist_child:
        _persist_child(args.persist_child, device, args.layers, args.steps)
        return 0
    if args.dry_run:
        gpu_common.print_plan("gpu_check", device, args.device, note, args.out, PHASES, args.time_limit)
        return 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        native = compiledump.native_available()
    except Exception as error:  # noqa: BLE001 - a library built for another torch: the phases say more
        native = f"failed to load: {type(error).__name__}: {error}"
    results = {**gpu_common.metadata(device), "steps": args.steps, "layers": args.layers,
               "native_library": native, "phases": {}}
    runner = gpu_common.Runner("gpu_check", device, args.out, args.time_limit, results)
    cfg = ModelConfig(layers=args.layers, captures_per_layer=4)
    ctx = {}

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)

        def eager():
            ctx["session"] = make_session(cfg, prompt_len=PROMPT, steps=args.steps).to(device)
            path, info = phase_eager(cfg, ctx["session"], device, out_dir)
            ctx["reference"] = _load(path)
            return {**info, "keys": len(ctx["reference"])}

        def compared(name, run):
            def phase():
                if "reference" not in ctx:
                    raise gpu_common.SkipPhase("no eager reference (the eager phase failed)")
                path, info = run(ctx["session"])
                verdict = compare_dumps(ctx["reference"], _load(path), RTOL[name])
                if info.get("cudagraph_skips"):
                    verdict["ok"] = False
                return {**info, **verdict, "rtol": RTOL[name]}
            return phase

        def persist():
            if "reference" not in ctx:
                raise gpu_common.SkipPhase("no eager reference (the eager phase failed)")
            # The child's timeout ends inside this script's time limit (its own outer timeout).
            timeout = max(10.0, runner.seconds_left(300) - 5)
            return phase_persist(args, device, out_dir, ctx["reference"], timeout)

        runs = {
            "eager": eager,
            "cuda_graph": compared("cuda_graph", lambda s: phase_cuda_graph(cfg, s, device, out_dir)),
            "native_cuda_kernel": lambda: check_native_cuda_kernel(device),
            "triton_launch": lambda: check_triton_launch(device),
            "compiled_default": compared("compiled_default",
                                         lambda s: phase_compiled(cfg, s, device, out_dir, "default")),
            "reduce_overhead": compared("reduce_overhead",
                                        lambda s: phase_compiled(cfg, s, device, out_dir, "reduce-overhead")),
            "aoti": compared("aoti", lambda s: phase_aoti(cfg, s, device, out_dir)),
            "persist": persist,
        }
        for name, needs_cuda, estimate in PHASES:
            if args.only is None or name in args.only:
                runner.run(name, runs[name], needs_cuda=needs_cuda, estimate_s=estimate)
    return runner.summary(_key_number)


if __name__ == "__main__":
    sys.exit(main())
