"""The README's examples are run, so they cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


class TestReadme:
    def test_library_examples_run(self) -> None:
        """Every python block in the README runs without error (they assert their results)."""
        blocks = python_blocks()
        assert blocks, "the README has no python example"
        for block in blocks:
            exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})

    def test_ci_runs_the_readme_test_command(self) -> None:
        """.ci/run contains the README's test command verbatim."""
        sh = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
        test_cmd = next(b.strip() for b in sh if "pytest" in b)
        ci = (README.parent / ".ci" / "run").read_text()
        assert test_cmd in ci
