"""`kernel run -- CMD` and the real readers of its output: one that goes away (`| head -1`),
before or after the command exited, in --json mode too; one too slow when the run
stops (`--timeout` with `| (sleep 5; cat)`); a full disk (`> /dev/full`). The installed
executable, real pipes; every wait polls the journal with a generous bound.

Before: a reader that went away ended the run `cancelled` (exit 130) even when the
command had already exited 3 or 0; a run stopped with a slow reader waited a second
more on it (reported as runtime) and then gave up what was still in the pipes
(`output_not_read`); `> /dev/full` exited 1 with no word of why, its summary line
saying "(exit 0)".
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from test_run_cli import kernel

pytestmark = pytest.mark.realtime

#: Far more than any of these runs takes (never a measure of speed).
BOUND = 120.0

#: What must never reach our stderr, whatever the reader did.
NOISE = ("Traceback", "Exception ignored", "BrokenPipeError")


def query(exe: str, env: dict[str, str], sql: str) -> list[dict[str, Any]]:
    proc = kernel(exe, env, "query", "--format", "json", sql)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def the_run(exe: str, env: dict[str, str]) -> dict[str, Any]:
    [row] = query(exe, env, "SELECT status, reason, error, runtime_seconds FROM runs")
    return row


def kinds(exe: str, env: dict[str, str]) -> list[str]:
    return [r["kind"] for r in query(exe, env, "SELECT kind FROM events ORDER BY seq")]


def stdout_lines(exe: str, env: dict[str, str]) -> int:
    """Lines of stdout the journal has: `output` events, and those counted past the cap."""
    [row] = query(exe, env, "SELECT (SELECT count(*) FROM events WHERE kind = 'output' AND "
                            "name = 'stdout') AS audited, (SELECT json_extract(payload, "
                            "'$.lines') FROM events WHERE kind = 'output_not_audited') AS more")
    return int(row["audited"]) + int(row["more"] or 0)


def process_exited(env: dict[str, str]) -> bool:
    """Whether the journal has the command's `process_exit` (read-only, while it runs)."""
    journal = Path(env["KERNEL_DB"] + ".journal")
    if not journal.exists():
        return False
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
        try:
            return con.execute("SELECT 1 FROM events WHERE kind = 'process_exit'"
                               ).fetchone() is not None
        except sqlite3.OperationalError:
            return False


