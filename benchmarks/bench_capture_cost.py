"""Cost of one capture inside compiled code: N captures in one compiled function vs the same
function without them (issue 14, benchmark 2).

    python benchmarks/bench_capture_cost.py                         # the path this install has
    COMPILEDUMP_NATIVE=0 python benchmarks/bench_capture_cost.py    # the pure-Python path

The function is a small decode-sized computation (`[8, 4, 64]` hidden states, `[8, 64]` rows)
with `--captures` capture points: alternately a 3-D `record` (hc mean of the gathered row), a
2-D `record` and a `record_step`. Both versions are compiled with `fullgraph=True` and timed
interleaved in one process, one thread; the figure is (median instrumented - median plain) / N.
Prints which capture path ran (`compiledump.inspect`'s words: native or python).
"""

from __future__ import annotations

import argparse

import torch

from harness import interleaved, machine, median, ratio, scratch_dir


def _body(x: torch.Tensor, w: torch.Tensor, dump, captures: int) -> torch.Tensor:
    h = x
    for i in range(captures):
        h = torch.tanh(h @ w) if i % 8 == 0 else h
        if dump is None:
            continue
        if i % 3 == 0:
            dump.record(f"layer{i}_hc", h)
        elif i % 3 == 1:
            dump.record(f"layer{i}_row", h[:, 0])
        else:
            dump.record_step(f"layer{i}_step", h[:, 1])
    return h


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--captures", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import compiledump
    from compiledump.ops import native, register

    compiledump.configure(dir=scratch_dir(prefix="bench-capture-"), max_steps=4, moe_layers=10**6)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 4, 64, generator=g), torch.randn(64, 64, generator=g) / 8
    plain = torch.compile(lambda x, w: _body(x, w, None, args.captures), fullgraph=True)
    instrumented = torch.compile(lambda x, w: _body(x, w, compiledump, args.captures), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(x, w), instrumented(x, w))
        times = interleaved({"plain": lambda: plain(x, w), "instrumented": lambda: instrumented(x, w)},
                            rounds=args.rounds, calls=args.calls)
    compiledump.configure(dir=None)  # no dump at exit: its steps past max_steps are expected drops
    path = "native" if register.native_owns_capture() else "python"
    plain_us, instr_us = median(times["plain"]) * 1e6, median(times["instrumented"]) * 1e6
    print(f"machine: {machine()}")
    print(f"capture path: {path} ({native.loaded_path() or 'no native library'})")
    print(f"{'captures':>9}{'plain us':>11}{'instr. us':>11}{'ratio':>8}{'us/capture':>12}{'target':>8}")
    print(f"{args.captures:>9}{plain_us:>11.1f}{instr_us:>11.1f}{ratio(times, 'instrumented', 'plain'):>8.2f}"
          f"{(instr_us - plain_us) / args.captures:>12.2f}{5.0:>8.1f}")


if __name__ == "__main__":
    main()
