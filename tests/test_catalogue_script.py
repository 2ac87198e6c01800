"""bench/little_loops_catalogue.py on a small self-written catalogue (nothing is fetched)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "little_loops_catalogue.py"

FILES = {
    "lib/base.yaml": "name: base\ncategory: demo\nstates:\n  done: {terminal: true}\n",
    "extends.yaml": "name: extends\nfrom: lib/base\ninitial: go\n"
                    "states:\n  go: {action: 'echo ${context.run_dir}', next: done}\n",
    "needs-input.yaml": "name: needs\ninitial: a\nrequired_inputs: [input]\n"
                        "states:\n  a: {action: 'echo ${context.input}', next: done}\n"
                        "  done: {terminal: true}\n",
    "no-route.yaml": "name: noroute\ninitial: a\nstates:\n  a: {action: 'true', on_no: b}\n"
                     "  b: {terminal: true}\n",
    "broken.yaml": "name: broken\ninitial: a\nstates:\n  a: {next: nowhere}\n",
}


@pytest.mark.realtime
class TestCatalogueScript:
    def test_counts_and_lists_a_catalogue(self, tmp_path: Path) -> None:
        """Given a checkout layout, it prints how many validate and dry-run, and why not."""
        loops = tmp_path / "scripts" / "little_loops" / "loops"
        for name, text in FILES.items():
            (loops / name).parent.mkdir(parents=True, exist_ok=True)
            (loops / name).write_text(text)
        proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--list"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith("5 catalogue files: 3 validate (")
        assert lines[0].endswith(", 2 dry-run (--scenario all-pass)")
        assert any(line.startswith("refused: lib/base.yaml: ") and "missing 'initial'" in line
                   for line in lines)
        assert any(line.startswith("refused: broken.yaml: ") and "nowhere" in line
                   for line in lines)
        assert any(line.startswith("no dry run: no-route.yaml: ")
                   and "no valid transition" in line for line in lines)

    def test_without_a_checkout_it_skips_cleanly(self, tmp_path: Path) -> None:
        """No catalogue at the path: a note and exit 0."""
        proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0
        assert "nothing to do" in proc.stdout
