"""Cost of capture points in an AOTInductor package: one decode step with and without them.

    python benchmarks/bench_aoti.py                      # capture_export_v1 served by the native
    COMPILEDUMP_NATIVE=0 python benchmarks/bench_aoti.py # library if built (called through its C
                                                         # shim), else by Python (proxy executor)

Exports the built-in model's decode step twice, with its capture points (compiledump.aot, the
arena as inputs) and uninstrumented (plain torch.export of the same weights), packages both
with AOTInductor, and times them interleaved in one process (median µs per step over rounds,
median of per-round ratios). The decode batch is padded, so most captures are token-gated: the
kernel still runs and counts them, as in an engine. Prints which implementation served
`capture_export_v1` (kernel_owner).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from harness import interleaved, machine, median, ratio, scratch_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arena-mb", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import compiledump
    from compiledump import aot
    from compiledump.ops import native, schemas
    from compiledump.demo.model import NO_DUMP, ModelConfig, TinyMoE

    tmp = Path(scratch_dir(prefix="bench-aoti-"))
    cfg = ModelConfig(layers=args.layers, dim=args.dim, ffn=2 * args.dim, captures_per_layer=5)
    compiledump.configure(dir=str(tmp / "dump"), tokens=7, moe_layers=args.layers, arena_mb=args.arena_mb)
    batch = 4
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batch,), generator=g)
    state = torch.randn(cfg.layers, batch, cfg.dim, generator=g)
    with torch.no_grad():
        captured = aot.load(aot.package(aot.export(TinyMoE(cfg, dump=compiledump), (tokens, state)),
                                        tmp / "captured.pt2"))
        plain_ep = torch.export.export(TinyMoE(cfg, dump=NO_DUMP), (tokens, state), strict=False)
        plain = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(plain_ep, package_path=str(tmp / "plain.pt2")))
    compiledump.set_rows(1)
    packages = {"captured": tmp / "captured.pt2", "plain": tmp / "plain.pt2"}
    cases = {
        "decode step, no capture points": lambda: plain(tokens, state),
        f"decode step, {cfg.layers * 5 + 1} capture points": lambda: captured(tokens, state),
    }
    per_round = interleaved(cases, rounds=args.rounds, calls=args.calls)
    print(f"machine: {machine()}; threads {args.threads}")
    print(f"model: {cfg.layers} layers, dim {cfg.dim}, hc {cfg.hc_mult}, batch {batch}; "
          f"capture_export_v1 served by: {native.kernel_owner(schemas.EXPORT)}")
    for name, times in per_round.items():
        print(f"{name:<36}{median(times) * 1e6:>10.1f} us")
    names = list(cases)
    print(f"ratio with / without capture points: {ratio(per_round, names[1], names[0]):.3f}")
    for name, path in packages.items():
        kernels, extern_calls, shim_calls = generated_code_counts(path)
        print(f"{name} package: {kernels} generated kernels, {extern_calls} proxy-executor op calls, "
              f"{shim_calls} native C-shim calls")


def generated_code_counts(package: Path) -> tuple[int, int, int]:
    """(generated CPU kernels, custom-op calls through the proxy executor, calls of the native C
    shims) in an AOTI package."""
    import zipfile

    kernels = calls = shims = 0
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            text = archive.read(name).decode(errors="replace") if name.endswith(".cpp") else ""
            if name.endswith(".kernel.cpp"):
                kernels += text.count('extern "C"')
            elif name.endswith(".wrapper.cpp"):
                calls += text.count("proxy_executor_call_function(")
                shim = "aoti_torch_cpu_capture_export_v1("
                shims += text.count(shim) - text.count(f"extern AOTITorchError {shim}")
    return kernels, calls, shims


if __name__ == "__main__":
    main()
