"""Command line: ``compiledump demo``, ``compiledump compare REF RUN``, ``compiledump inspect FILE`` and
``compiledump recover DIR``.

Each subcommand has its own ``_add_<name>_parser`` function that registers its arguments and
the function that runs it; adding a subcommand means adding one such function and one call in
:func:`build_parser`. Nothing here imports torch at module level: compare, inspect and recover
only need numpy; demo imports torch when it runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable

# Exit statuses (docs/compare.md); compare's own 1 (a divergence) and 3 (not everything comparable or
# judged) are its report's (compare/report.py `Report.exit_status`).
EXIT_OK = 0
EXIT_UNUSABLE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


# `--json -`: the JSON on stdout (for a pipe into jq), the text report on stderr.
JSON_TO_STDOUT = "-"


def _write_json(path: str, text: str) -> None:
    if path == JSON_TO_STDOUT:
        _emit([text.rstrip("\n")])
    else:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def _error(message: str) -> int:
    """Unusable input: exactly one line on stderr, exit status 2."""
    print(f"compiledump: error: {message}", file=sys.stderr)
    return EXIT_UNUSABLE


def _emit(lines: list[str], json_path: str | None = None) -> None:
    """Print lines; if the reader of a pipe went away (``| head``), stop printing quietly so the
    command still returns its real exit status. With ``--json -`` the JSON takes stdout, so the
    lines go to stderr."""
    stream = sys.stderr if json_path == JSON_TO_STDOUT else sys.stdout
    try:
        for line in lines:
            print(line, file=stream)
        stream.flush()
    except BrokenPipeError:
        # Point the stream at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())


def _threshold_override(text: str) -> tuple[str, float]:
    """Parse ``REGEX=VALUE`` (split at the last ``=``, so the regex may contain ``=``)."""
    pattern, separator, value = text.rpartition("=")
    if not separator or not pattern:
        raise argparse.ArgumentTypeError(f"expected REGEX=VALUE, got {text!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"bad regex {pattern!r}: {exc}") from None
    return pattern, _non_negative_float(value)


def _map(text: str) -> tuple[str, str]:
    """Parse ``PATTERN=REPLACEMENT`` for --map (split at the first ``=`` not escaped by a backslash)."""
    from .compare.rename import split_map

    try:
        return split_map(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def _add_compare_parser(subparsers) -> None:
    from .compare import DEFAULT_NEAR_TIE_ULPS

    parser = subparsers.add_parser(
        "compare",
        help="compare two dumps and name the first divergent layer and decode step",
        description="Compare REF (the reference run) with RUN key by key, in model order. Thresholds follow "
                    "the lower precision of the two sides' source dtypes (docs/compare.md). Exit status: "
                    "0 no divergence, 1 divergence found, 2 unusable input, 3 no divergence but some keys "
                    "were not comparable (values of different phases or token counts) or not compared "
                    "(shapes or dtypes that cannot be, an unreadable array, shards that cannot be merged), "
                    "or expert ids differ where no reference router "
                    "logits judge them.",
    )
    parser.add_argument("ref", metavar="REF", help="reference dump: an .npz file or a directory of per-rank files")
    parser.add_argument("run", metavar="RUN", help="dump to check: an .npz file or a directory of per-rank files")
    parser.add_argument("--threshold", type=_non_negative_float, default=None, metavar="VALUE",
                        help="rel_diff above VALUE is a divergence, for every key (default: per precision "
                             "class, e.g. 1e-8 for fp32, 2e-3 for bf16 prefill keys)")
    parser.add_argument("--threshold-for", type=_threshold_override, action="append", default=[],
                        metavar="REGEX=VALUE",
                        help="rel_diff threshold for keys matching REGEX (re.search); repeatable, the last match wins")
    parser.add_argument("--norm-threshold", type=_non_negative_float, default=None, metavar="VALUE",
                        help="norm_diff = |norm(RUN) - norm(REF)| / norm(REF) above VALUE is a divergence, for every "
                             "key (default: per precision class)")
    parser.add_argument("--map", type=_map, action="append", default=[], metavar="PATTERN=REPLACEMENT",
                        help="rename RUN keys before pairing: re.sub(PATTERN, REPLACEMENT, key); repeatable, "
                             "applied in order; split at the first '=' not written as '\\='")
    parser.add_argument("--near-tie", type=_non_negative_float, default=None, metavar="EPS",
                        help="fixed near-tie epsilon in logit units for argmax flips and, in low-precision "
                             "pairs, for expert-id differences judged on the router logits (default: "
                             "--near-tie-ulps bf16 spacings of the reference top-1 logit)")
    parser.add_argument("--near-tie-ulps", type=_non_negative_float, default=DEFAULT_NEAR_TIE_ULPS, metavar="N",
                        help=f"near-tie epsilon as N bf16 spacings at the reference top-1 logit "
                             f"(default {DEFAULT_NEAR_TIE_ULPS:g})")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': to "
                                                       "stdout, the text report then to stderr)")
    parser.add_argument("--plot", metavar="PATH.png",
                        help="draw rel_diff per layer and margin per step to PATH.png (needs matplotlib)")
    parser.add_argument("--table", choices=("all", "divergent", "none"), default="all",
                        help="rows of the per-key table to print (default all)")
    parser.set_defaults(func=_run_compare)


def _note_leftovers(*paths: str) -> None:
    """On stderr: crash leftovers next to the dumps read, which `recover` would turn into dumps."""
    from .capture.recover import dead_leftovers

    seen = set()
    for path in paths:
        directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        if directory in seen:
            continue
        seen.add(directory)
        found = dead_leftovers(directory)
        if found:
            names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
            print(f"compiledump: note: {directory} holds what {len(found)} process(es) left when they died before "
                  f"flushing ({names}); `compiledump recover {directory}` turns it into dumps", file=sys.stderr)


def _run_compare(args: argparse.Namespace) -> int:
    from .compare import CompareOptions, PlotUnavailable, compare, format_report, report_json_text, write_plot

    _note_leftovers(args.ref, args.run)

    options = CompareOptions(threshold=args.threshold, overrides=list(args.threshold_for),
                             norm_threshold=args.norm_threshold, maps=list(args.map),
                             near_tie=args.near_tie, near_tie_ulps=args.near_tie_ulps)
    report = compare(args.ref, args.run, options)
    _emit(format_report(report, table=args.table), args.json)
    if args.json:
        try:
            _write_json(args.json, report_json_text(report))
        except OSError as exc:
            return _error(f"cannot write the JSON report {args.json}: {exc.strerror or exc}")
    if args.plot:
        try:
            write_plot(report, args.plot)
        except PlotUnavailable as exc:
            # The comparison itself is valid, so its exit status stands; only the picture is missing.
            print(f"compiledump: warning: plot skipped: {exc}", file=sys.stderr)
        except OSError as exc:
            return _error(f"cannot write the plot {args.plot}: {exc.strerror or exc}")
    return report.exit_status


def _add_inspect_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="list a dump's keys with shape, dtype and statistics, and its manifest",
        description="Keys in model order with shape, dtype, min/max/mean over finite values and NaN/Inf "
                    "counts, plus the manifest's config and drop counts. Exit status 0, or 2 for unusable input.",
    )
    parser.add_argument("file", metavar="FILE", help="an .npz dump, or a directory of per-rank dumps")
    parser.add_argument("--json", metavar="PATH", help="also write the listing as JSON to PATH ('-': to "
                                                       "stdout, the listing then to stderr)")
    parser.set_defaults(func=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    import json

    from .compare import json_safe
    from .compare.inspect import format_inspection, inspect_path

    _note_leftovers(args.file)
    summaries = inspect_path(args.file)
    _emit([line for summary in summaries for line in format_inspection(summary)], args.json)
    if args.json:
        try:
            _write_json(args.json, json.dumps(json_safe({"files": summaries}), indent=1, allow_nan=False) + "\n")
        except OSError as exc:
            return _error(f"cannot write {args.json}: {exc.strerror or exc}")
    return EXIT_OK


def _add_recover_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "recover",
        help="turn what crashed or killed processes left (<stem>.live/) into ordinary dumps",
        description="With crash-proof capture (COMPILEDUMP_PERSIST, on by default on CPU) a process keeps its "
                    "captures in DIR/<stem>.live/ until its exit-time flush. For each such directory whose "
                    "process is gone, write <stem>.npz and <stem>.json (manifest marked 'recovered', with the "
                    "cause) and remove it. Exit status 0, or 2 when a directory could not be read.",
    )
    parser.add_argument("dir", metavar="DIR", help="the dump directory (COMPILEDUMP_DIR of the dead run)")
    parser.add_argument("--force", action="store_true",
                        help="also recover directories whose process looks alive (pid reused, or another host)")
    parser.add_argument("--keep", action="store_true", help="keep the <stem>.live/ directories after recovering")
    parser.set_defaults(func=_run_recover)


def _run_recover(args: argparse.Namespace) -> int:
    from .capture.recover import recover_directory

    if not os.path.isdir(args.dir):
        return _error(f"{args.dir} is not a directory")
    results, errors = recover_directory(args.dir, force=args.force, keep=args.keep)
    lines = []
    for result in results:
        if result.skipped:
            lines.append(f"skipped {result.live.name}: {result.skipped}")
            continue
        lost = f"; {result.interrupted} capture(s) being written at the end were dropped (interrupted)" \
            if result.interrupted else ""
        lines.append(f"recovered {result.npz}: {result.keys} keys{lost}")
        lines.append(f"  cause: {result.cause}")
        lines.extend(f"  note: {note}" for note in result.notes)
    if not results and not errors:
        lines.append(f"nothing to recover in {args.dir}")
    _emit(lines)
    for error in errors:
        print(f"compiledump: error: {error}", file=sys.stderr)
    return EXIT_UNUSABLE if errors else EXIT_OK


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _add_demo_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the built-in model as an engine and as a reference, and compare the dumps",
        description="Run the built-in hc_mult MoE model twice, as a reference (eager, float32, batch of 1) "
                    "and as an engine (torch.compile(fullgraph=True), padded decode batch; on CUDA bf16 "
                    "and CUDA graphs), dump both with compiledump and compare them. Exit status: the "
                    "comparator's (0 no divergence, 1 divergence, 3 could not tell everything); 2 for bad options.",
    )
    parser.add_argument("--layers", type=_positive_int, default=6, help="layers of the model (default 6)")
    parser.add_argument("--steps", type=_positive_int, default=16, help="decode steps (default 16)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--graphs", choices=("cuda-graph", "reduce-overhead", "none"), default=None,
                        help="CUDA graphs for the engine's decode step: torch.cuda.graph around the compiled "
                             "step, or Inductor's reduce-overhead mode (default cuda-graph on CUDA, none on CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="engine dtype (default bfloat16 on CUDA, float32 on CPU); the reference is float32")
    parser.add_argument("--inject-bug", type=_non_negative_int, default=None, metavar="LAYER",
                        help="break this layer of the engine side; the report should name it")
    parser.add_argument("--bug", choices=("dropped_hc", "routed_scale"), default="dropped_hc",
                        help="the injected bug: an hc stream loses the layer's update (default), or the "
                             "MoE output gets a wrong scale")
    parser.add_argument("--out", metavar="DIR", help="where the dumps go (default: a new temporary directory)")
    parser.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    def log(line: str) -> None:
        _emit([line])

    return run_demo(layers=args.layers, steps=args.steps, device=args.device, inject_bug=args.inject_bug,
                    bug=args.bug, graphs=args.graphs, out=args.out, dtype=args.dtype, log=log)


def build_parser() -> argparse.ArgumentParser:
    """The ``compiledump`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="compiledump",
                                     description="Layer dumps that survive torch.compile and CUDA graphs.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo_parser(subparsers)
    _add_compare_parser(subparsers)
    _add_inspect_parser(subparsers)
    _add_recover_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``compiledump`` console script; returns the exit status."""
    from .compare import DumpError
    from .demo import DemoError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return exc.code if isinstance(exc.code, int) else EXIT_UNUSABLE
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except (DumpError, DemoError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
