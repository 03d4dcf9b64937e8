"""What scripts/gpu_check.py and benchmarks/gpu_bench.py share: the --device/--out/--dry-run/
--time-limit options, device resolution (a dry run never initializes CUDA), and the phase runner
(one failing phase is recorded with its traceback's last line and the next one still runs; the
JSON is rewritten after every phase, so a run killed by a timeout keeps what it measured) with
its one summary table.

Only torch APIs that exist in torch 2.11 are used here and in both scripts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


class DeviceError(RuntimeError):
    """The device asked for cannot be used here (one line, printed as the script's error)."""


class SkipPhase(Exception):
    """Raised by a phase that cannot run here (a missing file, no native library): status skip."""


def parse_device(text: str) -> str:
    """argparse type of --device: `cpu`, `cuda` or `cuda:N`, returned normalized."""
    match = _DEVICE.fullmatch(text.strip().lower())
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}: use cpu, cuda or cuda:N (N >= 0)")
    return match.group(0)


def resolve_device(spec: str, dry_run: bool = False) -> tuple[torch.device, str | None]:
    """The torch.device for a parsed --device, and a note for the plan (None when nothing to say).

    A bare `cuda` becomes `cuda:<current device>`. CUDA asked for but unavailable: DeviceError,
    except in a dry run (the plan says so). A dry run never initializes CUDA: before
    initialization the current device is 0, and is_available()/device_count() do not initialize it.
    """
    if spec == "cpu":
        return torch.device("cpu"), None
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        message = f"--device {spec}: CUDA is not available (torch {torch.__version__}: {why})"
        if dry_run:
            return torch.device(spec), message + "; a real run would stop here"
        raise DeviceError(message)
    count = torch.cuda.device_count()
    device = torch.device(spec)
    if device.index is None:
        current = torch.cuda.current_device() if (torch.cuda.is_initialized() or not dry_run) else 0
        device = torch.device("cuda", current)
    if device.index >= count:
        raise DeviceError(f"--device {spec}: there is no such device ({count} CUDA device(s) visible)")
    return device, None


def add_arguments(parser: argparse.ArgumentParser, default_out: str) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", type=parse_device, default=default_device,
                        help=f"cpu, cuda (the current CUDA device) or cuda:N (default: {default_device})")
    parser.add_argument("--out", default=default_out, help="full results (JSON), rewritten after every phase")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (phases, device, output) and exit 0; never initializes CUDA")
    parser.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                        help="skip the phases that would not finish within this many seconds of the start "
                             "(0: no limit)")


def start(parser: argparse.ArgumentParser, argv, name: str):
    """Parse, resolve the device; returns (args, device, note), or an exit status (int) on a
    device error (one `<name>: error:` line on stderr)."""
    args = parser.parse_args(argv)
    try:
        device, note = resolve_device(args.device, args.dry_run)
    except DeviceError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2
    return args, device, note


def print_plan(name: str, device: torch.device, spec: str, note: str | None, out: str, phases,
               time_limit: float = 0.0) -> None:
    """The dry run's plan. `phases`: (phase, needs_cuda, estimated seconds) in run order."""
    print(f"{name} dry run (nothing is run; CUDA is not initialized)")
    resolved = "" if str(device) == spec else f" (from --device {spec})"
    print(f"  device: {device}{resolved}")
    if note:
        print(f"  note:   {note}")
    print(f"  output: {Path(out).resolve()}")
    if time_limit > 0:
        print(f"  time limit: {time_limit:.0f} s (a phase that would not finish by then is skipped)")
    print("  phases:")
    for phase, needs_cuda, estimate in phases:
        verdict = "skip (needs a CUDA device)" if needs_cuda and device.type != "cuda" else f"run (~{estimate} s on a GPU)"
        print(f"    {phase:<26}{verdict}")


def metadata(device: torch.device) -> dict:
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "kernel": platform.release(), "argv": sys.argv}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - compiledump depends on triton
        meta["triton"] = None
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["capability"] = list(torch.cuda.get_device_capability(device))
    return meta


def filesystem_of(path) -> str:
    """The type of the filesystem holding `path` (Linux: /proc/self/mountinfo), or "unknown"."""
    target, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                fields, _, rest = line.partition(" - ")
                mount_point = fields.split()[4]
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, kind = mount_point, rest.split()[0]
    except (OSError, IndexError):
        pass
    return kind


def tmpfs_directory() -> str | None:
    """A writable directory on tmpfs (/dev/shm), where the NVIDIA driver may pin a file mapping
    long-term on any Linux (docs/crashes.md), or None."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) and filesystem_of(shm) == "tmpfs" else None


def _process_start() -> float:
    """time.monotonic() at this process's start (Linux: from /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


_PROCESS_START = _process_start()


def poison_arena() -> None:
    """Fill the arena with NaN (a device fill, no sync), so that a capture that should have
    written and did not shows up as a mismatch instead of the previous run's values."""
    from compiledump.capture.state import STATE

    if STATE.runtime is not None:
        STATE.runtime.arena.fill_(float("nan"))


