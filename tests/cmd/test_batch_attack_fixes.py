"""`kernel batch --deliver-dir/--webhook` and the spill line, attacked as a user would:

- `--resume` delivering an owed result again replaced the run folder the run had
  delivered whole with the journal's copy (its output as stored, no artifacts);
- a delivery that ended while the journal was locked was reported delivered (exit 0)
  but left owed in the journal for ever: `--list` counted it, `--resume` sent it twice;
  and the spill that kept the batch's end said "(0 events)";
- a batch whose journal (its own, or a `--workers` worker's) lost audit rows outright
  exited 0, while `kernel run` exits 1;
- `--resume --webhook/--deliver-dir` delivered elsewhere than the batch was started
  with without a word;
- `--list --format csv` had the runs' counts but not the deliveries'.

Real parts: the installed `kernel` executable, real commands, the real journal (locked
by a second real SQLite connection), real folders, a real HTTP server on 127.0.0.1 and a
real file-size limit on a process (`prlimit`). Waits are for readiness (files the
commands write, journal rows, requests received), never fixed sleeps.
"""

from __future__ import annotations

import csv
import json
import resource
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.cmd.test_batch_cli import PATIENCE, batch, journal_count, wait_for, write_tasks
from tests.cmd.test_batch_delivery import Hook, batch_id_of, dead_url, docs, hook

__all__ = ["hook"]  # the fixture, used here

pytestmark = pytest.mark.realtime


def journal_of(env: dict[str, str]) -> Path:
    return Path(env["KERNEL_DB"] + ".journal")


def deliveries(env: dict[str, str]) -> dict[str, str | None]:
    with closing(sqlite3.connect(journal_of(env), timeout=PATIENCE)) as con:
        return dict(con.execute("SELECT task_id, delivery FROM batch_tasks").fetchall())


def listed(kernel_exe: str, env: dict[str, str]) -> dict[str, Any]:
    got = batch(kernel_exe, env, "--list", "--json")
    assert got.returncode == 0, got.stderr
    [row] = [json.loads(x) for x in got.stdout.splitlines()]
    return dict(row)


@contextmanager
def journal_locked(env: dict[str, str]) -> Iterator[None]:
    """The journal's write lock held by another connection for the block."""
    con = sqlite3.connect(journal_of(env), isolation_level=None, timeout=PATIENCE)
    try:
        con.execute("BEGIN EXCLUSIVE")
        yield
        con.execute("ROLLBACK")
    finally:
        con.close()


def waiting(tmp_path: Path, i: int, go: Path) -> dict[str, Any]:
    """A task that notes its parent (the process running it) and waits for `go`."""
    return {"id": f"t{i}", "command": [
        "sh", "-c", f"echo $PPID > {tmp_path}/parent{i}; "
                    f"while [ ! -e {go} ]; do sleep 0.02; done; echo done{i}"]}


def test_a_resume_leaves_the_folder_a_run_delivered_as_it_is(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook) -> None:
    """The folder got each run, the webhook none: --resume posts both results to the
    webhook and leaves each run's folder as the run delivered it (the same folder, the
    same bytes: the journal's copy keeps only the last 64 KiB of an output), exit 0."""
    out = tmp_path / "out"
    tasks = write_tasks(tmp_path / "t.jsonl", [
        {"id": "big", "command": ["sh", "-c", "head -c 70000 /dev/zero | tr '\\0' x; "
                                              "echo; echo END"]},
        {"id": "small", "command": ["echo", "small"]}])
    first = batch(kernel_exe, cli_env, str(tasks), "--json", "--deliver-dir", str(out),
                  "--webhook", dead_url())
    assert first.returncode == 1, first.stderr
    runs = {d["task_id"]: d["run_id"] for d in docs(first)}
    before = {t: (out / r).stat().st_ino for t, r in runs.items()}
    files = {t: {p.name: p.read_bytes() for p in (out / r).iterdir()} for t, r in runs.items()}
    assert files["big"]["output.txt"].endswith(b"x\nEND")

    resumed = batch(kernel_exe, cli_env, "--resume", batch_id_of(first.stderr), "--json",
                    "--webhook", hook.url())
    assert resumed.returncode == 0, resumed.stderr
    assert {d["delivery"] for d in docs(resumed)} == {"delivered"}
    assert sorted(hook.run_ids()) == sorted(runs.values())
    assert {t: (out / r).stat().st_ino for t, r in runs.items()} == before
    assert {t: {p.name: p.read_bytes() for p in (out / r).iterdir()}
            for t, r in runs.items()} == files


