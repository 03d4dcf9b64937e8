"""The package's shape: no import cycles, the reader side free of torch, no oversized modules, no
reaching into another module's private names, every module on the map a newcomer reads; every
test CI's pure lane leaves out still exists.

Imports are read from the source (every `import`, at module level or inside a function), so a
cycle hidden in a lazy import counts too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import lanes

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "compiledump"
MAX_LINES = 400  # "no module over ~400 lines" (the house rules); every module fits since 7f24eaf
# Modules that must run where torch is not installed: the on-disk format and the comparator.
TORCH_FREE = ("compiledump.format", "compiledump.compare")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, current: str) -> str:
    if level == 0:
        return module
    base = current.split(".") if _is_package(current) else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(name: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement of module `name`."""
    tree = ast.parse(MODULES[name].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((_resolve(node.module or "", node.level, name), [alias.name for alias in node.names]))
    return found


def internal_edges(name: str) -> set[str]:
    """The package modules that module `name` imports (a `from pkg import sub` names the submodule)."""
    edges = set()
    for target, names in imports(name):
        if not (target == "compiledump" or target.startswith("compiledump.")):
            continue
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        edges.update(subs)
        if len(subs) < len(names) or not names:
            edges.add(target)
    if name == "compiledump":  # the lazy public names (compiledump/__init__.py _LAZY)
        import compiledump

        edges.update(f"compiledump.{module}" for module in set(compiledump._LAZY.values()))
    return edges - {name}


GRAPH = {name: internal_edges(name) for name in MODULES}


def test_every_edge_names_a_module():
    for name, edges in GRAPH.items():
        assert edges <= set(MODULES), (name, edges - set(MODULES))


def test_no_import_cycles():
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert cycles == []


def _closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith(TORCH_FREE)])
def test_reader_side_imports_no_torch(name):
    for module in {name} | _closure(name):
        third_party = {target.split(".")[0] for target, _ in imports(module)}
        assert not third_party & {"torch", "triton"}, f"{name} reaches torch through {module}"


def test_reader_side_imports_no_torch_at_run_time():
    code = ("import sys, compiledump.cli, compiledump.compare, compiledump.compare.inspect, "
            "compiledump.format.reader, compiledump.format.writer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_every_module_is_on_the_map():
    """Each module is named in its package's docstring (the folder's inventory) and in its
    package's row of docs/architecture.md: a module added without either is found here."""
    rows = {line.split("|")[1].strip().strip("`"): line
            for line in (REPO / "docs" / "architecture.md").read_text().splitlines() if line.startswith("| `")}
    unmapped = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = path.parent
        if path.name == "__init__.py":
            continue
        if package != PACKAGE:
            inventory = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
            if path.name not in inventory and f":mod:`.{path.stem}`" not in inventory:
                unmapped.append(f"{path.relative_to(REPO)}: not in {package.name}/__init__.py's docstring")
        row = rows.get(f"{package.name}/") if package != PACKAGE else "\n".join(rows.values())
        if row is None or f"`{path.name}`" not in row:
            unmapped.append(f"{path.relative_to(REPO)}: not in docs/architecture.md's table")
    assert unmapped == []


@pytest.mark.parametrize("name", list(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines: split it by concern"


def test_other_module_size():
    """The tests', benchmarks', scripts' and examples' modules too: past the limit, a file holds more
    than one concern."""
    over = [f"{path.relative_to(REPO)}: {n} lines" for folder in ("tests", "benchmarks", "scripts", "examples")
            for path in sorted((REPO / folder).rglob("*.py")) if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert over == [], "split by what they test: " + ", ".join(over)


def _private_uses(name: str) -> list[str]:
    """`from compiledump.x import _private` and `module_alias._private` of package modules."""
    tree = ast.parse(MODULES[name].read_text())
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, name)
            if not target.startswith("compiledump"):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__") and target != name:
                    found.append(f"from {target} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("compiledump") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


@pytest.mark.parametrize("name", list(MODULES))
def test_no_reaching_into_private_names(name):
    assert _private_uses(name) == []


@pytest.mark.parametrize("entry", sorted(lanes.NATIVE_LANE_ONLY))
def test_every_pure_lane_exclusion_names_a_test(entry):
    """Each test tests/helpers/lanes.py leaves out of CI's pure lane still exists: a renamed file
    or test would otherwise be left out silently, or run again without anyone deciding it."""
    path, _, name = entry.partition("::")
    target = REPO / "tests" / path
    assert target.exists(), f"{entry}: no {target}"
    if name:
        assert re.search(rf"^def {re.escape(name)}", target.read_text(), re.M), f"{entry}: no such test in {path}"
