"""Write kernels/schemas.h from compiledump/ops/schemas.py SCHEMAS.

C++-only processes (the AOTInductor driver) have no Python to define the op schemas, so the
native library defines them from this header there (kernels/schemas.cpp). Run this after
changing a schema; tests/export/test_aot.py fails while the header is stale.

    python scripts/write_schemas_header.py          # rewrite the header
    python scripts/write_schemas_header.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

HEADER = Path(__file__).resolve().parents[1] / "kernels" / "schemas.h"


def render() -> str:
    """kernels/schemas.h as it must read."""
    from compiledump.ops.schemas import SCHEMAS

    entries = "".join(f'    "{schema}",\n' for schema in SCHEMAS.values())
    return (
        "// The `compiledump` op schemas, for processes without Python (kernels/schemas.cpp defines\n"
        "// them there). Generated from compiledump/ops/schemas.py SCHEMAS by\n"
        "// `python scripts/write_schemas_header.py`; tests/export/test_aot.py checks it is current.\n"
        "#pragma once\n\n"
        "namespace compiledump {\n\n"
        f"constexpr const char* kSchemas[] = {{\n{entries}}};\n\n"
        "}  // namespace compiledump\n"
    )


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    text = render()
    if argv == ["--check"]:
        current = HEADER.read_text() == text
        print(f"{HEADER}: {'current' if current else 'stale'}")
        return 0 if current else 1
    HEADER.write_text(text)
    print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
