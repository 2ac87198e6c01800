"""`kernel run` at the edges of its output: a reader that goes away, closed stdio, quiet
modes, bad commands and context keys, control characters in its messages (real time, the
installed executable in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_run_cli import kernel, sleeps_with

pytestmark = pytest.mark.realtime

#: Far more than any of these runs takes, far less than the --timeout they are given:
#: a run that goes on to its deadline fails the test, a loaded machine does not.
BOUND = 60.0


def runs(exe: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every recorded run (newest first), from the audit."""
    proc = kernel(exe, env, "query", "--format", "json",
                  "SELECT status, reason, error, output FROM runs ORDER BY started_at DESC")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def with_closed(fds: str, exe: str, env: dict[str, str], *args: str,
                stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    """`kernel ARGS` started with some of its standard descriptors closed (`>&-`, `2>&-`)."""
    return subprocess.run(["sh", "-c", f'exec "$@" {fds}', "sh", exe, *args],
                          stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                          env=env, timeout=BOUND)


class TestReaderGone:
    """A reader of the echo that goes away (`| head -1`): the command meets the closed pipe
    at its next write, as in a shell pipeline (SIGPIPE), and its own status ends the run
    (before: the run was cancelled, exit 130, whatever the command did)."""

    def test_yes_into_a_closed_pipe_dies_of_sigpipe(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """`kernel run --timeout 120 -- yes | head -1`: yes is killed by SIGPIPE long before
        the deadline: exit 141 (128+13, as `${PIPESTATUS[0]}` of `yes | head -1`), the run
        recorded error with the signal named, no traceback."""
        err = tmp_path / "stderr"
        with err.open("wb") as sink:
            p = subprocess.Popen([kernel_exe, "run", "--timeout", "120", "--", "yes"],
                                 stdout=subprocess.PIPE, stderr=sink,
                                 stdin=subprocess.DEVNULL, env=cli_env)
            assert p.stdout is not None
            assert p.stdout.readline() == b"y\n"
            p.stdout.close()  # what head does once it has its line
            code = p.wait(timeout=BOUND * 2)
        text = err.read_text()
        assert code == 141, text  # (the 120 s deadline would have ended it 124)
        assert "Traceback" not in text and "Exception" not in text, text
        summary = text.splitlines()[-1]
        assert " error after " in summary, text
        assert summary.endswith(": command was killed by signal 13 (SIGPIPE) (exit 141)"), text
        [row] = runs(kernel_exe, cli_env)
        assert (row["status"], row["reason"], row["error"]) == (
            "error", None, "command was killed by signal 13 (SIGPIPE)")

    def test_a_write_after_the_reader_left_stops_the_command(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """`sh -c 'echo a; ...; echo b; sleep 300' | true`: the reader leaves while the
        command is silent; `kernel run` sees it (not only at the next chunk) and closes the
        command's pipe, so the write of b kills sh (SIGPIPE), as in a shell, and the sleep
        never starts."""
        fifo = tmp_path / "go"
        os.mkfifo(fifo)
        marker = "sleep 300.417"
        p = subprocess.Popen([kernel_exe, "run", "--timeout", "120", "--", "sh", "-c",
                              f"echo a; read x < {fifo}; echo b; exec {marker}"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, env=cli_env)
        assert p.stdout is not None
        assert p.stdout.readline() == b"a\n"
        p.stdout.close()
        # (A write in the instant between the reader leaving and `kernel run` seeing it
        # would still go through: the command is let go on once that is recorded.)
        journal = Path(cli_env["KERNEL_DB"] + ".journal")
        deadline = time.monotonic() + BOUND
        while not _has_event(journal, "output_reader_gone"):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        with fifo.open("w") as go:  # opens once the command waits on it
            go.write("go\n")
        assert p.wait(timeout=BOUND * 2) == 141  # (not 124: its deadline is 120 s)
        assert sleeps_with(marker) == []
        [row] = runs(kernel_exe, cli_env)
        assert (row["status"], row["error"]) == (
            "error", "command was killed by signal 13 (SIGPIPE)")

    def test_a_closed_stderr_pipe_is_the_same(self, kernel_exe: str,
                                               cli_env: dict[str, str]) -> None:
        """The echo of the command's stderr going to a reader that left: the command's next
        write to its stderr gets SIGPIPE too."""
        p = subprocess.Popen([kernel_exe, "run", "--timeout", "120", "--", "sh", "-c",
                              "exec yes err >&2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, env=cli_env)
        assert p.stderr is not None
        assert p.stderr.readline() == b"err\n"
        p.stderr.close()
        assert p.wait(timeout=BOUND * 2) == 141
        [row] = runs(kernel_exe, cli_env)
        assert row["status"] == "error"
        assert row["error"] == "command was killed by signal 13 (SIGPIPE): err"


class TestClosedStdio:
    """`kernel ... >&-`, `2>&-`, `<&-`: the command runs and is recorded as it should be."""

    @pytest.mark.parametrize("json_out", [False, True], ids=["echo", "json"])
    def test_closed_stdout(self, json_out: bool, kernel_exe: str,
                           cli_env: dict[str, str]) -> None:
        """With stdout closed the run still runs and is recorded ok; its output goes nowhere."""
        flags = ["--json"] if json_out else []
        proc = with_closed(">&-", kernel_exe, cli_env, "run", *flags, "--", "echo", "hi",
                           stdout=None)
        err = proc.stderr.decode()
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "Error" not in err, err
        [row] = runs(kernel_exe, cli_env)
        assert (row["status"], row["output"], row["error"]) == ("ok", "hi", None)

    def test_closed_stderr(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """With stderr closed the command runs, echoes its stdout, and is recorded ok."""
        proc = with_closed("2>&-", kernel_exe, cli_env, "run", "--", "sh", "-c",
                           "echo hi; echo err >&2")
        assert proc.returncode == 0
        assert proc.stdout == b"hi\n"
        [row] = runs(kernel_exe, cli_env)
        assert (row["status"], row["output"]) == ("ok", "hi")

    def test_closed_stdin(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """With stdin closed the command reads an empty stdin (not a closed or foreign one)."""
        proc = with_closed("<&-", kernel_exe, cli_env, "run", "--", "sh", "-c",
                           "cat && echo done")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == b"done\n"

    @pytest.mark.parametrize("args", [["runs"], ["show", "last"], ["--version"]],
                             ids=["runs", "show", "version"])
    def test_other_commands_with_stdout_closed(self, args: list[str], kernel_exe: str,
                                               cli_env: dict[str, str]) -> None:
        """Commands that print, with stdout closed: exit 0 and nothing on stderr."""
        assert kernel(kernel_exe, cli_env, "run", "--", "true").returncode == 0
        proc = with_closed(">&-", kernel_exe, cli_env, *args, stdout=None)
        assert (proc.returncode, proc.stderr) == (0, b"")


class TestQuietKeepsStderr:
    """-q and --json keep stdout clean; the command's stderr still reaches ours."""

    def test_quiet(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run -q`: nothing on stdout; the command's stderr, then the summary line."""
        proc = kernel(kernel_exe, cli_env, "run", "-q", "--", "sh", "-c",
                      "echo out; echo err >&2")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""
        first, summary = proc.stderr.splitlines()
        assert first == "err" and summary.startswith("kernel: run ")

    def test_json(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run --json`: one JSON object on stdout; the command's stderr on stderr."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--", "sh", "-c",
                      "echo out; echo err >&2")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["output"] == "out" and proc.stdout.count("\n") == 1
        assert proc.stderr == "err\n"

    def test_help_says_so(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run --help` says what -q and --json do with the command's stderr."""
        text = " ".join(kernel(kernel_exe, cli_env, "run", "--help").stdout.split())
        json_help = text.split("--json ", 1)[1].split(" -q, --quiet ", 1)[0]
        quiet_help = text.split(" -q, --quiet ", 1)[1]
        for said in (json_help, quiet_help):
            assert "writes on stderr still passes through to stderr" in said, said


class TestBadInput:
    """Bad input: one line, exit 2, nothing run or recorded."""

    @pytest.mark.parametrize("args", [["--", ""], [""], ["--", "", "x"]],
                             ids=["after-dashes", "alone", "with-args"])
    def test_empty_command(self, args: list[str], kernel_exe: str, cli_env: dict[str, str],
                           tmp_path: Path) -> None:
        """`kernel run -- ''` is refused before anything runs."""
        proc = kernel(kernel_exe, cli_env, "run", *args)
        assert proc.returncode == 2
        assert proc.stderr == "kernel run: error: the command is empty: give -- CMD [ARGS...]\n"
        assert not list(tmp_path.glob("kernel.duckdb*"))  # nothing opened, nothing recorded

    @pytest.mark.parametrize("args", [["run", "--caller", "a\nb", "--", "true"],
                                      ["budget", "set", "", "--runs", "1"],
                                      ["budget", "set", "x\ty", "--runs", "1"]])
    def test_a_caller_id_that_cannot_be_one(self, args: list[str], kernel_exe: str,
                                            cli_env: dict[str, str], tmp_path: Path) -> None:
        """An empty caller id, or one with a line break or tab: one line, exit 2, nothing
        recorded (a budget for it could never be matched, or would print as two lines)."""
        proc = kernel(kernel_exe, cli_env, *args)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "caller id" in proc.stderr
        assert not list(tmp_path.glob("kernel.duckdb*"))

    def test_a_loop_file_with_a_command_is_refused(self, kernel_exe: str,
                                                    cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
        """`kernel run loop.yaml -- echo hi` is one of two things by mistake: exit 2, saying
        so, rather than trying to execute the YAML file (exit 127)."""
        loop = tmp_path / "loop.yaml"
        loop.write_text("initial: a\nstates:\n  a: {terminal: true}\n")
        proc = kernel(kernel_exe, cli_env, "run", str(loop), "--", "echo", "hi")
        assert proc.returncode == 2
        assert proc.stderr == (f"kernel run: error: a loop file runs alone: {loop} was given "
                               "with 'echo hi' (context goes in -c KEY=VALUE)\n")
        assert not list(tmp_path.glob("kernel.duckdb*"))

    @pytest.mark.parametrize(("first", "second", "var"), [
        ("a-b", "a.b", "KERNEL_CTX_A_B"), ("a", "A", "KERNEL_CTX_A"),
        ("x_y", "X-Y", "KERNEL_CTX_X_Y")])
    def test_context_keys_that_make_one_variable(self, first: str, second: str, var: str,
                                                 kernel_exe: str, cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
        """Two --context keys the command would see as one variable: exit 2, both named,
        nothing recorded."""
        proc = kernel(kernel_exe, cli_env, "run", "-c", f"{first}=1", "-c", f"{second}=2",
                      "--", "true")
        assert proc.returncode == 2
        assert proc.stderr == (f"kernel run: error: --context keys {first!r} and {second!r} "
                               f"are both ${var}: use one of them\n")
        assert not list(tmp_path.glob("kernel.duckdb*"))
        # The same key twice is one variable: the last value, as before.
        proc = kernel(kernel_exe, cli_env, "run", "-c", f"{first}=1", "-c", f"{first}=2",
                      "--", "sh", "-c", f'echo "${var}"')
        assert (proc.returncode, proc.stdout) == (0, "2\n")


class TestControlCharacters:
    def test_summary_escapes_them_and_the_echo_keeps_them(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A command's last stderr line in the summary has its control characters escaped;
        the same line echoed as the command's own output is byte for byte."""
        line = b"\x1b]0;title\x07\x1b[31mred\x00 \xc2\x9b2J\ttab"
        proc = subprocess.run(
            [kernel_exe, "run", "--", "sh", "-c",
             "printf '\\033]0;title\\007\\033[31mred\\000 \\302\\2332J\\ttab\\n' >&2; exit 3"],
            capture_output=True, env=cli_env, timeout=BOUND, stdin=subprocess.DEVNULL)
        assert proc.returncode == 3
        echoed, summary = proc.stderr.split(b"\n", 1)
        assert echoed == line
        assert summary.endswith(
            b": command exited with code 3: \\x1b]0;title\\x07\\x1b[31mred\\x00 \\x9b2J\\x09tab"
            b" (exit 3)\n"), summary
        assert not any((c < 0x20 and c not in b"\t\n") or c == 0x7F for c in summary)
        assert b"\xc2\x9b" not in summary


class TestAReaderThatStopsReading:
    """The command's output goes to a pipe nobody reads (`kernel run -- yes | sleep 60`,
    a pager left open). The echo into the full pipe blocked the trio thread: the
    deadline, Ctrl-C and the critic stopped with it, until the reader exited."""

    def _start(self, exe: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        # stdout is a pipe this test never reads: it fills, as behind `| sleep 60`.
        return subprocess.Popen([exe, "run", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def test_the_timeout_still_ends_the_run(self, kernel_exe: str,
                                            cli_env: dict[str, str]) -> None:
        proc = self._start(kernel_exe, cli_env, "--timeout", "2", "--", "yes")
        try:
            rc = proc.wait(timeout=120)  # it never ended while the pipe stayed full
        finally:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert rc == 124, err
        assert "hard timeout of 2s expired" in err

    def test_ctrl_c_still_ends_the_run(self, kernel_exe: str,
                                       cli_env: dict[str, str]) -> None:
        import signal
        import time

        proc = self._start(kernel_exe, cli_env, "--", "yes")
        try:
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            deadline = time.monotonic() + 120
            while _unread(fd) < 60_000:  # the pipe is full (64 KiB): the echo is blocked
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        assert rc == 130
        assert runs(kernel_exe, cli_env)[0]["status"] == "cancelled"


    def test_a_terminal_nobody_reads(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """The same on a terminal (a pty whose other side nobody reads: an ssh session that
        stalled): POLLOUT there only means some room, and a blocking write of more than
        that froze the run anyway. The echo writes through a non-blocking description
        of its own (`_nonblocking`)."""
        import pty

        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen([kernel_exe, "run", "--timeout", "2", "--", "yes"],
                                    env=cli_env, stdin=subprocess.DEVNULL, stdout=slave,
                                    stderr=subprocess.PIPE)
            os.close(slave)
            try:
                rc = proc.wait(timeout=120)  # the master is never read while it runs
            finally:
                proc.kill()
                proc.wait()
            err = proc.stderr.read().decode() if proc.stderr else ""
        finally:
            os.close(master)
        assert rc == 124, err

    def test_output_read_late_is_all_echoed_and_audited(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A reader that reads only seconds after the command ended (`| (sleep 6; wc -l)`):
        every line arrives and is audited, as without `kernel run` (before: the pipe
        readers were cancelled a fixed second after the command ended, and half of
        25,000 lines were neither echoed nor audited, with the run still `ok`)."""
        import sqlite3
        import time
        from contextlib import closing

        proc = self._start(kernel_exe, cli_env, "--", "seq", "1", "25000")
        journal = Path(cli_env["KERNEL_DB"] + ".journal")

        def exited() -> bool:
            if not journal.exists():
                return False
            with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
                try:
                    return con.execute("SELECT 1 FROM events WHERE kind = 'process_exit'"
                                       ).fetchone() is not None
                except sqlite3.OperationalError:
                    return False

        try:
            deadline = time.monotonic() + 120
            while not exited():  # seq ended: its last lines wait in our pipes
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
            time.sleep(3)  # longer than the old fixed drain: the reader is late
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, err
        assert out.count(b"\n") == 25000
        q = kernel(kernel_exe, cli_env, "query", "--format", "json",
                   "SELECT status, (SELECT json_extract(payload, '$.lines') "
                   "FROM events WHERE kind = 'output_not_audited') AS unaudited FROM runs")
        assert q.returncode == 0, q.stderr
        [got] = [json.loads(line) for line in q.stdout.splitlines() if line.startswith("{")]
        assert got["status"] == "ok"
        assert int(got["unaudited"]) == 15000  # 10,000 lines audited, the rest counted

def _has_event(journal: Path, kind: str) -> bool:
    """Whether the journal (read-only, while the run goes on) has an event of `kind`."""
    import sqlite3
    from contextlib import closing

    if not journal.exists():
        return False
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
        try:
            return con.execute("SELECT 1 FROM events WHERE kind = ?", (kind,)
                               ).fetchone() is not None
        except sqlite3.OperationalError:
            return False


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe whose read end is `fd`."""
    import fcntl
    import struct
    import termios

    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
