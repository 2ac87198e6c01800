"""`kernel run -- CMD` end to end: the installed executable in a subprocess (real time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.realtime


def kernel(exe: str, env: dict[str, str], *args: str, timeout: float = 30
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def sleeps_with(marker: str) -> list[str]:
    """Live processes whose command line starts with `marker` (not the kernel naming it)."""
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        stat, _, args = line.strip().partition(" ")
        if args.strip().startswith(marker) and not stat.startswith("Z"):
            found.append(line)
    return found


class TestExitCodes:
    def test_command_code_is_kept(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run -- sh -c 'exit 7'` exits 7."""
        proc = kernel(kernel_exe, cli_env, "run", "--", "sh", "-c", "exit 7")
        assert proc.returncode == 7, proc.stderr

    def test_output_is_echoed(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """The command's stdout and stderr pass through to ours."""
        proc = kernel(kernel_exe, cli_env, "run", "--", "sh", "-c", "echo out; echo err >&2")
        assert proc.returncode == 0
        assert proc.stdout == "out\n"
        assert "err" in proc.stderr

    def test_echo_is_byte_exact(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A 1.49 MB line, bytes that are not UTF-8 and a missing final newline echo as is."""
        code = ("import sys; sys.stdout.buffer.write(b'{' + b'x' * 1_490_000 + b'}\\n'"
                " + b'\\xff\\xfe raw\\r\\n' + b'no newline')")
        proc = subprocess.run([kernel_exe, "run", "--", sys.executable, "-c", code],
                              capture_output=True, env=cli_env, timeout=60,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (b"{" + b"x" * 1_490_000 + b"}\n" + b"\xff\xfe raw\r\n"
                               + b"no newline")

    def test_timeout_is_124_and_leaves_nothing(self, kernel_exe: str,
                                               cli_env: dict[str, str]) -> None:
        """`kernel run --timeout 1 -- sleep 30` exits 124 after ~1 s, with no sleep left."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--timeout", "1", "--",
                      "sleep", "30.123", timeout=60)
        assert proc.returncode == 124, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == "timeout"
        # What the kernel reports: the deadline, not the 30 s sleep (the margin is for load).
        assert 1.0 <= doc["runtime_seconds"] < 20, doc["runtime_seconds"]
        assert sleeps_with("sleep 30.123") == []

    @pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT],
                             ids=["sigterm", "sighup", "sigquit"])
    def test_sigterm_is_cancelled_130(self, sig: signal.Signals, kernel_exe: str,
                                      cli_env: dict[str, str], tmp_path: Path) -> None:
        """SIGTERM, SIGHUP or SIGQUIT to `kernel run` cancels the run: 130, the command stopped."""
        ready = tmp_path / "ready"
        marker = f"sleep 30.{sig.value:03d}"
        p = subprocess.Popen([kernel_exe, "run", "--json", "--", "sh", "-c",
                              f"echo > {ready}; exec {marker}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=cli_env)
        # The command runs only once the kernel's handlers are installed: wait for it.
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, err
        assert json.loads(out)["status"] == "cancelled"
        assert f"kernel: {sig.name}: cancelling the run" in err
        assert sleeps_with(marker) == []

    def test_json_is_one_object(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run --json -- echo hi` prints exactly one JSON object with the key fields."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--", "echo", "hi")
        assert proc.returncode == 0
        doc = json.loads(proc.stdout)  # raises if there is anything but one object
        assert proc.stdout.count("\n") == 1
        assert doc["status"] == "ok" and doc["exit_code"] == 0 and doc["output"] == "hi"
        assert len(doc["run_id"]) == 32 and doc["runtime_seconds"] >= 0

    def test_exit_codes_3_4_5_are_told_apart_by_the_json_status(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A command's own exit 4 and a run stopped at --max-steps both exit 4; --json's
        status says which, and `kernel run --help` says so where it lists the codes."""
        own = kernel(kernel_exe, cli_env, "run", "--json", "--", "sh", "-c", "exit 4")
        assert own.returncode == 4 and json.loads(own.stdout)["status"] == "error"
        capped = kernel(kernel_exe, cli_env, "run", "--json", "--max-steps", "0", "--",
                        "true")
        assert capped.returncode == 4 and json.loads(capped.stdout)["status"] == "max_steps"
        text = " ".join(kernel(kernel_exe, cli_env, "run", "--help").stdout.split())
        listed = text.split("Exit codes:", 1)[1]
        assert "4 max_steps" in listed
        assert 'exits 3, 4 or 5 looks the same: scripts that must tell them apart read ' \
               '"status" from --json' in listed

    def test_json_on_failure(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A failing command's JSON result carries its status and code."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--", "sh", "-c", "exit 3")
        doc = json.loads(proc.stdout)
        assert proc.returncode == 3 and doc["status"] == "error" and doc["exit_code"] == 3


class TestBadInput:
    @pytest.mark.parametrize("args", [
        ["run", "--bogus", "--", "true"],
        ["run", "--context", "novalue", "--", "true"],
        ["run", "--timeout", "soon", "--", "true"],
        ["run"],
        ["run", "missing.yaml"],
        ["nosuchcommand"],
    ], ids=["unknown-flag", "bad-context", "bad-number", "nothing", "missing-loop", "bad-cmd"])
    def test_one_line_exit_2(self, args: list[str], kernel_exe: str,
                             cli_env: dict[str, str]) -> None:
        """Bad input exits 2 with one line on stderr naming the problem, no traceback."""
        proc = kernel(kernel_exe, cli_env, *args)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "error" in lines[0] and "Traceback" not in proc.stderr


class TestImports:
    def test_help_does_not_import_duckdb(self) -> None:
        """`kernel --help` never imports duckdb (or pyarrow)."""
        code = ("import sys\nfrom kernel_cli.app import main\n"
                "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                "print(sorted(m for m in ('duckdb', 'pyarrow') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip().splitlines()[-1] == "[]"

    @pytest.mark.parametrize(("argv", "absent"), [
        (["--help"], ("duckdb", "pyarrow", "trio", "kernel", "pydantic")),
        (["run", "--help"], ("duckdb", "trio", "kernel", "pydantic")),
        (["run", "--no-audit", "--timeout", "1m", "-c", "k=v", "--", "true"], ("pydantic",)),
    ])
    def test_start_up_imports_only_what_the_command_needs(self, argv: list[str],
                                                          absent: tuple[str, ...]) -> None:
        """Help loads no kernel, trio or pydantic; a run parses its options without pydantic.

        typer would coerce every option through a pydantic adapter (most of
        `kernel run`'s start-up); app._plain_coercion passes typed values through.
        """
        code = ("import sys\nfrom kernel_cli.app import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                f"print(sorted(m for m in {absent!r} if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, stdin=subprocess.DEVNULL).stdout
        assert out.strip().splitlines()[-1] == "[]"

    def test_only_the_command_asked_for_is_built(self) -> None:
        """`kernel run ...` builds the run command alone; `kernel --help` or a typo, all."""
        from kernel_cli.app import _command

        assert set(_command(["run", "--", "true"]).commands) == {"run"}
        assert set(_command(["budget", "show"]).commands) == {"budget"}
        every = set(_command(["--help"]).commands)
        assert {"run", "runs", "show", "budget", "actions"} <= every
        assert set(_command(["rn"]).commands) == every == set(_command([]).commands)

    def test_each_command_is_found_in_its_own_module(self) -> None:
        """app.COMMANDS names, for every top-level command, the one module that adds it."""
        import typer

        from kernel_cli import app as app_module

        added: dict[str, str] = {}
        for part in app_module.PARTS:
            probe = typer.Typer()
            __import__(f"kernel_cli.{part}", fromlist=["register"]).register(probe)
            for info in probe.registered_commands:
                added[str(info.name)] = part
            for group in probe.registered_groups:
                added[str(group.name or group.typer_instance.info.name)] = part
        assert added == app_module.COMMANDS
        assert set(_command_names(app_module.app)) == set(added)

    @pytest.mark.parametrize(("argv", "absent"), [
        (["run", "--no-audit", "--", "true"],
         ("kernel_cli.analyst", "kernel_cli.batch_cmd", "kernel_cli.actions",
          "kernel_cli.recover_cmd", "kernel_cli.budget_cmd", "kernel_cli.loops")),
        (["runs"], ("kernel_cli.run_cmd", "kernel_cli.batch_cmd", "kernel_cli.actions",
                    "kernel_cli.recover_cmd", "kernel_cli.budget_cmd", "kernel_cli.loops")),
    ])
    def test_a_command_imports_only_its_own_module(self, argv: list[str],
                                                   absent: tuple[str, ...],
                                                   cli_env: dict[str, str]) -> None:
        """`kernel run` never imports the analysts' or batch commands; `kernel runs`, not run's."""
        code = ("import sys\nfrom kernel_cli.app import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                f"print(sorted(m for m in {absent!r} if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, stdin=subprocess.DEVNULL, env=cli_env).stdout
        assert out.strip().splitlines()[-1] == "[]"

    def test_reading_the_audit_imports_no_trio(self, kernel_exe: str,
                                               cli_env: dict[str, str]) -> None:
        """runs, show, stats, query never load trio (nor the recorders' redaction rules)."""
        assert kernel(kernel_exe, cli_env, "run", "--", "true").returncode == 0
        absent = ("trio", "batteries.redact", "batteries.audit._audit", "pydantic")
        for argv in (["runs"], ["show", "last"], ["stats"], ["query", "SELECT 1"]):
            code = ("import sys\nfrom kernel_cli.app import main\n"
                    f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert not e.code\n"
                    f"print(sorted(m for m in {absent!r} if m in sys.modules))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, stdin=subprocess.DEVNULL, env=cli_env).stdout
            assert out.strip().splitlines()[-1] == "[]", argv

    def test_the_executable_exits_with_the_code_and_flushed_output(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`entry` skips interpreter teardown but keeps the exit code and all of stdout."""
        proc = kernel(kernel_exe, cli_env, "run", "--", "sh", "-c", "seq 1 3000; exit 6")
        assert proc.returncode == 6
        assert proc.stdout.splitlines()[-1] == "3000" and len(proc.stdout.splitlines()) == 3000

    def test_pdb_still_imports_from_the_repo_root(self) -> None:
        """The cmd/ directory does not shadow the standard library's cmd module."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, "-c", "import pdb, cmd; assert hasattr(cmd, 'Cmd')"],
                       cwd=root, check=True)


class TestProgress:
    def test_progress_on_a_tty_stderr_only(self, kernel_exe: str,
                                           cli_env: dict[str, str]) -> None:
        """On a terminal, live progress is drawn on stderr; --json stdout stays one object."""
        import pty

        master, slave = pty.openpty()
        proc = subprocess.Popen(
            [kernel_exe, "run", "--json", "--no-audit", "--", "sh", "-c",
             "echo a; sleep 0.8; echo b"],
            stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=cli_env)
        os.close(slave)
        out, _ = proc.communicate(timeout=30)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        os.close(master)
        assert proc.returncode == 0
        assert json.loads(out)["output"] == "a\nb"
        assert b"step" in seen and b"deadline in" in seen

    def test_no_progress_without_a_tty(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """Without a terminal, stderr carries no progress line: only the summary line."""
        proc = kernel(kernel_exe, cli_env, "run", "--", "sh", "-c", "sleep 0.6; echo x")
        assert proc.returncode == 0
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kernel: run ")


class TestLikeTimeout:
    """`kernel run` behaves like timeout(1) where a person would expect it to (issue 17)."""

    def test_stdin_is_passed_through(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`echo input | kernel run -- cat` prints input: the command reads our stdin."""
        proc = subprocess.run([kernel_exe, "run", "--", "cat"], input="input\nmore\n",
                              capture_output=True, text=True, env=cli_env, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "input\nmore\n"

    def test_stdin_is_the_terminal(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """With a terminal on stdin, the command's stdin is that terminal."""
        import pty

        master, slave = pty.openpty()
        try:
            proc = subprocess.run([kernel_exe, "run", "--", "sh", "-c",
                                   "test -t 0 && echo tty || echo notty"],
                                  stdin=slave, capture_output=True, text=True, env=cli_env,
                                  timeout=30)
        finally:
            os.close(slave)
            os.close(master)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "tty\n"

    def test_quiet_prints_nothing_on_stdout(self, kernel_exe: str,
                                            cli_env: dict[str, str]) -> None:
        """`kernel run -q -- seq 1 2000` prints nothing on stdout, the summary on stderr."""
        proc = kernel(kernel_exe, cli_env, "run", "-q", "--", "seq", "1", "2000")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""
        assert proc.stderr.startswith("kernel: run ") and " ok after " in proc.stderr

    def test_summary_carries_the_short_id(self, kernel_exe: str,
                                          cli_env: dict[str, str]) -> None:
        """Without a terminal, the summary line still names the run by its short id."""
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--", "true")
        doc = json.loads(proc.stdout)
        assert doc["short_id"] == doc["run_id"][20:28]
        again = kernel(kernel_exe, cli_env, "run", "--", "sh", "-c", "exit 9")
        assert again.returncode == 9
        words = again.stderr.strip().splitlines()[-1].split()
        assert words[:2] == ["kernel:", "run"] and len(words[2]) == 8


class TestDelivery:
    def test_deliver_dir(self, kernel_exe: str, cli_env: dict[str, str], tmp_path: object) -> None:
        """--deliver-dir writes DIR/RUN_ID/result.json and output.txt."""
        from pathlib import Path

        out = Path(str(tmp_path)) / "out"
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--deliver-dir", str(out),
                      "--", "echo", "delivered")
        run_id = json.loads(proc.stdout)["run_id"]
        assert json.loads((out / run_id / "result.json").read_text())["status"] == "ok"
        assert (out / run_id / "output.txt").read_text() == "delivered"

    def test_dead_webhook_is_a_warning(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A webhook nobody answers: one warning line, the command's exit code unchanged."""
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {**cli_env, "KERNEL_LOG_LEVEL": "warning"}
        proc = kernel(kernel_exe, env, "run", "--json", "--webhook",
                      f"http://127.0.0.1:{port}/x", "--", "sh", "-c", "exit 6", timeout=90)
        assert proc.returncode == 6
        assert "kernel: warning: delivery.deliver" in proc.stderr
        # The structured log goes to stderr too: stdout stays one JSON object.
        assert "port failed" in proc.stderr
        assert json.loads(proc.stdout)["port_failures"][0].startswith("delivery.deliver")


class TestDryRun:
    def test_dry_run_command(self, kernel_exe: str, cli_env: dict[str, str],
                             tmp_path: object) -> None:
        """--dry-run prints what would run, runs nothing, exits 0."""
        from pathlib import Path

        target = Path(str(tmp_path)) / "must-survive"
        target.write_text("x")
        proc = kernel(kernel_exe, cli_env, "run", "--dry-run", "--", "rm", str(target))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"would run: rm {target}\n"
        assert target.exists()

    def test_dry_run_loop_prints_the_path(self, kernel_exe: str,
                                          cli_env: dict[str, str]) -> None:
        """A loop's dry run prints the path it would take under the scenario."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = kernel(kernel_exe, cli_env, "run", "--dry-run", "--scenario", "first-fail",
                      os.path.join(root, "examples", "ci-gate.yaml"))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("dry run of loop 'ci-gate' (scenario first-fail)")

    def test_scenario_implies_dry_run(self, kernel_exe: str, cli_env: dict[str, str],
                                      tmp_path: object) -> None:
        """--scenario without --dry-run simulates: the loop's action never runs."""
        from pathlib import Path

        marker = Path(str(tmp_path)) / "ran"
        loop = Path(str(tmp_path)) / "touch.yaml"
        loop.write_text(
            "name: touch\ninitial: act\nstates:\n"
            f"  act:\n    action: touch {marker}\n    next: done\n"
            "  done:\n    terminal: true\n")
        proc = kernel(kernel_exe, cli_env, "run", "--scenario", "all-pass", str(loop))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("dry run of loop 'touch' (scenario all-pass)")
        assert not marker.exists()


class TestUsability:
    def test_version(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel --version` prints the installed package's version."""
        from importlib.metadata import version

        proc = kernel(kernel_exe, cli_env, "--version")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"kernel {version('run-kernel')}\n"

    def test_an_option_meant_for_the_command_suggests_double_dash(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run ls -l` says to put the command after `--`, in one line, exit 2."""
        proc = kernel(kernel_exe, cli_env, "run", "ls", "-l")
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "No such option: -l" in lines[0]
        assert "kernel run [OPTIONS] -- CMD ARGS" in lines[0]


def _command_names(app: Any) -> list[str]:
    """The top-level command names of a typer app, as click builds them."""
    import typer

    return list(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
