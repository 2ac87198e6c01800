"""Errors become exit codes in the CLI package only: the library never ends the process."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("kernel", "batteries", "adapters")
# Calls and names that end the process or turn an error into an exit status.
EXITS = {"sys.exit", "os._exit", "exit", "quit", "SystemExit", "typer.Exit"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def exits_in(path: Path, root: Path = ROOT) -> list[str]:
    """Every place in `path` that calls or raises one of EXITS, as `file:line name`."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else (
            node.exc if isinstance(node, ast.Raise) and node.exc is not None else None)
        if isinstance(target, ast.Call):
            target = target.func
        if target is not None and _dotted(target) in EXITS:
            found.add(f"{path.relative_to(root)}:{node.lineno} {_dotted(target)}")
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "typer" or n.startswith(("typer.", "click")) for n in names):
                found.add(f"{path.relative_to(root)}:{node.lineno} imports the CLI toolkit")
    return sorted(found)


def test_the_library_never_exits() -> None:
    """kernel/, batteries/ and adapters/ neither call sys.exit/os._exit nor raise SystemExit."""
    found = [hit for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))
             for hit in exits_in(path)]
    assert found == []


def test_the_check_sees_an_exit(tmp_path: Path) -> None:
    """The scan reports each way of exiting (so the test above can fail)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import sys, os\nimport typer\n"
                      "def f():\n    sys.exit(2)\n"
                      "def g():\n    raise SystemExit(1)\n"
                      "def h():\n    os._exit(3)\n")
    assert exits_in(sample, tmp_path) == [
        "sample.py:2 imports the CLI toolkit", "sample.py:4 sys.exit",
        "sample.py:6 SystemExit", "sample.py:8 os._exit"]
