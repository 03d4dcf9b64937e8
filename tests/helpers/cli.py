"""The CLI run in process, as the compare and inspect tests call it."""

from compiledump.cli import main


def run_cli(capsys, *argv) -> tuple[int, list[str], list[str]]:
    """Run `compiledump ARGV` in process; return (exit status, stdout lines, stderr lines)."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()
