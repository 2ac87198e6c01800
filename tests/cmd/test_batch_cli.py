"""`kernel batch` end to end: the installed executable, real commands, a real journal."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from journal_texts import stored_texts

pytestmark = pytest.mark.realtime

#: Generous: the CI machine is shared. Waits end as soon as their condition holds.
PATIENCE = 120.0


def write_tasks(path: Path, tasks: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def batch(kernel_exe: str, env: dict[str, str], *args: str,
          timeout: float = PATIENCE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, "batch", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    """Poll `cond` until it holds (readiness from files the processes write, not a sleep)."""
    deadline = time.monotonic() + PATIENCE
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def only_batch_id(env: dict[str, str]) -> str:
    """The id of the one batch in the journal (a SIGKILLed batch process may die before
    its "kernel: batch ID started" line reaches stderr: it is written by a thread)."""
    journal = Path(env["KERNEL_DB"] + ".journal")
    con = sqlite3.connect(f"{journal.as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        [(batch_id,)] = con.execute("SELECT batch_id FROM batches").fetchall()
    finally:
        con.close()
    return str(batch_id)


def journal_count(env: dict[str, str], sql: str) -> int:
    """A count read from the journal (read-only; the batch process writes it meanwhile)."""
    journal = Path(env["KERNEL_DB"] + ".journal")
    if not journal.exists():
        return 0
    con = sqlite3.connect(f"{journal.as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        return int(con.execute(sql).fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0
    finally:
        con.close()


def query(kernel_exe: str, env: dict[str, str], sql: str) -> list[dict[str, object]]:
    proc = subprocess.run([kernel_exe, "query", sql, "--format", "json"], capture_output=True,
                          text=True, env=env, timeout=PATIENCE, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


class TestResults:
    def test_json_lines_and_exit_code(self, kernel_exe: str, cli_env: dict[str, str],
                                      tmp_path: Path) -> None:
        """--json prints one object per run on stdout; one failed run makes the exit code 1."""
        tasks = write_tasks(tmp_path / "t.jsonl", [
            {"id": "a", "command": ["sh", "-c", "echo A"]},
            {"id": "b", "command": ["sh", "-c", "exit 3"], "name": "fails"},
            {"id": "c", "command": ["sh", "-c", "echo $KERNEL_CTX_WHO"],
             "context": {"who": "C"}},
        ])
        proc = batch(kernel_exe, cli_env, str(tasks), "--json", "-j", "2")
        assert proc.returncode == 1, proc.stderr
        docs = {d["task_id"]: d for d in map(json.loads, proc.stdout.splitlines())}
        assert set(docs) == {"a", "b", "c"}
        assert [docs[t]["status"] for t in "abc"] == ["ok", "error", "ok"]
        assert docs["a"]["output"].strip() == "A" and docs["c"]["output"].strip() == "C"
        assert docs["b"]["exit_code"] == 3 and docs["b"]["name"] == "fails"
        batch_id = docs["a"]["batch_id"]
        assert {d["batch_id"] for d in docs.values()} == {batch_id}
        assert f"batch {batch_id} started: 3 task(s)" in proc.stderr
        assert "(exit 1)" in proc.stderr.splitlines()[-1]
        rows = query(kernel_exe, cli_env, "SELECT task_id, status, run_id FROM batch_runs "
                                          f"WHERE batch_id = '{batch_id}' ORDER BY idx")
        assert [(r["task_id"], r["status"]) for r in rows] == [
            ("a", "ok"), ("b", "error"), ("c", "ok")]
        assert {r["run_id"] for r in rows} == {d["run_id"] for d in docs.values()}

    def test_all_ok_exits_0_and_list(self, kernel_exe: str, cli_env: dict[str, str],
                                     tmp_path: Path) -> None:
        """Every run ok: exit 0; --list shows batches newest first with counts by status."""
        first = write_tasks(tmp_path / "first.jsonl", [{"command": ["true"]}] * 2)
        second = write_tasks(tmp_path / "second.jsonl", [{"command": ["true"]},
                                                         {"command": ["false"]}])
        assert batch(kernel_exe, cli_env, str(first)).returncode == 0
        assert batch(kernel_exe, cli_env, str(second)).returncode == 1
        listed = batch(kernel_exe, cli_env, "--list", "--json")
        assert listed.returncode == 0
        rows = [json.loads(x) for x in listed.stdout.splitlines()]
        assert [r["name"] for r in rows] == ["second.jsonl", "first.jsonl"]
        assert rows[0]["counts"] == {"ok": 1, "error": 1}
        assert rows[1]["counts"] == {"ok": 2}
        assert {r["state"] for r in rows} == {"finished"}
        text = batch(kernel_exe, cli_env, "--list").stdout.splitlines()
        assert text[0].split()[:3] == ["BATCH", "CREATED", "(UTC)"]
        assert text[1].startswith(rows[0]["batch_id"]) and "error=1" in text[1]
        csv_rows = batch(kernel_exe, cli_env, "--list", "--format", "csv").stdout.splitlines()
        assert csv_rows[0].startswith("batch_id,name,") and len(csv_rows) == 3


    @pytest.mark.parametrize("workers", ["1", "2"])
    def test_secrets_run_as_given_and_are_stored_redacted(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
            workers: str) -> None:
        """A secret in a command line or a secret-named context value reaches the command
        as written (as under `kernel run`); the journal holds it nowhere."""
        token, key = "abcdefgh12345678", "zzzsecretvalue99"
        tasks = write_tasks(tmp_path / "t.jsonl", [
            {"id": "argv", "command": ["sh", "-c", f"echo token={token} > {tmp_path}/a"]},
            {"id": "ctx", "command": ["sh", "-c", f"echo $KERNEL_CTX_API_TOKEN > {tmp_path}/b"],
             "context": {"api_token": key}},
        ])
        proc = batch(kernel_exe, cli_env, str(tasks), "--workers", workers)
        assert proc.returncode == 0, proc.stderr
        assert lines(tmp_path / "a") == [f"token={token}"]
        assert lines(tmp_path / "b") == [key]
        stored = stored_texts(cli_env["KERNEL_DB"] + ".journal")
        assert stored and not [v for v in stored if token in v or key in v]
        assert any("[REDACTED" in v for v in stored)


class TestBadInput:
    @pytest.mark.parametrize(("line", "expect"), [
        ("not json", ":2: not JSON"),
        ("[1, 2]", ":2: expects a JSON object"),
        ('{"command": "echo hi"}', ":2: command: expects a non-empty list of strings"),
        ('{"command": ["true"], "timeout": "soon"}', ":2: timeout: expects a duration"),
        ('{"command": ["true"], "timeout": -5}', ":2: timeout: expects a duration"),
        ('{"command": ["true"], "max_steps": "many"}', ":2: max_steps: expects a whole"),
        ('{"command": ["true"], "bogus": 1}', ":2: bogus: unknown field"),
        ('{"command": ["true"], "prompt": "x"}', ":2: prompt: unknown field for a command"),
        ('{"command": ["true"], "loop": "x.yaml"}', ":2: expects exactly one of"),
        ('{"loop": "missing.yaml"}', ":2: loop: loop file not found"),
        ('{"command": ["true"], "context": {"a b": 1}}', ":2: context: key 'a b'"),
    ])
    def test_bad_line(self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
                      line: str, expect: str) -> None:
        """A bad line: one line naming the line number and field, exit 2, nothing runs."""
        marker = tmp_path / "ran"
        tasks = tmp_path / "t.jsonl"
        tasks.write_text(json.dumps({"command": ["touch", str(marker)]}) + "\n" + line + "\n")
        proc = batch(kernel_exe, cli_env, str(tasks))
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith(f"kernel batch: error: {tasks}{expect}"), proc.stderr
        assert not marker.exists()
        assert batch(kernel_exe, cli_env, "--list", "--json").stdout == ""

    def test_empty_file(self, kernel_exe: str, cli_env: dict[str, str],
                        tmp_path: Path) -> None:
        """A file with no task (empty, or blank lines only) is bad input: exit 2."""
        for text in ("", "\n  \n"):
            tasks = tmp_path / "empty.jsonl"
            tasks.write_text(text)
            proc = batch(kernel_exe, cli_env, str(tasks))
            assert proc.returncode == 2
            assert proc.stderr == f"kernel batch: error: {tasks} holds no tasks\n"

    def test_duplicate_ids(self, kernel_exe: str, cli_env: dict[str, str],
                           tmp_path: Path) -> None:
        """Two tasks with one id: the second line is named, with the line it repeats."""
        tasks = write_tasks(tmp_path / "dup.jsonl", [
            {"id": "x", "command": ["true"]}, {"command": ["true"]},
            {"id": "x", "command": ["false"]}])
        proc = batch(kernel_exe, cli_env, str(tasks))
        assert proc.returncode == 2
        assert proc.stderr == (f"kernel batch: error: {tasks}:3: id: 'x' is already the id "
                               "of line 1\n")

    def test_usage(self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """No file, two modes, an unknown batch, a missing file: one line each, exit 2."""
        tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]}])
        for args, expect in (
                ((), "give exactly one of"),
                ((str(tasks), "--list"), "give exactly one of"),
                (("--resume", "bnothere"), "no batch 'bnothere'"),
                ((str(tmp_path / "nope.jsonl"),), "no task file"),
                ((str(tasks), "--concurrency", "0"), "")):
            proc = batch(kernel_exe, cli_env, *args)
            assert proc.returncode == 2, (args, proc.stderr)
            assert proc.stderr.count("\n") == 1 and expect in proc.stderr, proc.stderr


class TestProgress:
    def test_progress_only_on_a_tty(self, kernel_exe: str, cli_env: dict[str, str],
                                    tmp_path: Path) -> None:
        """On a TTY stderr the live line shows counts and the oldest run; piped, it never does."""
        gate = tmp_path / "go"
        tasks = write_tasks(tmp_path / "t.jsonl", [
            {"id": "quick", "command": ["true"]},
            {"id": "waits", "command": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; "
                                                    "done"]}])
        master, slave = pty.openpty()
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "--json"], env=cli_env,
                                stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + PATIENCE
        try:
            while b"oldest waits" not in seen:
                assert time.monotonic() < deadline, seen
                ready, _, _ = select.select([master], [], [], 1.0)
                if ready:
                    seen += os.read(master, 65536)
            gate.touch()
            while proc.poll() is None:  # keep draining: a full terminal would block it
                assert time.monotonic() < deadline
                ready, _, _ = select.select([master], [], [], 0.2)
                if ready:
                    try:
                        seen += os.read(master, 65536)
                    except OSError:  # the terminal's other end closed
                        break
            out, _ = proc.communicate(timeout=PATIENCE)
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(master)
        assert proc.returncode == 0
        assert b"1/2 done" in seen and b"1 ok" in seen and b"1 running" in seen
        # stdout stays machine output: two JSON lines, no progress in them.
        assert [json.loads(x)["task_id"] for x in out.splitlines()] == ["quick", "waits"]
        piped = batch(kernel_exe, cli_env, str(tasks), "--json")
        assert piped.returncode == 0
        assert "oldest" not in piped.stderr and "done |" not in piped.stderr


class TestResume:
    def test_sigkill_halfway_then_resume(self, kernel_exe: str, cli_env: dict[str, str],
                                         tmp_path: Path) -> None:
        """A batch SIGKILLed halfway and resumed: every side effect once, every run audited
        once, exit 0; a second resume skips everything."""
        effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
        n, half = 12, 6
        tasks = []
        for i in range(n):
            wait = (f"echo {i} >> {started}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                    if i >= half else "")
            tasks.append({"id": f"t{i}", "command": ["sh", "-c", f"{wait}echo {i} >> {effects}"]})
        tasks_file = write_tasks(tmp_path / "t.jsonl", tasks)
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks_file), "-j", "3", "--json"],
                                env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            # Ready: the first half ran and their runs are closed in the journal, and the
            # three runs in flight are blocked before their side effect.
            wait_for("the first half to finish", lambda: journal_count(
                cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == half)
            wait_for("three runs in flight", lambda: len(lines(started)) == 3)
            assert sorted(map(int, lines(effects))) == list(range(half))
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=PATIENCE)
        finally:
            if proc.poll() is None:
                proc.kill()
        batch_id = err.split("kernel: batch ", 1)[1].split()[0]
        listed = [json.loads(x) for x in batch(kernel_exe, cli_env, "--list", "--json")
                  .stdout.splitlines()]
        assert listed[0]["batch_id"] == batch_id and listed[0]["state"] == "interrupted"
        assert listed[0]["counts"] == {"ok": half, "running": 3, "pending": n - half - 3}

        gate.touch()
        resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--json")
        assert resumed.returncode == 0, resumed.stderr
        docs = [json.loads(x) for x in resumed.stdout.splitlines()]
        assert len(docs) == n and {d["status"] for d in docs} == {"ok"}
        assert sum(d["skipped"] for d in docs) == half
        assert sum(d["resumed"] for d in docs) == 3
        assert sorted(map(int, lines(effects))) == list(range(n))  # each exactly once

        rows = query(kernel_exe, cli_env,
                     "SELECT r.run_id, r.status, "
                     "(SELECT count(*) FROM events e WHERE e.run_id = r.run_id "
                     " AND e.kind = 'run_start') AS starts, "
                     "(SELECT count(*) FROM events e WHERE e.run_id = r.run_id) AS events, "
                     "(SELECT max(seq) FROM events e WHERE e.run_id = r.run_id) AS last_seq "
                     f"FROM batch_runs r WHERE r.batch_id = '{batch_id}'")
        assert len(rows) == n and len({r["run_id"] for r in rows}) == n
        assert {r["status"] for r in rows} == {"ok"}
        assert {r["starts"] for r in rows} == {1}
        assert all(r["events"] == r["last_seq"] + 1 for r in rows)  # seq 0..k, no gap
        runs = query(kernel_exe, cli_env, "SELECT count(*) AS n FROM runs")
        assert runs == [{"n": n}]

        again = batch(kernel_exe, cli_env, "--resume", batch_id, "--json")
        assert again.returncode == 0
        assert all(json.loads(x)["skipped"] for x in again.stdout.splitlines())
        assert sorted(map(int, lines(effects))) == list(range(n))

    def test_resume_refused_while_running(self, kernel_exe: str, cli_env: dict[str, str],
                                          tmp_path: Path) -> None:
        """--resume of a batch whose process is alive is refused (exit 2); it goes on."""
        gate = tmp_path / "go"
        tasks = write_tasks(tmp_path / "t.jsonl", [
            {"command": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"]}])
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks)], env=cli_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("the run to start", lambda: journal_count(
                cli_env, "SELECT count(*) FROM runs") == 1)
            listed = json.loads(batch(kernel_exe, cli_env, "--list", "--json").stdout)
            refused = batch(kernel_exe, cli_env, "--resume", listed["batch_id"])
            assert refused.returncode == 2
            assert f"is being run by pid {proc.pid}" in refused.stderr
            gate.touch()
            assert proc.wait(timeout=PATIENCE) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_help_documents_exit_codes(kernel_exe: str, cli_env: dict[str, str]) -> None:
    """--help says what the exit codes are."""
    out = batch(kernel_exe, cli_env, "--help").stdout
    assert "0 every run ended ok" in out and "1 at least one did not" in out


def test_a_resumed_command_runs_where_the_batch_started(tmp_path: Path) -> None:
    """A command task is rebuilt in the directory its batch was started from, wherever the
    resume runs."""
    from kernel_cli.batch_cmd import _build

    spec = {"agent": {"kind": "command", "argv": ["pwd"], "context": {}},
            "info": {"name": "pwd", "run_id": "ab" * 16}, "limits": {}, "cwd": str(tmp_path)}
    agent, info, _ = _build(spec)
    assert agent.cwd == str(tmp_path) and not agent.inherit_stdin
    assert info.run_id == "ab" * 16


def test_a_task_s_placement_is_not_part_of_its_run_spec(kernel_exe: str,
                                                        cli_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    """A task's "ray" object says where to run it: the run's registered spec (what
    `kernel recover` rebuilds the run from) leaves it out and reads back as a RunSpec."""
    from batteries.checkpoint import JournalCheckpointer
    from kernel import RunSpec

    tasks = write_tasks(tmp_path / "t.jsonl", [
        {"id": "placed", "command": ["true"], "ray": {"num_cpus": 0.5}}])
    proc = batch(kernel_exe, cli_env, str(tasks), "--json")
    assert proc.returncode == 0, proc.stderr
    run_id = json.loads(proc.stdout)["run_id"]
    [saved] = JournalCheckpointer(cli_env["KERNEL_DB"]).store.saved_runs(run_id=run_id)
    assert "ray" not in saved.spec
    assert RunSpec.from_dict(saved.spec).agent.argv == ("true",)