def test_a_delivery_that_ended_while_the_journal_was_locked_is_not_owed_again(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook) -> None:
    """The webhook holds the result; the run's row is closed; the journal is then locked
    (past the lock timeout) while the delivery ends and the batch exits. Exit 0, and one
    line says where what the journal could not write is kept (no "(0 events)": it holds
    no event). Once the next command wrote the journal, the batch is finished with
    nothing owed, and --resume posts nothing again."""
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "t0", "command": ["echo", "hi"]}])
    hook.hold.set()
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "--webhook", hook.url()],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for("the result to be posted", lambda: len(hook.run_ids()) == 1)
        wait_for("the run's row to be closed", lambda: journal_count(
            env, "SELECT count(*) FROM runs WHERE status = 'ok'") == 1)
        with journal_locked(env):
            hook.release.set()
            _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    [note] = [x for x in err.splitlines() if ".spill-" in x]
    assert note.startswith("kernel: warning: journal writes not yet made (no audit event) "
                           "are kept in "), note
    assert "(0 events)" not in err

    ran = subprocess.run([kernel_exe, "run", "--", "true"], env=env, capture_output=True,
                         text=True, timeout=PATIENCE)
    assert ran.returncode == 0, ran.stderr
    assert deliveries(env) == {"t0": "delivered"}
    row = listed(kernel_exe, env)
    assert (row["state"], row["undelivered"]) == ("finished", 0)
    again = batch(kernel_exe, env, "--resume", row["batch_id"], "--webhook", hook.url())
    assert again.returncode == 0, again.stderr
    assert len(hook.run_ids()) == 1


@pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "workers"])
def test_a_batch_whose_journal_lost_rows_exits_1(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, workers: str) -> None:
    """The runs end while the journal is locked, and the process that writes their rows
    (the batch process, or each --workers worker) can write no file (a real file-size
    limit): its rows are neither written nor kept in a spill file. Every run ended ok,
    but what the journal says of them is not what happened: exit 1, saying why (as
    `kernel run`), where it was 0."""
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    go = tmp_path / "go"
    n = int(workers)
    tasks = write_tasks(tmp_path / "t.jsonl", [waiting(tmp_path, i, go) for i in range(n)])
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", str(n), "--workers",
                             workers], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        parents = [tmp_path / f"parent{i}" for i in range(n)]
        wait_for("every task to start", lambda: all(
            p.exists() and p.read_text().strip() for p in parents))
        writers = {int(p.read_text()) for p in parents}  # who runs (and records) the runs
        assert len(writers) == n and (n == 1) == (writers == {proc.pid})
        with journal_locked(env):
            for pid in writers:  # no regular file can grow past 1 byte: no spill file
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, 1))
            go.touch()
            _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    last = err.splitlines()[-1]
    assert last.startswith("kernel: batch ") and f": {n} ok in " in last, err
    assert last.endswith(" audit row(s) were lost)") and "(exit 1: " in last, err


def test_a_resume_says_when_it_delivers_elsewhere_than_the_batch_started(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook) -> None:
    """--resume --deliver-dir B --webhook URL2 delivers the owed results there only (as
    --help says), and says so in one line each, naming the destinations it replaces; a
    resume giving the same ones says nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "t0", "command": ["echo", "hi"]}])
    down = dead_url()
    first = batch(kernel_exe, cli_env, str(tasks), "--deliver-dir", str(a), "--webhook", down)
    assert first.returncode == 1, first.stderr
    batch_id = batch_id_of(first.stderr)
    shown_down = down.split("?")[0].replace("bot:hunter2pw@", "")
    resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--deliver-dir", str(b),
                    "--webhook", hook.url())
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stderr.splitlines()
    assert (f"kernel: note: batch {batch_id} delivers to --deliver-dir {b}, not to the one "
            f"it was started with ({a})") in said
    assert (f"kernel: note: batch {batch_id} delivers to --webhook {hook.url()}, not to the "
            f"one(s) it was started with ({shown_down})") in said
    assert len(list(b.iterdir())) == 1 and len(hook.run_ids()) == 1
    again = batch(kernel_exe, cli_env, "--resume", batch_id, "--deliver-dir", str(a),
                  "--webhook", down)
    assert again.returncode == 0, again.stderr
    assert "note:" not in again.stderr


def test_list_as_csv_has_the_deliveries_beside_the_counts(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`--list --format csv` has every column `--list --json` has, `deliveries` too."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "t0", "command": ["true"]}])
    assert batch(kernel_exe, cli_env, str(tasks), "--deliver-dir",
                 str(tmp_path / "out")).returncode == 0
    got = batch(kernel_exe, cli_env, "--list", "--format", "csv")
    assert got.returncode == 0, got.stderr
    [row] = list(csv.DictReader(got.stdout.splitlines()))
    as_json = listed(kernel_exe, cli_env)
    assert set(row) == set(as_json)
    assert json.loads(row["deliveries"]) == as_json["deliveries"] == {"delivered": 1}
    assert row["undelivered"] == "0"
