"""`kernel batch --deliver-dir/--webhook`: a result that did not reach its destinations (its
delivery failed, or the batch process died while it was under way) is kept with the batch,
reported (`--json`, the summary, `--list`, exit 1) and delivered by `--resume` without
running its task again; in-process and with `--workers`.

Real parts: the installed `kernel` executable, real commands, the real journal, real
folders and a real HTTP server on 127.0.0.1. Waits are for readiness (requests received,
journal rows), never fixed sleeps.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from journal_texts import stored_texts

from tests.cmd.test_batch_cli import PATIENCE, batch, journal_count, lines, wait_for, write_tasks
from tests.cmd.test_batch_delivery import (
    PASSWORD,
    Hook,
    batch_id_of,
    dead_url,
    delivered,
    docs,
    hook,
)

__all__ = ["hook"]  # the fixture, used here

pytestmark = pytest.mark.realtime

WORKERS = pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "workers"])


def deliveries(env: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Task id -> (delivery, delivery_error), as the journal keeps them."""
    journal = Path(env["KERNEL_DB"] + ".journal")
    with closing(sqlite3.connect(f"{journal.as_uri()}?mode=ro", uri=True, timeout=30)) as con:
        rows = con.execute("SELECT task_id, delivery, delivery_error FROM batch_tasks").fetchall()
    return {task: (state, error) for task, state, error in rows}


def listed(kernel_exe: str, env: dict[str, str]) -> dict[str, Any]:
    got = batch(kernel_exe, env, "--list", "--json")
    assert got.returncode == 0, got.stderr
    [row] = [json.loads(x) for x in got.stdout.splitlines()]
    return dict(row)


def effect_tasks(n: int, effects: Path, **extra: Any) -> list[dict[str, Any]]:
    """`n` tasks that each append their number to `effects` (how often each ran)."""
    return [{"id": f"t{i}", "command": ["sh", "-c", f"echo {i} >> {effects}; echo out{i}"],
             **extra} for i in range(n)]


@WORKERS
def test_a_failed_delivery_is_exit_1_kept_and_delivered_by_resume(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook,
        workers: str) -> None:
    """A webhook nobody answers: every run ends ok and reaches the folder, but the batch
    exits 1, its --json lines and summary say which results were not delivered, the
    journal keeps them `failed` with the error (no password, no query) and --list counts
    them. --resume (given the webhook again: its password is not stored) delivers exactly
    those, runs nothing again and exits 0; a resume after that delivers nothing."""
    effects, out = tmp_path / "effects", tmp_path / "out"
    n = 3
    tasks = write_tasks(tmp_path / "t.jsonl", effect_tasks(n, effects))
    first = batch(kernel_exe, cli_env, str(tasks), "--json", "-j", "3", "--workers", workers,
                  "--deliver-dir", str(out), "--webhook", dead_url())
    assert first.returncode == 1, first.stderr
    lines_ = docs(first)
    assert {d["status"] for d in lines_} == {"ok"} and len(lines_) == n
    assert {d["delivery"] for d in lines_} == {"failed"}
    batch_id = lines_[0]["batch_id"]
    assert len(delivered(out)) == n  # the folder got them: only the webhook failed
    said = first.stderr.splitlines()
    assert (f"kernel: warning: batch {batch_id}: {n} run(s) not delivered everywhere (see "
            f"above); kernel batch --resume {batch_id} delivers them again") in said
    assert said[-1].startswith(f"kernel: batch {batch_id}: {n} ok, {n} undelivered in ")
    assert said[-1].endswith("(exit 1)") and "" not in said
    assert PASSWORD not in first.stderr and "qsecret" not in first.stderr

    kept = deliveries(cli_env)
    assert {state for state, _ in kept.values()} == {"failed"}
    for _, error in kept.values():
        assert error is not None and error.startswith(
            "DeliveryError: WebhookDelivery: webhook http://127.0.0.1:")
        assert PASSWORD not in error and "qsecret" not in error
    assert not [t for t in stored_texts(cli_env["KERNEL_DB"] + ".journal") if PASSWORD in t]
    row = listed(kernel_exe, cli_env)
    assert (row["undelivered"], row["deliveries"], row["state"]) == (n, {"failed": n},
                                                                      "finished")
    table = batch(kernel_exe, cli_env, "--list").stdout.splitlines()
    assert table[0].split()[6] == "UNDELIVERED" and table[1].split()[6] == str(n)

    refused = batch(kernel_exe, cli_env, "--resume", batch_id)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"kernel batch: error: batch {batch_id}: its secrets are not stored; give them "
        f"again: kernel batch --resume {batch_id} --webhook URL")

    resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--json", "--workers", workers,
                    "--webhook", hook.url(password=True))
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(hook.run_ids()) == sorted(d["run_id"] for d in lines_)
    again = {d["run_id"]: d for d in docs(resumed)}
    assert len(again) == n and all(d["skipped"] for d in again.values())
    assert {d["delivery"] for d in again.values()} == {"delivered"}
    for body in hook.bodies:  # the result as the journal has it
        task = again[body["run_id"]]["task_id"]
        assert (body["status"], body["output"], body["exit_code"]) == (
            "ok", f"out{task[1:]}", 0)
    assert sorted(lines(effects)) == [str(i) for i in range(n)]  # each task ran once
    assert {state for state, _ in deliveries(cli_env).values()} == {"delivered"}
    assert listed(kernel_exe, cli_env)["undelivered"] == 0

    third = batch(kernel_exe, cli_env, "--resume", batch_id, "--webhook", hook.url())
    assert third.returncode == 0, third.stderr
    assert len(hook.bodies) == n and sorted(lines(effects)) == [str(i) for i in range(n)]


@WORKERS
def test_a_delivery_under_way_when_the_batch_is_killed_is_delivered_by_resume(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook,
        workers: str) -> None:
    """The webhook takes every result and answers none; the batch process is SIGKILLed
    while they wait (readiness: the server saw every request). The journal has each task
    `pending`; --resume (the stored webhook) delivers each result again, runs no task
    again and exits 0."""
    effects = tmp_path / "effects"
    n = 3
    tasks = write_tasks(tmp_path / "t.jsonl", effect_tasks(n, effects))
    hook.hold.set()
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "3", "--workers",
                                 workers, "--webhook", hook.url()], env=cli_env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for("every result to be posted (and left unanswered)",
                 lambda: len(hook.run_ids()) == n)
        assert hook.answered == 0 and proc.poll() is None
        proc.kill()
        proc.wait(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    batch_id = batch_id_of(err_file.read_text())
    first_posts = hook.run_ids()
    assert journal_count(cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == n
    assert {state for state, _ in deliveries(cli_env).values()} == {"pending"}
    row = listed(kernel_exe, cli_env)
    assert (row["undelivered"], row["deliveries"]) == (n, {"pending": n})

    hook.hold.clear()
    hook.release.set()  # the killed batch's requests end (their client is gone)
    resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--json", "--workers", workers)
    assert resumed.returncode == 0, resumed.stderr
    again = docs(resumed)
    assert {d["delivery"] for d in again} == {"delivered"} and all(d["skipped"] for d in again)
    # Each result posted twice in all: the unanswered one, then the resume's.
    assert Counter(hook.run_ids()) == {run_id: 2 for run_id in first_posts}
    assert sorted(lines(effects)) == [str(i) for i in range(n)]  # no task ran again
    assert {state for state, _ in deliveries(cli_env).values()} == {"delivered"}
    assert listed(kernel_exe, cli_env)["undelivered"] == 0
