"""docs/cli.md, the CLI reference, is generated from `--help` and must be current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class TestCliReference:
    def test_docs_cli_md_is_what_gen_cli_writes(self) -> None:
        """Regenerating the reference gives docs/cli.md byte for byte (else run docs/gen_cli.py)."""
        proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--check"],
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr

    def test_every_command_is_in_the_reference(self) -> None:
        """Each command `kernel --help` lists has its own section."""
        text = (ROOT / "docs" / "cli.md").read_text()
        for name in ("run", "runs", "show", "stats", "query", "resume", "actions run",
                     "budget set"):
            assert f"## `kernel {name}`" in text, name

    def test_help_shows_no_typer_internals(self) -> None:
        """No Python type names (`<str>`, `<int range>`, `<list[str]>`) nor `{ARG}` usage."""
        text = (ROOT / "docs" / "cli.md").read_text()
        assert not re.findall(r"<(?:str|int|float|bool|path|list\[[a-z]+\])(?: range)?>", text)
        assert not re.findall(r"(?<!\$)\{[A-Za-z_.]+\}", text)  # ${context.x} is loop syntax
