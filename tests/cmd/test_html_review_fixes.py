"""`kernel show --html` and `kernel report` pages under hostile or extreme runs (review fixes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest

#: Control characters an HTML document may not hold (tab, LF, FF and CR may).
CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


def kernel(exe: str, env: dict[str, str], *args: str,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=cwd)


@pytest.mark.realtime
class TestPageSize:
    def test_a_report_over_a_century_is_small(self, kernel_exe: str, cli_env: dict[str, str],
                                              tmp_path: Path) -> None:
        """`kernel report FILE --since 36500d` ("everything") of one short run: the time axis
        keeps a handful of ticks, so the page is kilobytes, not ~60 MB of tick marks."""
        assert kernel(kernel_exe, cli_env, "run", "--", "true").returncode == 0
        page = tmp_path / "all.html"
        proc = kernel(kernel_exe, cli_env, "report", str(page), "--since", "36500d")
        assert proc.returncode == 0, proc.stderr
        html = page.read_text()
        assert len(html) < 200_000, len(html)
        overview = html[html.index('<svg id="overview"'):]
        overview = overview[:overview.index("</svg>")]
        assert 2 <= overview.count('class="tick"') <= 20
        labels = re.findall(r'class="tick-label"[^>]*>([^<]*)<', overview)
        assert all(re.fullmatch(r"\d+(\.\d+)?(ms|s|m|h|d)", label) for label in labels), labels


def page_of(run: dict[str, object], events: list[dict[str, object]]) -> str:
    """`render` in a child process, so a page that never finishes fails the test, not the suite."""
    code = textwrap.dedent("""
        import json, sys
        from datetime import datetime
        from kernel_cli.timeline_html import render
        run, events = json.load(sys.stdin)
        if run.get("started_at"):
            run["started_at"] = datetime.fromisoformat(run["started_at"])
        run["runtime_seconds"] = float(run["runtime_seconds"])
        sys.stdout.buffer.write(render(run, events).encode())
    """)
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps([run, events]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


class TestExtremeTimelines:
    def test_a_clock_jump_of_decades_keeps_the_page_small(self) -> None:
        """A run whose clock was stepped by decades mid-run (a board without a real-time
        clock that booted in 1970) spans ~56 years: still a handful of axis ticks."""
        run = {"run_id": "r1", "status": "ok", "runtime_seconds": "1",
               "started_at": datetime(2026, 1, 1, tzinfo=UTC).isoformat()}
        events = [{"kind": "run_start", "offset_ms": 0},
                  {"kind": "step", "offset_ms": 1.77e12, "duration_ms": 5, "name": "s"}]
        html = page_of(run, events)
        assert len(html) < 200_000, len(html)
        gantt = html[html.index('<svg id="timeline"'):]
        assert 2 <= gantt[:gantt.index("</svg>")].count('class="tick"') <= 20

    @pytest.mark.parametrize("runtime", ["inf", "nan", "-inf"])
    def test_a_runtime_that_is_not_a_number_still_renders(self, runtime: str) -> None:
        """A `runtime_seconds` that is infinite or NaN (a row written by another tool) is
        ignored: the page is drawn from the events, and drawing it ends."""
        run = {"run_id": "r2", "status": "ok", "runtime_seconds": runtime}
        events = [{"kind": "run_start", "offset_ms": 0},
                  {"kind": "step", "offset_ms": 40, "duration_ms": 30, "name": "s"}]
        html = page_of(run, events)
        assert "nan" not in re.sub(r"<style>.*?</style>", "", html, flags=re.S).lower()
        assert 'class="bar step"' in html

    def test_lone_surrogates_and_controls_make_a_writable_page(self) -> None:
        """Text that is not valid UTF-8 (a lone surrogate) or that HTML may not hold (NUL,
        escape) anywhere in the run: the page still encodes as UTF-8 and holds neither."""
        from kernel_cli.timeline_html import render

        bad = "x\udcff\x00\x1b[31m\x7f</script>"
        run = {"run_id": "r3", "name": bad, "status": "error", "error": bad,
               "runtime_seconds": 1.0}
        events = [{"kind": "state_enter", "offset_ms": 0, "name": bad, "payload": {"state": bad}},
                  {"kind": "tool_start", "offset_ms": 1, "name": bad, "payload": {}},
                  {"kind": "tool_end", "offset_ms": 2, "name": bad, "payload": {"error": bad}},
                  {"kind": "critic", "offset_ms": 3, "name": "kill", "payload": {"reason": bad}}]
        html = render(run, events)
        html.encode("utf-8")  # raises on a lone surrogate
        assert not CONTROL.search(html)
        assert "</script><" not in html.replace("</script></body>", "")


@pytest.mark.realtime
class TestHostileLoop:
    def test_nul_in_a_loop_state_never_reaches_the_page(self, kernel_exe: str,
                                                        cli_env: dict[str, str],
                                                        tmp_path: Path) -> None:
        """A loop whose name and state names hold NUL and markup (YAML's "\\0"): the HTML file
        holds no control character (an HTML parse error) and the markup stays text."""
        loop = tmp_path / "nul.yaml"
        loop.write_text(textwrap.dedent("""\
            name: "nul\\0name</title><script>bad()</script>"
            initial: "a\\0<script>b"
            states:
              "a\\0<script>b":
                action: "printf 'x\\\\000y\\\\033[2J'"
                next: done
              done:
                terminal: true
            """))
        proc = kernel(kernel_exe, cli_env, "run", "--json", str(loop), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        run_id = json.loads(proc.stdout)["run_id"]
        page = tmp_path / "t.html"
        proc = kernel(kernel_exe, cli_env, "show", run_id, "--html", str(page))
        assert proc.returncode == 0, proc.stderr
        html = page.read_bytes().decode("utf-8")
        assert not CONTROL.search(html), CONTROL.findall(html)
        assert html.count("<script>") == 1 and "bad()</script>" not in html
        assert "&lt;script&gt;b" in html


class TestPrivatePage:
    def test_a_page_written_over_a_readable_file_is_made_private(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """The page holds what the audit holds: written over an existing 0644 file, the file
        ends 0600 (it kept 0644, readable by others, against what README promises)."""
        import os
        import stat

        assert kernel(kernel_exe, cli_env, "run", "--", "true").returncode == 0
        for args in (["show", "last", "--html"], ["report"]):
            page = tmp_path / f"{args[0]}.html"
            page.write_text("old")
            page.chmod(0o644)
            got = kernel(kernel_exe, cli_env, *args, str(page))
            assert got.returncode == 0, got.stderr
            assert stat.S_IMODE(os.stat(page).st_mode) == 0o600, args
            assert "<!DOCTYPE html>" in page.read_text()