def load_npz(path) -> dict:
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
            if not np.array_equal(np.isfinite(have), np.isfinite(want)):
                mismatched.append(key)  # a NaN or Inf on one side only (max() would skip a NaN)
                continue
            finite = np.isfinite(want)
            if not finite.any():
                continue
            scale = max(float(np.abs(want[finite]).max()), 1e-30)
            worst = max(worst, float(np.abs(have[finite].astype(np.float64) - want[finite]).max() / scale))
        elif not np.array_equal(have, want):
            mismatched.append(key)
    missing = sorted(set(other) ^ set(reference))
    ok = not mismatched and not missing and worst <= rtol
    return {"ok": ok, "keys": len(reference), "max_rel_err": worst, "mismatched": mismatched, "missing": missing}


class Runner:
    """Runs phases in order, each wrapped; writes results["phases"] and the JSON after each one."""

    def __init__(self, name: str, device: torch.device, out: str, time_limit: float, results: dict,
                 since: float | None = None):
        self.name, self.device, self.out = name, device, Path(out)
        self.started = time.monotonic()
        # The limit counts from `since` (default: process start, torch import and CUDA init
        # included, as the timeout that wraps the script counts).
        origin = _PROCESS_START if since is None else since
        self.deadline = origin + time_limit if time_limit > 0 else None
        self.results = results
        results.setdefault("phases", {})
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1, default=str))

    def record(self, phase: str, status: str, **info) -> dict:
        ok = {"ok": True, "skip": None, "fail": False}[status]
        entry = {"status": status, "ok": ok, **info}
        self.results["phases"][phase] = entry
        self.write()
        return entry

    def seconds_left(self, default: float) -> float:
        """Seconds until the time limit, or `default` without one (a child process's timeout)."""
        return default if self.deadline is None else max(1.0, self.deadline - time.monotonic())

    def run(self, phase: str, fn, needs_cuda: bool = False, estimate_s: float = 0.0) -> dict:
        """Run `fn()` (returns a dict; `"ok": False` in it makes the phase fail) unless it cannot run."""
        if needs_cuda and self.device.type != "cuda":
            return self.record(phase, "skip", skipped="needs a CUDA device")
        if self.deadline is not None and time.monotonic() + estimate_s > self.deadline:
            left = max(0.0, self.deadline - time.monotonic())
            return self.record(phase, "skip", skipped=f"time limit: {left:.0f} s left, needs about {estimate_s:.0f} s")
        # Written first: a process killed (timeout) or crashed during the phase leaves this behind.
        self.record(phase, "fail", error="did not finish (the process was killed or crashed)")
        print(f"[{self.name}] {phase} ...", flush=True)
        begun = time.perf_counter()
        try:
            info = fn() or {}
            status = "fail" if info.get("ok") is False else "ok"
            entry = {k: v for k, v in info.items() if k != "ok"}
        except SkipPhase as reason:
            status, entry = "skip", {"skipped": str(reason)}
        except Exception as error:  # noqa: BLE001 - one failing phase must not stop the others
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            message = str(error).strip().splitlines()
            status, entry = "fail", {
                "error": f"{type(error).__name__}: {message[0] if message else ''}".rstrip(": "),
                "last_line": text.strip().splitlines()[-1],  # the traceback's last line
                "traceback": text[-4000:]}
        finally:
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)  # a phase that failed inside "error" mode
        seconds = time.perf_counter() - begun
        print(f"[{self.name}] {phase}: {status} ({seconds:.1f} s)", flush=True)
        return self.record(phase, status, **{**entry, "wall_s": round(seconds, 3)})

    def summary(self, key_number) -> int:
        """Print the one summary table (phase | status | key number); 1 if a phase failed, else 0.

        `key_number(phase, entry)`: the phase's headline, for a phase that ran."""
        rows = []
        for phase, entry in self.results["phases"].items():
            if "error" not in entry and "skipped" not in entry:  # ran (a failed check included)
                try:
                    text = key_number(phase, entry)
                except Exception as error:  # noqa: BLE001 - a summary bug must not hide the table
                    text = f"(no summary: {type(error).__name__}: {error})"
            else:
                text = entry.get("error") or entry.get("skipped", "")
            rows.append((phase, entry["status"], text))
        width = max([len("phase")] + [len(r[0]) for r in rows])
        total = time.monotonic() - self.started
        print(f"\n{self.name} on {self.device}: {total:.0f} s; results in {self.out}")
        print(f"{'phase':<{width}} | status | key number")
        print(f"{'-' * width}-+--------+-----------")
        for phase, status, text in rows:
            print(f"{phase:<{width}} | {status:<6} | {text}")
        failed = [r[0] for r in rows if r[1] == "fail"]
        print("FAILED: " + ", ".join(failed) if failed else "no phase failed")
        return 1 if failed else 0
