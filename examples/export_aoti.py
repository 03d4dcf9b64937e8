"""Export a model with capture points, package it with AOTInductor, and run it without eager
Python: from Python (`compiledump.aot.load`) and, with `--driver`, from the C++-only driver.

    python examples/export_aoti.py OUT_DIR [--driver build/compiledump_aoti_driver]

Writes into OUT_DIR:
  prefill.pt2, decode.pt2   the built-in model's prefill (dynamic prompt length) and decode step
                            (dynamic batch), exported with compiledump.aot.export and packaged
  inputs.txt                the engine session's inputs, for the C++ driver
  eager/                    the reference: the same session run eagerly in Python
  aoti/                     the packages run from Python
  cpp/                      the packages run by the C++ driver (with --driver)
and prints the comparison of each run with the eager one (exit status 1 on a divergence).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

import compiledump
from compiledump import aot
from compiledump.compare import CompareOptions, compare, format_report
from compiledump.demo.model import ModelConfig, TinyMoE, export_session, make_session, run_session, session_forward

PROMPT_LEN = 7
MODEL = ModelConfig(layers=3, captures_per_layer=5)
# Small capacities keep the exported arena input small (it is a program input of fixed size).
SETTINGS = dict(tokens=PROMPT_LEN, moe_layers=MODEL.layers, arena_mb=1, max_steps=32, max_tags=64)
SESSION = make_session(MODEL, prompt_len=PROMPT_LEN, steps=8)


def _start(directory: Path) -> None:
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(directory), **SETTINGS)


def run_eager(out: Path, session, model: ModelConfig = MODEL) -> str:
    """The reference dump: the engine session run eagerly."""
    _start(out / "eager")
    run_session(TinyMoE(model, dump=compiledump), compiledump, session)
    return compiledump.flush()


def export_packages(out: Path, session) -> tuple[str, str]:
    """Export prefill and decode against one arena, then package both (each carries the plan)."""
    _start(out / "export")
    prefill, decode = export_session(TinyMoE(MODEL, dump=compiledump), session)
    paths = aot.package(prefill, out / "prefill.pt2"), aot.package(decode, out / "decode.pt2")
    compiledump.reset()  # nothing was captured here: no dump at exit
    return paths


def run_packages(out: Path, prefill: str, decode: str, session) -> str:
    """The packages run from Python: `aot.load` restores the registry from their plan."""
    torch._dynamo.reset()
    compiledump.reset()
    compiledump.configure(dir=str(out / "aoti"))
    run_session(session_forward(aot.load(prefill), aot.load(decode)), compiledump, session)
    return compiledump.flush()


def write_inputs(path: Path, session) -> None:
    """The session for kernels/aoti_driver.cpp (floats with 9 digits: exact for float32)."""
    steps, pad_rows = session.pad_tokens.shape
    decode = torch.cat([session.decode_tokens[:, None], session.pad_tokens], 1)
    state = session.pad_state.float()
    lines = [
        f"prompt {session.prompt.numel()} " + " ".join(map(str, session.prompt.tolist())),
        f"profile {session.profile_tokens.numel()} " + " ".join(map(str, session.profile_tokens.tolist())),
        f"warmup_rows {session.warmup_rows}",
        f"decode {steps} {pad_rows + 1} " + " ".join(map(str, decode.flatten().tolist())),
        f"pad_state {' '.join(map(str, state.shape))} " + " ".join(f"{v:.9g}" for v in state.flatten().tolist()),
    ]
    path.write_text("\n".join(lines) + "\n")


def run_driver(driver: str, out: Path, prefill: str, decode: str, session) -> str:
    """The C++-only run; returns the npz path the driver printed."""
    write_inputs(out / "inputs.txt", session)
    done = subprocess.run([driver, prefill, decode, str(out / "inputs.txt"), str(out / "cpp")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{driver} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--driver", help="path of the built compiledump_aoti_driver")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    eager = run_eager(args.out, SESSION)
    prefill, decode = export_packages(args.out, SESSION)
    runs = {"aoti (Python)": run_packages(args.out, prefill, decode, SESSION)}
    if args.driver:
        runs["aoti (C++ driver)"] = run_driver(args.driver, args.out, prefill, decode, SESSION)
    status = 0
    for name, dump in runs.items():
        report = compare(eager, dump, CompareOptions())
        print(f"== eager vs {name}")
        print("\n".join(format_report(report, table="divergent")))
        status = max(status, report.exit_status)
    return status


if __name__ == "__main__":
    sys.exit(main())
