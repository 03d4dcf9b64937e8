"""Where the host time of one capture call goes on the Triton path, layer by layer.

    python benchmarks/gpu_host_split.py --device cuda       # on a GPU (scripts/gpu_diagnose.sh runs it)
    TRITON_INTERPRET=1 COMPILEDUMP_CPU_KERNEL=triton python benchmarks/gpu_host_split.py --device cpu

gpu_bench.py's compiled_host_cost gives one number per capture (69 µs on the first H200 run, the
native path 12 µs). This splits it: each row times one layer of the call by itself, from the
outside in, so the differences between rows say what each layer adds:

  record_eager      compiledump.record(tag, x): the public call, the dispatcher, the tag's gates,
                    the kernel layer;
  custom_op_noop    a Python custom op that does nothing, called through torch.ops: the
                    dispatcher's floor for any Python-implemented op;
  run_cuda_kernel   register.run_cuda_kernel: the device guard and the Triton layer below;
  device_guard      `with torch.cuda.device(x.device)` alone;
  triton_launch     triton_kernel.launch: geometry facts to variant and grid, then the launch
                    straight into the compiled kernel (what captures do once a variant is prepared);
  triton_launch_jit the same through Triton's JIT (triton_kernel.through_the_jit(): what captures
                    did until the first H200 run measured this split);
  jit_launch        the JIT call `capture_kernel[grid](...)` alone (Triton's own binding,
                    specialization key and cache lookup);
  compiled_run      the compiled kernel launched directly, as captures launch it
                    (triton_kernel.DirectLaunch: `CompiledKernel[grid](...)`, every argument,
                    constexprs included, in the kernel's order): the JIT call without its binding,
                    specialization key and cache lookup; with
                    `compiled_run_equal`, whether one such launch leaves the arena and control
                    block the JIT launch leaves.

Host µs per call: the median of rounds of many calls, each round ended by one synchronize.
Prints one table and, with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiledump  # noqa: E402
from compiledump.ops import layout as L  # noqa: E402
from compiledump.ops import register  # noqa: E402
from compiledump.ops.geometry import geometry  # noqa: E402


_NOOP = None


def _noop_op(device):
    """A Python custom op that does nothing (defined once per process): the dispatcher's floor."""
    global _NOOP
    if _NOOP is None:
        lib = torch.library.Library("compiledump_host_split", "FRAGMENT")
        lib.define("noop(Tensor x) -> ()")
        for key in ("CPU", "CUDA"):
            lib.impl("noop", lambda x: None, key)
        _NOOP = lib  # kept alive: the op lives as long as its library object
    return torch.ops.compiledump_host_split.noop


def per_call_us(fn, device, calls=200, rounds=7) -> float:
    """Median host µs per call of `fn` over `rounds` rounds of `calls` calls."""
    fn()
    times = []
    for _ in range(rounds):
        begun = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - begun) * 1e6 / calls)
    return statistics.median(times)


def rows(device, calls, rounds=7, x=None) -> dict:
    """Host µs per call of each layer (None where it does not exist on `device`); the public call
    records `x` (default: a random [8, 4, 7168] bf16 hidden state) under the tag "host_split"."""
    from compiledump.ops import triton_kernel as K
    from compiledump.ops.variants import NUM_WARPS, launches_for, variant_for

    noop = _noop_op(device)

    x = torch.randn(8, 4, 7168, device=device, dtype=torch.bfloat16) if x is None else x
    arena = torch.zeros(1 << 20, dtype=torch.float32, device=device)
    ctrl = torch.zeros(L.control_words(4), dtype=torch.int32, device=device)
    ctrl[L.REG_ENABLED], ctrl[L.REG_ROWS], ctrl[L.REG_MAX_ROWS], ctrl[L.REG_RECORD_ROW] = 1, 1, 1, -1
    kind, args = L.KIND_RECORD, (L.slot_base(2), 16, 1, 0)  # a one-row ring: every call overwrites it
    src, geo = geometry(x, kind)
    v = variant_for(src, geo, kind)
    T, H, D, st, sh, sd, row_reg, _mean = geo
    ((phase, programs),) = launches_for(geo, kind)  # one launch, as triton_kernel.launch makes it
    jit_args = (src, arena, ctrl, T, H, D, st, sh, sd, *args[:3], kind, args[3], row_reg, phase)
    constexprs = K.constexprs(v)

    def jit_launch():
        return K.capture_kernel[(programs,)](*jit_args, **constexprs, num_warps=NUM_WARPS)

    compiled = jit_launch()
    guard = torch.cuda.device(x.device) if device.type == "cuda" else None

    def device_guard():
        with guard:
            pass

    def triton_launch():
        K.launch(src, arena, ctrl, geo, *args[:3], kind, args[3])

    with K.through_the_jit():
        triton_launch_jit = per_call_us(triton_launch, device, calls, rounds)
    out = {
        "record_eager": per_call_us(lambda: compiledump.record("host_split", x), device, calls, rounds),
        "custom_op_noop": per_call_us(lambda: noop(x), device, calls, rounds),
        "run_cuda_kernel": (per_call_us(lambda: register.run_cuda_kernel(x, arena, ctrl, kind, args), device, calls,
                                        rounds) if device.type == "cuda" else None),
        "device_guard": per_call_us(device_guard, device, calls, rounds) if guard is not None else None,
        "triton_launch": per_call_us(triton_launch, device, calls, rounds),
        "triton_launch_jit": triton_launch_jit,
        "jit_launch": per_call_us(jit_launch, device, calls, rounds),
        "compiled_run": None,
    }
    # The first H200 run called CompiledKernel.run with the JIT's launcher arguments and met its
    # signature (36 arguments: the constexprs are among them); `[grid](...)` takes them all.
    if device.type == "cuda" and compiled is not None and hasattr(type(compiled), "__getitem__"):
        direct = K.DirectLaunch(compiled, v)  # what captures launch once the variant is prepared
        try:
            out["compiled_run_equal"] = _same_effect(jit_launch, lambda: direct(programs, *jit_args), arena, ctrl)
            out["compiled_run"] = per_call_us(lambda: direct(programs, *jit_args), device, calls, rounds)
        except Exception as error:  # noqa: BLE001 - reported: the launch API moved
            out["compiled_run_error"] = f"{type(error).__name__}: {error}"
    return out


def _same_effect(first, second, arena, ctrl) -> bool:
    """Whether one call of `second` leaves `arena` and `ctrl` as one call of `first` does, each
    from the same starting state."""
    start = arena.clone(), ctrl.clone()
    results = []
    for fn in (first, second):
        arena.copy_(start[0])
        ctrl.copy_(start[1])
        fn()
        results.append((arena.clone(), ctrl.clone()))
    (a1, c1), (a2, c2) = results
    return bool(torch.equal(c1, c2) and torch.equal(a1.view(torch.int32), a2.view(torch.int32)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory() as tmp:
        compiledump.configure(dir=tmp, tokens=0)
        compiledump.init(device)
        result = rows(device, args.calls)
        compiledump.flush()
    meta = {"device": str(device), "torch": torch.__version__, "capture_path": "triton"}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    width = max(map(len, result))
    print(f"host us per call ({meta}):")
    for name, value in result.items():
        shown = (value if isinstance(value, str) else "-" if value is None else str(value) if isinstance(value, bool)
                 else f"{value:8.2f}")
        print(f"  {name:<{width}}  {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps({**meta, "host_us": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
