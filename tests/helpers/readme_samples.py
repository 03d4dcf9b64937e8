"""The README's sample output, held to what its commands print now.

Each line a sample shows must match a printed line, in the printed order. Numbers are free (the
values differ from machine to machine; the line's shape, its words and its key names are what a
reader relies on), and `...` stands for whatever the README shortened.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
_PIECES = re.compile(rf"(\.\.\.|{_NUMBER})")


def block_after(marker: str) -> list[str]:
    """The lines of the first fenced block after the README line that contains `marker`."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    opening = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    return lines[opening + 1:closing]


def console_output(block: list[str], command: str) -> list[str]:
    """What a console block shows the command starting with `$ <command>` print (up to the next `$`)."""
    start = next(i for i, line in enumerate(block) if line.startswith(f"$ {command}"))
    end = next((i for i in range(start + 1, len(block)) if block[i].startswith("$ ")), len(block))
    return block[start + 1:end]


def _pattern(line: str) -> re.Pattern:
    regex = "".join(".*" if piece == "..." else _NUMBER if re.fullmatch(_NUMBER, piece) else re.escape(piece)
                    for piece in _PIECES.split(line))
    return re.compile(regex)


def unmatched(sample: list[str], printed: list[str]) -> list[str]:
    """The sample's lines that no printed line matches in order: empty when the README is right."""
    missing, at = [], 0
    for line in sample:
        pattern = _pattern(line)
        found = next((i for i in range(at, len(printed)) if pattern.fullmatch(printed[i])), None)
        if found is None:
            missing.append(line)
        else:
            at = found + 1
    return missing
