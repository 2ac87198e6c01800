"""Owed batch deliveries in `kernel purge` and in the analysts' file.

`kernel batch --webhook` whose webhook refuses some results: `kernel query` reads where
each task's delivery stands (`batch_tasks.delivery`, `delivery_error`, copied by the
sync); `kernel purge --days 0` keeps the owed runs and their batch in the store and in the
analysts' file alike, so `kernel batch --resume` still delivers them; once delivered, the
next purge takes them. An analysts' file made before the delivery columns gets them, and
every task's delivery, on its next sync.

Real parts: the installed `kernel` executable, real commands, the real journal (or the
session's PostgreSQL server, tests/pg_server.py), real DuckDB and a real HTTP server on
127.0.0.1. No sleeps: every process is waited for.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.realtime

PATIENCE = 180.0


class Webhook:
    """A real webhook endpoint: keeps each POSTed result; while `refusing`, answers 403 (not
    retried: the delivery fails at once) to the results whose output names `refuse`."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.refusing = True
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                with hook.lock:
                    hook.bodies.append(body)
                    refuse = hook.refusing and "refuse" in str(body.get("output"))
                self.send_response(403 if refuse else 204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def outputs(self) -> list[str]:
        with self.lock:
            return sorted(str(b.get("output")).strip() for b in self.bodies)


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    try:
        yield hook
    finally:
        hook.httpd.shutdown()
        hook.httpd.server_close()


@pytest.fixture(params=["journal", "postgres"])
def env(request: pytest.FixtureRequest, cli_env: dict[str, str]) -> dict[str, str]:
    """The CLI's environment: the journal beside the analysts' file, or a PostgreSQL
    store ($KERNEL_STORE) feeding it."""
    if request.param == "postgres":
        return {**cli_env, "KERNEL_STORE": request.getfixturevalue("pg_url")}
    return cli_env


def kernel(kernel_exe: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                          timeout=PATIENCE, check=False)


def query(kernel_exe: str, env: dict[str, str], sql: str) -> list[dict[str, Any]]:
    got = kernel(kernel_exe, env, "query", sql, "--format", "json")
    assert got.returncode == 0, got.stderr
    out = got.stdout.strip()
    if out.startswith("["):
        return list(json.loads(out))
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def store_rows(env: dict[str, str], sql: str) -> list[tuple[Any, ...]]:
    """Rows read straight from the store the CLI writes (the journal, or the server)."""
    url = env.get("KERNEL_STORE")
    if url is None:
        journal = Path(env["KERNEL_DB"] + ".journal")
        with closing(sqlite3.connect(f"{journal.as_uri()}?mode=ro", uri=True,
                                     timeout=30)) as con:
            return [tuple(r) for r in con.execute(sql).fetchall()]
    import psycopg

    with psycopg.connect(url, autocommit=True) as con:
        con.execute("SET search_path TO kernel")
        return [tuple(r) for r in con.execute(sql).fetchall()]


#: What both files must hold alike after a purge (the sync never deletes a row).
SAME = {"runs": "SELECT run_id FROM runs",
        "events": "SELECT run_id, seq FROM events WHERE run_id != ''",
        "checkpoints": "SELECT run_id FROM checkpoints",
        "batches": "SELECT batch_id FROM batches",
        "batch_tasks": "SELECT batch_id, idx, delivery FROM batch_tasks"}


def assert_same_rows(kernel_exe: str, env: dict[str, str]) -> None:
    for table, sql in SAME.items():
        copied = sorted(tuple(r.values()) for r in query(kernel_exe, env, sql))
        assert copied == sorted(store_rows(env, sql)), table


def test_owed_deliveries_survive_purge_and_reach_the_analysts_file(
        kernel_exe: str, env: dict[str, str], tmp_path: Path, webhook: Webhook) -> None:
    """Two of four results refused by the webhook: the analysts' file counts them
    `failed` (and the rest `delivered`); `kernel purge --days 0` deletes only the two
    delivered tasks and their runs, in the store and in the file alike, keeping the
    owed ones and their batch; `--resume` then delivers the two owed results without
    running anything (exit 0), the file says `delivered` for them, and the next purge
    takes the rest and the batch."""
    effects = tmp_path / "effects"
    tasks = tmp_path / "tasks.jsonl"
    words = ["keep", "refuse", "keep", "refuse"]
    tasks.write_text("".join(json.dumps(
        {"id": f"t{i}", "command": ["sh", "-c", f"echo {i} >> {effects}; echo {w}{i}"]}) + "\n"
        for i, w in enumerate(words)))
    first = kernel(kernel_exe, env, "batch", str(tasks), "--json", "-j", "2", "--workers", "1",
                   "--webhook", webhook.url)
    assert first.returncode == 1, first.stderr  # two results owed
    docs = [json.loads(x) for x in first.stdout.splitlines()]
    assert sorted((d["task_id"], d["status"], d["delivery"]) for d in docs) == [
        ("t0", "ok", "delivered"), ("t1", "ok", "failed"), ("t2", "ok", "delivered"),
        ("t3", "ok", "failed")]
    batch_id = docs[0]["batch_id"]
    owed = sorted(d["run_id"] for d in docs if d["delivery"] == "failed")

    assert query(kernel_exe, env, "SELECT delivery, count(*) AS n FROM batch_tasks "
                                  "GROUP BY 1 ORDER BY 1") == [
        {"delivery": "delivered", "n": 2}, {"delivery": "failed", "n": 2}]
    [error] = {r["delivery_error"] for r in query(
        kernel_exe, env, "SELECT delivery_error FROM batch_runs WHERE delivery = 'failed'")}
    assert "403" in error, error

    purged = kernel(kernel_exe, env, "purge", "--days", "0", "--json")
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout)["runs"] == 2, "the owed runs stay"
    assert sorted(r[0] for r in store_rows(env, "SELECT run_id FROM runs")) == owed
    assert store_rows(env, "SELECT batch_id, status FROM batches") == [(batch_id, "finished")]
    assert len(store_rows(env, "SELECT run_id FROM events WHERE run_id != ''")) > 0
    assert_same_rows(kernel_exe, env)
    listed = kernel(kernel_exe, env, "batch", "--list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["undelivered"] == 2

    webhook.refusing = False
    resumed = kernel(kernel_exe, env, "batch", "--resume", batch_id, "--json")
    assert resumed.returncode == 0, resumed.stderr
    # The tasks the journal still keeps (was "resumed: 4 task(s)": the batch's size).
    assert "resumed: 2 task(s)" in resumed.stderr, resumed.stderr
    again = {d["task_id"]: d for d in map(json.loads, resumed.stdout.splitlines())}
    assert {t: (d["status"], d["skipped"], d["delivery"]) for t, d in again.items()} == {
        "t1": ("ok", True, "delivered"), "t3": ("ok", True, "delivered")}
    assert webhook.outputs() == ["keep0", "keep2", "refuse1", "refuse1", "refuse3", "refuse3"]
    assert sorted(effects.read_text().split()) == ["0", "1", "2", "3"]  # each ran once
    assert query(kernel_exe, env, "SELECT delivery, count(*) AS n FROM batch_tasks "
                                  "GROUP BY 1") == [{"delivery": "delivered", "n": 2}]

    purged = kernel(kernel_exe, env, "purge", "--days", "0", "--json")
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout)["runs"] == 2
    for table, sql in SAME.items():  # (an id mark may stand for the last event id)
        assert store_rows(env, sql) == [], table
    assert_same_rows(kernel_exe, env)


