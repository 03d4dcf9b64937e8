"""Write the generated parts of docs/: the environment-variable table of docs/api.md, from
compiledump/config.py ENV_VARS (the one table of every COMPILEDUMP_* variable).

    python scripts/write_docs_tables.py          # rewrite
    python scripts/write_docs_tables.py --check  # exit 1 if stale (tests/repo/test_docs.py checks it too)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
START, END = "<!-- env-table:start -->\n", "<!-- env-table:end -->"
_BLOCK = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)


def render(text: str) -> str:
    """`text` (docs/api.md) with the table between its markers regenerated."""
    from compiledump.config import env_table

    if not _BLOCK.search(text):
        raise ValueError(f"{API_DOC} has no {START.strip()} ... {END} block")
    return _BLOCK.sub(lambda _: START + env_table() + END, text, count=1)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    text = API_DOC.read_text()
    new = render(text)
    if argv == ["--check"]:
        print(f"{API_DOC}: {'current' if new == text else 'stale'}")
        return 0 if new == text else 1
    API_DOC.write_text(new)
    print(f"wrote {API_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
