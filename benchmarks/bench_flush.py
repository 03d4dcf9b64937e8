"""`flush()` of a full run vs writing each capture separately (benchmark 5).

    python benchmarks/bench_flush.py

A full run: 64 decode steps x (32 hidden-state captures of dim 1024 + one 32000-wide logits
row), all kept as steps (64 x 33 arrays). Side by side, interleaved, median over rounds:
  flush:        compiledump.flush() — one copy of the used arena and the control block,
                slicing on the host, one npz and one manifest written atomically;
  numpy.savez:  the seed's exit-time write of the same arrays already on the host;
  per capture:  one .npy file per capture (what per-tensor dumpers such as SGLang's write).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch

from harness import interleaved, machine, median, scratch_dir

STEPS, HIDDEN_TAGS, DIM, VOCAB, BATCH = 64, 32, 1024, 32000, 8


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    import compiledump

    tmp = Path(scratch_dir(prefix="bench-flush-"))
    compiledump.configure(dir=str(tmp / "cd"), max_steps=STEPS)
    g = torch.Generator().manual_seed(0)
    host = {}
    for step in range(STEPS):
        for t in range(HIDDEN_TAGS):
            x = torch.randn(BATCH, DIM, generator=g)
            compiledump.record_step(f"layer{t}", x)
            host[f"layer{t}_{step}"] = x[0].numpy().copy()
        logits = torch.randn(BATCH, VOCAB, generator=g)
        compiledump.record_step("logits", logits)
        host[f"logits_{step}"] = logits[0].numpy().copy()
    payload = sum(a.nbytes for a in host.values())

    def per_capture():
        out = tmp / "per_capture"
        out.mkdir(exist_ok=True)
        for key, array in host.items():
            np.save(out / f"{key}.npy", array)

    cases = {
        "flush": compiledump.flush,
        "numpy.savez": lambda: np.savez(tmp / "seed.npz", **host),
        "per capture": per_capture,
    }
    times = interleaved(cases, rounds=args.rounds, calls=1, warmup=1)
    path = Path(compiledump.flush())
    sizes = {
        "flush": path.stat().st_size + path.with_suffix(".json").stat().st_size,
        "numpy.savez": (tmp / "seed.npz").stat().st_size,
        "per capture": sum(p.stat().st_size for p in (tmp / "per_capture").iterdir()),
    }
    files = {"flush": 2, "numpy.savez": 1, "per capture": len(host)}
    with np.load(path) as data:
        assert sorted(data.files) == sorted(host) and all(np.array_equal(data[k], host[k]) for k in host)
    print(f"machine: {machine()}")
    print(f"{len(host)} arrays ({STEPS} steps x {HIDDEN_TAGS + 1} captures), payload {payload / 2**20:.1f} MiB")
    print(f"{'write':<14}{'ms':>9}{'MiB on disk':>13}{'files':>7}{'vs flush':>10}")
    for name in cases:
        ms = median(times[name]) * 1e3
        vs = median(times[name]) / median(times["flush"])
        print(f"{name:<14}{ms:>9.1f}{sizes[name] / 2**20:>13.1f}{files[name]:>7}{vs:>9.2f}x")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