def test_an_analysts_file_from_before_the_delivery_columns_gets_them(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, webhook: Webhook) -> None:
    """An analysts' file at schema 6 (its batch_tasks without delivery columns, every task
    already copied): the next sync migrates it and copies every task again, with where
    its delivery stands; a sync after that copies nothing more."""
    import duckdb

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "command": ["echo", w]}) + "\n"
                             for i, w in enumerate(["keep", "refuse"])))
    done = kernel(kernel_exe, cli_env, "batch", str(tasks), "--webhook", webhook.url)
    assert done.returncode == 1, done.stderr
    synced = kernel(kernel_exe, cli_env, "sync")
    assert synced.returncode == 0, synced.stderr
    db = cli_env["KERNEL_DB"]
    with closing(duckdb.connect(db)) as con:  # back to what schema 6 made
        con.execute("CREATE OR REPLACE VIEW batch_runs AS SELECT t.batch_id, t.idx, "
                    "t.task_id, r.* FROM batch_tasks t LEFT JOIN runs r ON r.run_id = t.run_id")
        con.execute("ALTER TABLE batch_tasks DROP COLUMN delivery")
        con.execute("ALTER TABLE batch_tasks DROP COLUMN delivery_error")
        con.execute("ALTER TABLE sync_state DROP COLUMN tasks_rev")
        con.execute("DELETE FROM schema_version WHERE version > 6")

    got = query(kernel_exe, cli_env, "SELECT task_id, delivery FROM batch_runs ORDER BY idx")
    assert got == [{"task_id": "t0", "delivery": "delivered"},
                   {"task_id": "t1", "delivery": "failed"}]
    with closing(duckdb.connect(db, read_only=True)) as con:
        assert con.execute("SELECT max(version) FROM schema_version").fetchone() == (7,)
        assert con.execute("SELECT tasks_rev FROM sync_state").fetchall() == [(None,)]
    again = kernel(kernel_exe, cli_env, "sync", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["runs"] == 0