def wait_for(cond: Any, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + BOUND
    while not cond():
        assert proc.poll() is None, f"kernel run ended before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {BOUND:.0f}s"
        time.sleep(0.02)


def start(exe: str, env: dict[str, str], *args: str, stderr: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([exe, "run", *args], stdout=subprocess.PIPE, stderr=stderr,
                            stdin=subprocess.DEVNULL, env=env)


class TestReaderGone:
    def test_while_the_command_runs_its_status_wins(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """`kernel run -- sh -c 'seq 1 200000; exit 3' | head -1`: seq dies of SIGPIPE, sh
        exits 3, as in a shell pipeline: exit 3, the run error with the command's code
        (before: cancelled, exit 130), no traceback or BrokenPipeError noise."""
        err = tmp_path / "stderr"
        with err.open("wb") as sink:
            p = start(kernel_exe, cli_env, "--timeout", "600", "--", "sh", "-c",
                      "seq 1 200000; exit 3", stderr=sink)
            assert p.stdout is not None
            assert p.stdout.readline() == b"1\n"
            p.stdout.close()  # head -1 has its line
            code = p.wait(timeout=BOUND)
        text = err.read_text()
        assert code == 3, text
        assert not any(n in text for n in NOISE), text
        assert text.count("\n") == 1, text  # the summary line, nothing else
        assert text.endswith(": command exited with code 3 (exit 3)\n"), text
        row = the_run(kernel_exe, cli_env)
        assert (row["status"], row["error"]) == ("error", "command exited with code 3")
        assert "output_reader_gone" in kinds(kernel_exe, cli_env)

    @pytest.mark.parametrize(("code", "status"), [(0, "ok"), (3, "error")])
    def test_after_the_command_exited_its_status_wins_and_every_line_is_audited(
            self, code: int, status: str, kernel_exe: str, cli_env: dict[str, str],
            tmp_path: Path) -> None:
        """The command has exited (its last 45 KB still in the pipe behind a full echo)
        when the reader takes one line and goes: its own status (ok/0, error/3) ends the
        run (before: cancelled, 130) and all 20,000 lines are in the journal."""
        err = tmp_path / "stderr"
        with err.open("wb") as sink:
            p = start(kernel_exe, cli_env, "--timeout", "600", "--", "sh", "-c",
                      f"seq 1 20000; exit {code}", stderr=sink)
            try:
                wait_for(lambda: process_exited(cli_env), "the command's exit", p)
                assert p.stdout is not None
                assert p.stdout.readline() == b"1\n"
                p.stdout.close()
                got = p.wait(timeout=BOUND)
            finally:
                p.kill()
                p.wait()
        text = err.read_text()
        assert got == code, text
        assert not any(n in text for n in NOISE), text
        assert text.endswith(f"(exit {code})\n"), text
        assert the_run(kernel_exe, cli_env)["status"] == status
        assert stdout_lines(kernel_exe, cli_env) == 20000
        assert "output_not_read" not in kinds(kernel_exe, cli_env)

    def test_json_mode_a_stderr_reader_gone(self, kernel_exe: str,
                                            cli_env: dict[str, str]) -> None:
        """`kernel run --json` echoes only stderr: its reader going away is met by the
        command on its stderr; the JSON result still has the command's own status."""
        p = start(kernel_exe, cli_env, "--json", "--timeout", "600", "--", "sh", "-c",
                  "seq 1 200000 >&2; exit 3", stderr=subprocess.PIPE)
        try:
            assert p.stderr is not None and p.stdout is not None
            assert p.stderr.readline() == b"1\n"
            p.stderr.close()
            out = p.stdout.read()
            assert p.wait(timeout=BOUND) == 3
        finally:
            p.kill()
            p.wait()
        doc = json.loads(out)
        assert (doc["status"], doc["exit_code"], doc["command_exit_code"]) == ("error", 3, 3)


class TestStoppedWithASlowReader:
    def test_the_stop_does_not_wait_on_the_reader(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """`kernel run --timeout 3 -- ... | (sleep 5; cat)`: at the deadline the echo is no
        longer waited for; what is left in the pipes is read for the journal at once (it
        was waited on for a second more, counted as runtime, then given up:
        `output_not_read`), and one line says how much was not echoed."""
        err = tmp_path / "stderr"
        with err.open("wb") as sink:
            p = start(kernel_exe, cli_env, "--timeout", "3", "--", "sh", "-c",
                      "seq 1 15000; exec sleep 300", stderr=sink)
            try:
                code = p.wait(timeout=BOUND)  # its stdout is read only afterwards
            finally:
                p.kill()
                p.wait()
        text = err.read_text()
        assert code == 124, text
        assert the_run(kernel_exe, cli_env)["status"] == "timeout"
        assert "output_not_read" not in kinds(kernel_exe, cli_env)
        assert not any(n in text for n in NOISE), text
        warning, summary = text.splitlines()
        assert warning.startswith("kernel: warning: ") and warning.endswith(
            " bytes of output were not echoed to stdout: the run stopped while its reader "
            "was not keeping up"), text
        assert " timeout after " in summary


class TestDiskFull:
    def test_a_command_that_succeeded(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run -- echo hi > /dev/full`: one line says the output could not be
        written and why; exit 1 (like any program whose output is lost), and the summary
        says so (it said "(exit 0)" and exited 1); the run itself is ok."""
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([kernel_exe, "run", "--", "echo", "hi"], stdout=full,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  env=cli_env, timeout=BOUND)
        text = proc.stderr.decode()
        assert proc.returncode == 1, text
        warning, summary = text.splitlines()
        assert warning == ("kernel: warning: cannot write the command's output to stdout "
                           "(No space left on device): it is no longer shown there")
        assert summary.endswith(" ok after " + summary.split(" ok after ")[1])
        assert summary.endswith("(exit 1: its output could not all be written)"), text
        assert the_run(kernel_exe, cli_env)["status"] == "ok"

    def test_a_command_that_failed_keeps_its_code(self, kernel_exe: str,
                                                  cli_env: dict[str, str]) -> None:
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([kernel_exe, "run", "--", "sh", "-c", "echo hi; exit 3"],
                                  stdout=full, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, env=cli_env, timeout=BOUND)
        text = proc.stderr.decode()
        assert proc.returncode == 3, text
        assert text.splitlines()[0].startswith("kernel: warning: cannot write ")
        assert text.endswith(": command exited with code 3 (exit 3)\n"), text

    def test_json_result_to_a_full_disk(self, kernel_exe: str,
                                        cli_env: dict[str, str]) -> None:
        """The --json result itself cannot be written: said in one line, exit 1."""
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([kernel_exe, "run", "--json", "--", "true"], stdout=full,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  env=cli_env, timeout=BOUND)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.decode() == (
            "kernel: warning: cannot write the result to stdout (No space left on device): "
            "it is no longer shown there\n")
