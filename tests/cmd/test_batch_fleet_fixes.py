"""`kernel batch` / `kernel recover` defects fixed, end to end: the installed executable,
real commands, real journals, real pipes and signals.

Every wait is on readiness (a marker file a command writes, a row in the journal); the
commands that must stay in flight wait at a gate file the test creates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cmd.test_batch_cli import (
    PATIENCE,
    batch,
    journal_count,
    lines,
    only_batch_id,
    wait_for,
    write_tasks,
)
from tests.cmd.test_batch_workers import alive, gated_tasks

pytestmark = pytest.mark.realtime


def kernel(kernel_exe: str, env: dict[str, str], *args: str
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                          timeout=PATIENCE, check=False)


def gated(i: int, started: Path, gate: Path, effects: Path) -> dict[str, object]:
    """A task that says it started (`i:pid`), waits at `gate`, then does its side effect."""
    return {"id": f"t{i}", "command": [
        "sh", "-c", f"echo t{i}:$$ >> {started}; while [ ! -e {gate} ]; do sleep 0.05; "
                    f"done; echo {i} >> {effects}"]}


def batch_id_of(stderr: str) -> str:
    return stderr.split("kernel: batch ", 1)[1].split()[0]


def test_recover_leaves_a_dead_batch_s_commands_to_the_batch(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Defect 1: a SIGKILLed batch's interrupted commands are not closed `lost` by
    `kernel recover` (nor by `kernel resume`): each says which batch resumes it, and
    `kernel batch --resume` then runs them again, every side effect once."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    tasks = write_tasks(tmp_path / "t.jsonl",
                        [gated(i, started, gate, effects) for i in range(6)])
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "3", "--workers", "1"],
                            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for("three runs in flight", lambda: len(lines(started)) == 3)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    bid = only_batch_id(cli_env)
    shells = [int(x.split(":")[1]) for x in lines(started)]
    wait_for("the dead batch's commands to be stopped",
             lambda: not any(alive(p) for p in shells))

    listed = [json.loads(x) for x in
              kernel(kernel_exe, cli_env, "recover", "--list", "--json").stdout.splitlines()]
    assert len(listed) == 3 and {d["batch_id"] for d in listed} == {bid}
    rec = kernel(kernel_exe, cli_env, "recover")
    assert rec.returncode == 0, rec.stderr
    assert f"kernel batch --resume {bid}" in rec.stderr and "lost" not in rec.stderr
    one = kernel(kernel_exe, cli_env, "resume", listed[0]["run_id"])
    assert one.returncode == 2
    [line] = one.stderr.splitlines()
    assert f"belongs to batch {bid}" in line and "Traceback" not in one.stderr
    assert journal_count(cli_env, "SELECT count(*) FROM runs WHERE status = 'lost'") == 0

    gate.touch()
    resumed = batch(kernel_exe, cli_env, "--resume", bid, "--json")
    assert resumed.returncode == 0, resumed.stderr
    docs = [json.loads(x) for x in resumed.stdout.splitlines()]
    assert len(docs) == 6 and {d["status"] for d in docs} == {"ok"}
    assert sum(d["resumed"] for d in docs) == 3
    assert sorted(map(int, lines(effects))) == list(range(6))  # each exactly once


def test_a_purge_during_a_batch_never_makes_its_resume_run_a_task_again(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Defect 2: a purge while the batch runs keeps its runs (it has not finished: its
    resume tells a task that ran by its run); once it finished they go, and `--resume`
    of it runs nothing again (the purged tasks are reported `purged`)."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    n, half = 10, 5
    tasks: list[dict[str, object]] = [
        {"id": f"t{i}", "command": ["sh", "-c", f"echo {i} >> {effects}"]} for i in range(half)]
    tasks += [gated(i, started, gate, effects) for i in range(half, n)]
    proc = subprocess.Popen([kernel_exe, "batch", str(write_tasks(tmp_path / "t.jsonl", tasks)),
                             "-j", "5", "--workers", "1"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the first half to finish", lambda: journal_count(
            cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == half)
        wait_for("the rest in flight", lambda: len(lines(started)) == n - half)
        purge = kernel(kernel_exe, cli_env, "purge", "--days", "0", "--json")
        assert purge.returncode == 0, purge.stderr
        assert json.loads(purge.stdout)["runs"] == 0  # the batch has not finished
        gate.touch()
        _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    bid = batch_id_of(err)
    resumed = batch(kernel_exe, cli_env, "--resume", bid, "--json")
    assert "Traceback" not in resumed.stderr
    docs = {d["task_id"]: d for d in map(json.loads, resumed.stdout.splitlines())}
    assert len(docs) == n and all(d["skipped"] and d["status"] == "ok" for d in docs.values())
    purge = kernel(kernel_exe, cli_env, "purge", "--days", "0", "--json")
    assert purge.returncode == 0, purge.stderr
    assert json.loads(purge.stdout)["runs"] == n  # finished: its runs may go (and it)
    gone = batch(kernel_exe, cli_env, "--resume", bid, "--json")
    assert gone.returncode == 2 and "Traceback" not in gone.stderr
    assert sorted(map(int, lines(effects))) == list(range(n))  # nothing ran twice


def test_json_reader_gone_stops_the_batch_resumable(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Defect 3: `kernel batch --json | head -1`: the reader goes away after one line;
    the next line's write stops the batch as a signal does (exit 130, one line saying
    why, no traceback), and `--resume` finishes it, every side effect once."""
    effects, started = tmp_path / "effects", tmp_path / "started"
    gate1, gate2 = tmp_path / "go1", tmp_path / "go2"
    tasks: list[dict[str, object]] = [{"id": "t0", "command": ["sh", "-c", f"echo 0 >> {effects}"]},
                                      gated(1, started, gate1, effects)]
    tasks += [gated(i, started, gate2, effects) for i in range(2, 6)]
    proc = subprocess.Popen([kernel_exe, "batch", str(write_tasks(tmp_path / "t.jsonl", tasks)),
                             "-j", "2", "--json", "--workers", "1"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = json.loads(proc.stdout.readline())
        assert first["task_id"] == "t0" and first["status"] == "ok"
        proc.stdout.close()  # `head -1` exits
        wait_for("t1 and t2 in flight", lambda: len(lines(started)) == 2)
        gate1.touch()  # t1 ends: its line cannot be written
        err = proc.stderr.read()
        proc.wait(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert "output pipe closed (stdout)" in err
    bid = batch_id_of(err)
    listed = json.loads(batch(kernel_exe, cli_env, "--list", "--json").stdout.splitlines()[0])
    assert listed["batch_id"] == bid and listed["state"] == "interrupted"
    gate2.touch()
    resumed = batch(kernel_exe, cli_env, "--resume", bid, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(map(int, lines(effects))) == list(range(6))  # each exactly once


def test_a_dead_worker_leaves_the_batch_interrupted_as_the_journal_has_it(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Defect 4: a worker SIGKILLed with runs in flight: those tasks are reported
    `running` (as the journal and `kernel recover --list` have them), the batch is left
    interrupted (not `finished`) saying `kernel batch --resume ID`, which finishes them."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    n = 8
    tasks = gated_tasks(n, started, gate, effects)
    proc = subprocess.Popen([kernel_exe, "batch", str(write_tasks(tmp_path / "t.jsonl", tasks)),
                             "-j", "4", "--json", "--workers", "2"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("four runs in flight", lambda: len(lines(started)) == 4)
        held = {x.split(":")[0]: (int(x.split(":")[1]), int(x.split(":")[2]))
                for x in lines(started)}
        victim = held["t0"][0]
        dead = {t for t, (w, _) in held.items() if w == victim}
        os.kill(victim, signal.SIGKILL)
        wait_for("the dead worker's commands to be stopped", lambda: not alive(victim) and
                 not any(alive(held[t][1]) for t in dead))
        gate.touch()
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    docs = {d["task_id"]: d for d in map(json.loads, out.splitlines())}
    assert {t for t, d in docs.items() if d["status"] != "ok"} == dead
    assert {docs[t]["status"] for t in dead} == {"running"}
    bid = docs["t0"]["batch_id"]
    assert f"kernel batch --resume {bid}" in err
    listed = json.loads(batch(kernel_exe, cli_env, "--list", "--json").stdout.splitlines()[0])
    assert listed["state"] == "interrupted" and listed["counts"]["running"] == len(dead)
    recover = [json.loads(x) for x in kernel(kernel_exe, cli_env, "recover", "--list",
                                             "--json").stdout.splitlines()]
    assert {d["batch_id"] for d in recover} == {bid} and len(recover) == len(dead)
    resumed = batch(kernel_exe, cli_env, "--resume", bid, "--json")
    assert resumed.returncode == 0, resumed.stderr
    again = {d["task_id"]: d for d in map(json.loads, resumed.stdout.splitlines())}
    assert {t for t, d in again.items() if d["resumed"]} == dead
    assert sorted(map(int, lines(effects))) == list(range(n))  # each exactly once
    listed = json.loads(batch(kernel_exe, cli_env, "--list", "--json").stdout.splitlines()[0])
    assert listed["state"] == "finished"


def test_workers_are_capped_by_the_tasks_and_the_concurrency(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Defect 5: --workers N never starts more workers than tasks or runs at once."""
    ran = tmp_path / "ran"
    one = write_tasks(tmp_path / "one.jsonl",
                      [{"command": ["sh", "-c", f"echo $PPID >> {ran}"]}])
    proc = batch(kernel_exe, cli_env, str(one), "--workers", "40")
    assert proc.returncode == 0, proc.stderr
    assert "workers" not in proc.stderr  # one task: it runs in the batch process
    three = write_tasks(tmp_path / "three.jsonl", [{"command": ["true"]}] * 3)
    proc = batch(kernel_exe, cli_env, str(three), "--workers", "40")
    assert proc.returncode == 0 and "concurrency 8, 3 workers" in proc.stderr, proc.stderr
    proc = batch(kernel_exe, cli_env, str(three), "--workers", "40", "-j", "2")
    assert proc.returncode == 0 and "concurrency 2, 2 workers" in proc.stderr, proc.stderr


def test_resume_honours_concurrency(kernel_exe: str, cli_env: dict[str, str],
                                    tmp_path: Path) -> None:
    """Defect 6: `--resume ID -j N` runs the rest N at a time; without -j, as stored."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    tasks = write_tasks(tmp_path / "t.jsonl",
                        [gated(i, started, gate, effects) for i in range(6)])
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "3"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("three runs in flight", lambda: len(lines(started)) == 3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    gate.touch()
    resumed = batch(kernel_exe, cli_env, "--resume", batch_id_of(err), "-j", "5")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed: 6 task(s), concurrency 5" in resumed.stderr
    again = batch(kernel_exe, cli_env, "--resume", batch_id_of(err))
    assert "resumed: 6 task(s), concurrency 3" in again.stderr


def test_a_repeated_key_is_refused(kernel_exe: str, cli_env: dict[str, str],
                                   tmp_path: Path) -> None:
    """Defect 7: a task line giving a key twice is one error naming its line and field."""
    ran = tmp_path / "ran"
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"command": ["sh", "-c", f"echo 1 >> {ran}"]}) + "\n"
                     + '{"command": ["true"], "command": ["false"]}\n')
    proc = batch(kernel_exe, cli_env, str(tasks))
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert f"{tasks}:2: command: given twice" in line
    assert not ran.exists()  # nothing ran


def test_ray_s_sigterm_note_is_not_printed() -> None:
    """Defect 8: the note Ray logs when connecting from a thread (every `--ray` batch
    does) is dropped; anything else Ray's worker module logs still goes through."""
    import logging

    ray = pytest.importorskip("ray")
    from kernel_cli import batch_cmd

    source = Path(ray.__file__).parent / "_private" / "worker.py"
    said = " ".join(source.read_text().split())
    assert '"SIGTERM handler is not set because current thread " "is not the main thread."' \
        in said  # what Ray says, as `RAY_SIGTERM_NOTE` matches it
    batch_cmd._quiet_ray_sigterm_note()
    logger = logging.getLogger("ray._private.worker")
    note = logger.makeRecord(logger.name, logging.WARNING, __file__, 0,
                             "SIGTERM handler is not set because current thread "
                             "is not the main thread.", (), None)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "other", (), None)
    assert not logger.filter(note) and logger.filter(other)
