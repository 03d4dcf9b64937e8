"""The CLI run in process, as the compare and inspect tests call it."""

import json
from pathlib import Path

from compiledump.cli import main


def run_cli(capsys, *argv) -> tuple[int, list[str], list[str]]:
    """Run `compiledump ARGV` in process; return (exit status, stdout lines, stderr lines)."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def compare_json(capsys, ref, run, *args) -> tuple[int, list[str], dict]:
    """`compiledump compare REF RUN ARGS --json` in process, the report written beside REF's
    directory; return (exit status, stdout lines, the JSON report)."""
    report_path = Path(ref).parent.parent / "report.json"
    code = main(["compare", str(ref), str(run), *[str(arg) for arg in args], "--json", str(report_path)])
    return code, capsys.readouterr().out.splitlines(), json.loads(report_path.read_text())
