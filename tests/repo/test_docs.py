"""The docs agree with the code: every COMPILEDUMP_* name is in the config table and the table is in
the docs, every CLI flag is documented, every relative link resolves, the README stays short and
opens with the commands CI runs."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from compiledump import cli, config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A name, also as a CMake definition (-DCOMPILEDUMP_...).
NAME = re.compile(r"(?:(?<=-D)|(?<![A-Za-z0-9_]))COMPILEDUMP_[A-Z][A-Z0-9_]*")
# Where a COMPILEDUMP_* name may be used: the package, the docs, and what drives them.
SOURCES = [*sorted((REPO / "compiledump").rglob("*.py")), *DOCS, REPO / "setup.py", REPO / ".ci" / "run",
           *sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "benchmarks").glob("*.py")),
           *sorted((REPO / "scripts").glob("*.py")), *sorted((REPO / "examples").glob("*.py"))]
TABLE = {var.name for var in config.ENV_VARS} | set(config.CMAKE_OPTIONS)


def _names(paths) -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for path in paths:
        for name in NAME.findall(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(REPO)))
    return used


def test_every_variable_used_is_in_the_config_table():
    unknown = {name: where for name, where in _names(SOURCES).items() if name not in TABLE}
    assert unknown == {}


def test_every_variable_in_the_table_is_used_and_documented():
    used = _names([path for path in SOURCES if path not in DOCS])
    documented = _names(DOCS)
    for name in TABLE:
        assert name in documented, f"{name} is not documented in README.md or docs/"
    for var in config.ENV_VARS:
        assert var.name in used, f"{var.name} is in the table but nothing reads it"


def test_the_docs_variable_table_is_generated_from_the_config_table():
    spec = importlib.util.spec_from_file_location("write_docs_tables", REPO / "scripts" / "write_docs_tables.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = script.API_DOC.read_text()
    assert script.render(text) == text, "docs/api.md's variable table is stale: python scripts/write_docs_tables.py"


def test_env_reads_go_through_the_table():
    with pytest.raises(KeyError, match="not in compiledump.config.ENV_VARS"):
        config.env("COMPILEDUMP_" + "NOT_A_VARIABLE")
    assert config.env("COMPILEDUMP_MAX_STEPS", {}) == "256"
    assert config.env("COMPILEDUMP_MAX_STEPS", {"COMPILEDUMP_MAX_STEPS": "9"}) == "9"
    # Every Config field has its variable, and its default is the field's default.
    fields = {var.field: var for var in config.ENV_VARS if var.field}
    assert set(fields) == set(config.Config.__dataclass_fields__)
    assert config.from_env({}) == config.Config()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
        flags |= {option for option in action.option_strings if option.startswith("--") and option != "--help"}
    return flags


def test_every_cli_flag_is_documented():
    docs = "\n".join(path.read_text() for path in DOCS)
    missing = sorted(flag for flag in _flags(cli.build_parser()) if not re.search(rf"{re.escape(flag)}\b", docs))
    assert missing == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert broken == []


def test_readme_is_short_and_starts_with_the_ci_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = [line for line in readme.splitlines()[:20] if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and commands[0].endswith("compiledump demo") and commands[1].endswith("python -m pytest -n auto")
    assert commands[1] in (REPO / ".ci" / "run").read_text()


def test_history_words_stay_in_the_migration_page():
    pattern = re.compile(r"\b(seed|predecessor)\b", re.I)
    offenders = []
    for path in [*sorted((REPO / "compiledump").rglob("*.py")), *DOCS]:
        if path.name == "migrating.md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # Random seeds and the file's location (shared/seed/) are fine: the history's word must go.
            text = line.replace("shared/seed/", "")
            if pattern.search(text) and not re.search(r"manual_seed|random seed|seed=|\.seed\b|seed:|same seed", text):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


CALL_CELL = re.compile(r"^\| (`[^|]*`) \|")
CALL = re.compile(r"`((?:compiledump\.)?[\w.]*)\((.*?)\)`")


def _documented_calls(path: Path):
    """(qualified name, parameter text) of every call the first cell of a table row shows."""
    for line in path.read_text().splitlines():
        cell = CALL_CELL.match(line)
        if not cell:
            continue
        module = "compiledump"
        for name, params in CALL.findall(cell.group(1)):
            if name.startswith("compiledump."):
                module, name = name.rsplit(".", 1)
            elif name.startswith("."):  # `.package(ep, path)` after `compiledump.aot.export(...)`
                name = name[1:]
            yield f"{module}.{name}", params


def _documented_parameters(text: str) -> list[tuple[str, bool, str | None]]:
    """(name, keyword-only, default text) of a documented parameter list."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):  # split at the commas outside brackets
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    found, keyword_only = [], False
    for part in filter(None, parts):
        if part == "*":
            keyword_only = True
            continue
        name, _, default = part.partition("=")
        found.append((name.lstrip("*"), keyword_only or name.startswith("**"), default or None))
    return found


@pytest.mark.parametrize("doc", [REPO / "README.md", REPO / "docs" / "api.md"], ids=lambda p: p.name)
def test_documented_signatures_are_the_real_ones(doc):
    """Each call a table shows has the real parameters, in order, with the real keyword-only marker
    and literal defaults; docs/api.md (the reference) shows every parameter, the README may leave
    keyword-only ones out."""
    import ast
    import importlib
    import inspect

    calls = list(_documented_calls(doc))
    assert len(calls) >= 20, calls
    wrong = []
    for qualified, text in calls:
        module, name = qualified.rsplit(".", 1)
        real = inspect.signature(getattr(importlib.import_module(module), name)).parameters
        real_params = [(p.name, p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)) for p in real.values()]
        shown = _documented_parameters(text)
        if [(n, k) for n, k, _ in shown] != [(n, k) for n, k in real_params
                                           if doc.name == "api.md" or not k or (n, k) in {(s, t) for s, t, _ in shown}]:
            wrong.append(f"{qualified}({text}) but the real one is {name}{inspect.signature(getattr(importlib.import_module(module), name))}")
            continue
        for shown_name, _, default in shown:
            if default is None or default == "...":
                continue
            try:
                value = ast.literal_eval(default)
            except ValueError:  # a default shown as names (dtypes=(bf16, ...)): not a literal
                continue
            if real[shown_name].default != value:
                wrong.append(f"{qualified}: {shown_name}={default}, really {real[shown_name].default!r}")
    assert wrong == []
