"""The journal's exit flush never drops rows: what it cannot write is spilled, then replayed.

A process whose journal stays locked past the lock timeout as it exits (another
connection holding `BEGIN EXCLUSIVE`, here for real) used to drop the rows it
still held (a run's close, its budget settlement, its checkpoint's completion,
its last events) with an error logged. They now go to a spill file beside the
journal (0600, written atomically), which the next process that opens the
journal writes exactly once and removes; a spill that cannot be read is moved
aside with a warning and never fails an open.

Real parts throughout: SQLite files, a second connection holding the lock,
`kernel run` processes. Nothing waits on the clock: a process boundary is
crossed by waiting for a file or a journal row.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.budget import JournalBudget
from batteries.checkpoint import JournalCheckpointer
from batteries.store import (
    Batch,
    BatchTask,
    ClaimBatch,
    ClaimRun,
    CreateBatch,
    FinishBatch,
    FinishRun,
    Journal,
    LoseRun,
    MarkDelivery,
    Op,
    Owner,
    RegisterRun,
    ReleaseRun,
    RemoveBudget,
    ReserveBudget,
    SaveCheckpoint,
    SetBudget,
    SettleBudget,
    SQLiteStore,
    journal_path,
)
from kernel import Checkpoint, Kernel, Limits, Ports, RunInfo, Status, Step, Usage

pytestmark = pytest.mark.realtime

PATIENCE = 120.0  # bounds on waits for another process: only ever reached by a hang
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers


class Rec:
    """A recorder as the store sees one (`RecorderRef`): hand-written, no audit."""

    def __init__(self, info: RunInfo, *, base: int | None, count: int) -> None:
        self.run_id = info.run_id
        self.info = info
        self.started_us = 1_700_000_000_000_000
        self.count = count
        self.base = base
        self.host = "spill-host"
        self.pid = 4242


def every_op() -> list[Op]:
    """One operation of every kind, with every field set to something but its default,
    in an order a journal takes (the run registered before it is saved, ...)."""
    me = Owner("spill-host", 4242, 99)
    cp = Checkpoint("run-a", 3, {"n": [1, 2.5, None], "s": "é \ud800 ✓"},
                    Usage(11, 22, 33, 0.125), 4)
    return [
        RegisterRun("run-a", {"agent": {"kind": "loop"}, "info": {"name": "a"}}, me),
        SaveCheckpoint(cp, me, {"agent": {"kind": "loop"}}, None),
        SaveCheckpoint(Checkpoint("run-a", 4, None, Usage(12, 23, 34, 0.25), 5), me, None,
                       '{"n": 4}'),
        ClaimRun("run-a", me, Owner("elsewhere", 7, None)),
        ReleaseRun("run-a", me),
        FinishRun("run-a", "failed", "it broke: \ud800"),
        LoseRun("run-b", "its supervisor is gone", {"name": "b", "inputs": {"k": 1}},
                1_700_000_000_000_001),
        SetBudget("ivy", 3600.0, 5, 100.0, 1000, 2.5),
        ReserveBudget("ivy", "run-a", False),
        SettleBudget(1, 1.5, 30, 0.25),
        RemoveBudget("nobody"),
        CreateBatch("batch-1", (BatchTask("t1", "run-c", {"agent": {"kind": "command"}}),
                                BatchTask("t2", "run-d", {"agent": {}})), me, "nightly",
                    "tasks.jsonl", 3, {"retries": 2}),
        ClaimBatch("batch-1", me),
        MarkDelivery("batch-1", ((0, "failed", "it broke: \ud800"), (1, None, None))),
        FinishBatch("batch-1", me),
    ]


def every_row() -> Batch:
    """A batch of every kind of audit row: a new run (its start, events, close) and a run
    whose start was written before (known base), events with empty fields."""
    new = Rec(RunInfo(name="new ✓", run_id="run-new", subject_id="s", caller_id="ivy",
                      channel_id="c", parent_run_id="run-a", inputs={"x": [1, "é"]}),
              base=None, count=3)
    old = Rec(RunInfo(name="old", run_id="run-old"), base=1, count=2)
    batch = Batch()
    for rec, seq, kind, it, name, dur, payload in [
            (new, 0, "step", 0, None, 1.5, '{"final": false}'),
            (old, 0, "log", None, "tick", None, '{"line": "\\u00e9"}'),
            (new, 1, "tool_end", 1, "grep", 2.0, "{}"),
            (old, 1, "run_end", None, None, None, '{"status": "ok"}'),
            (new, 2, "run_end", None, None, None, '{"status": "error"}')]:
        batch.recs.append(rec)
        batch.seqs.append(seq)
        batch.ts.append(1_700_000_000_000_100 + seq)
        batch.kinds.append(kind)
        batch.iters.append(it)
        batch.names.append(name)
        batch.durs.append(dur)
        batch.payloads.append(payload)
    batch.new.append(new)
    batch.closes.append((new, ("run-new", 1_700_000_000_000_200, "error", "out", "boom", 2,
                               1, 0.75, 10, 20, 0, 0.5, "why", 1, True)))
    batch.closes.append((old, ("run-old", 1_700_000_000_000_300, "ok", None, None, 1, 0,
                               0.25, None, None, None, None, None, 0, False)))
    return batch


def spill_files(directory: Path, prefix: str) -> list[Path]:
    """The spill files of the journal named `prefix` (not those moved aside)."""
    return sorted(p for p in directory.glob(f"{prefix}.spill-*")
                  if re.fullmatch(r"\d+-[0-9a-f]{32}", p.name.rsplit(".spill-", 1)[1]))


def _with_the_old_run(path: Path) -> SQLiteStore:
    """A journal where `every_row`'s run of known base was opened (its start written)."""
    store = SQLiteStore(path)
    store.commit(Batch(new=[Rec(RunInfo(name="old", run_id="run-old"), base=None, count=0)]))
    return store


def dump(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """A journal's rows, without what the clock of the writing moment decides."""
    queries = {
        "runs": "SELECT run_id, parent_run_id, subject_id, name, caller_id, channel_id, "
                "inputs, started_at, ended_at, status, output, error, steps, tool_calls, "
                "runtime_seconds, input_tokens, output_tokens, thinking_tokens, cost_usd, "
                "host, pid, reason, exit_code, output_truncated, last_seq FROM runs "
                "WHERE status IS NULL OR status != 'lost' ORDER BY run_id",
        "lost": "SELECT run_id, name, inputs, status, exit_code, reason, error FROM runs "
                "WHERE status = 'lost'",
        "events": "SELECT run_id, seq, ts, kind, iteration, name, duration_ms, payload "
                  "FROM events ORDER BY run_id, seq",
        "checkpoints": "SELECT run_id, spec, state, steps, tool_calls, input_tokens, "
                       "output_tokens, thinking_tokens, cost_usd, status, error, host, pid, "
                       "pid_start FROM checkpoints ORDER BY run_id",
        "budgets": "SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, "
                   "max_tokens, max_cost_usd FROM budgets ORDER BY caller_id",
        "spend": "SELECT id, caller_id, run_id, runtime_seconds, tokens, cost_usd, settled "
                 "FROM budget_spend ORDER BY id",
        "batches": "SELECT batch_id, name, source, status, tasks, concurrency, options, "
                   "host, pid, pid_start FROM batches",
        "batch_tasks": "SELECT batch_id, idx, task_id, run_id, spec FROM batch_tasks",
    }
    with sqlite3.connect(path) as con:
        return {k: con.execute(q).fetchall() for k, q in queries.items()}


def meta_keys(path: Path) -> list[str]:
    with sqlite3.connect(path) as con:
        return [k for (k,) in con.execute("SELECT key FROM meta WHERE key LIKE 'spill:%'")]


# ------------------------------------------------------------------ the format


def test_the_spill_format_round_trips_every_row_and_every_operation() -> None:
    """Every `Op` kind and every column of a `Batch` come back equal (versioned JSON)."""
    from batteries.store._types import SPILL_VERSION, decode_spill, encode_spill

    ops = every_op()
    assert {type(op) for op in ops} == set(typing.get_args(Op))  # none left out
    batch = every_row()
    text = encode_spill(batch, ops, spill_id="ab" * 16, store="k.duckdb.journal")
    doc = json.loads(text)
    assert doc["version"] == SPILL_VERSION and doc["format"] == "kernel-journal-spill"
    got = decode_spill(text)
    assert (got.spill_id, got.store) == ("ab" * 16, "k.duckdb.journal")
    assert list(got.ops) == ops
    b = got.batch
    for column in ("seqs", "ts", "kinds", "iters", "names", "durs", "payloads"):
        assert getattr(b, column) == getattr(batch, column), column
    # Recorders: one object per spilled recorder, shared by its events, new and closes.
    assert [r.run_id for r in b.recs] == [r.run_id for r in batch.recs]
    assert b.recs[0] is b.new[0] is b.closes[0][0] and b.recs[1] is b.closes[1][0]
    assert [(r.base, r.count, r.started_us, r.host, r.pid) for r in (b.recs[0], b.recs[1])] \
        == [(None, 3, 1_700_000_000_000_000, "spill-host", 4242),
            (1, 2, 1_700_000_000_000_000, "spill-host", 4242)]
    info = b.recs[0].info
    assert (info.name, info.subject_id, info.caller_id, info.channel_id, info.parent_run_id,
            info.inputs) == ("new ✓", "s", "ivy", "c", "run-a", {"x": [1, "é"]})
    assert [row for _, row in b.closes] == [row for _, row in batch.closes]


@pytest.mark.parametrize("text", [
    "", "not json", "[]", '{"format": "kernel-journal-spill", "version": 99, "id": "x", '
    '"store": "s"}', '{"format": "something else"}',
    '{"format": "kernel-journal-spill", "version": 1, "id": "x", "store": "s", '
    '"events": {"rec": [3]}}',
    '{"format": "kernel-journal-spill", "version": 1, "id": "x", "store": "s", '
    '"ops": [{"op": "DropTables"}]}',
])
def test_a_spill_that_cannot_be_read_is_one_error(text: str) -> None:
    from batteries.store._types import SpillError, decode_spill

    with pytest.raises(SpillError):
        decode_spill(text)


def test_every_operation_replayed_from_a_spill_writes_what_a_commit_writes(
        tmp_path: Path) -> None:
    """The same rows and operations, committed directly to one journal and spilled then
    replayed into another, leave the same rows (times of the writing moment aside)."""
    direct = _with_the_old_run(tmp_path / "a" / "k.duckdb.journal")
    results = direct.commit(every_row(), every_op())
    assert not any(isinstance(r, Exception) for r in results), results
    direct.close()

    spilled = _with_the_old_run(tmp_path / "b" / "k.duckdb.journal")
    spilled.close()
    path = spilled.spill(every_row(), every_op())
    assert path.parent == tmp_path / "b" and spill_files(path.parent, path.name.split(
        ".spill-")[0]) == [path]
    again = SQLiteStore(tmp_path / "b" / "k.duckdb.journal")
    again.commit(None, [])  # the first write replays the spill
    again.close()
    assert not path.exists()
    assert dump(tmp_path / "b" / "k.duckdb.journal") == dump(tmp_path / "a" / "k.duckdb.journal")


# ------------------------------------------------------- the exit flush, for real


class LockAtTheEnd:
    """Three steps; the last takes the journal's write lock (another connection's
    `BEGIN EXCLUSIVE`) before it returns, so the run closes on a locked journal."""

    def __init__(self, lock: Callable[[], None]) -> None:
        self.n = 0
        self.lock = lock

    async def step(self, ctx: object) -> Step:
        await trio.lowlevel.checkpoint()
        self.n += 1
        if self.n == 3:
            self.lock()
            return Step(output="done", final=True, usage=Usage(5, 7, 0, 0.01))
        return Step(output=f"step {self.n}")

    def snapshot(self) -> dict[str, int]:
        return {"n": self.n}


async def _run_closing_on_a_locked_journal(db: Path, holder: sqlite3.Connection
                                           ) -> tuple[Journal, str]:
    async with Journal.open(db, lock_timeout=0.3, flush_interval=3600) as journal:
        budget = JournalBudget(journal)
        budget.set("ivy", max_runs=5)
        checkpointer = JournalCheckpointer(journal)
        info = RunInfo(name="closes locked", caller_id="ivy")
        await checkpointer.register(info.run_id, {"agent": {"kind": "test"}})
        ports = Ports(audit=JournalAudit(journal), budget=budget, checkpointer=checkpointer)
        result = await Kernel(ports).run(
            LockAtTheEnd(lambda: holder.execute("BEGIN EXCLUSIVE")), info,
            Limits(max_steps=10, timeout=PATIENCE))
        assert result.status is Status.OK and result.steps == 3
        # The close could not be written: a port failure, never a changed status.
        assert any(f.port == "audit" for f in result.port_failures), result.port_failures
    return journal, info.run_id


def test_rows_a_locked_journal_refuses_at_exit_are_spilled_and_written_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The reviewer's case: the journal stays locked (`BEGIN EXCLUSIVE` by another
    connection) past the lock timeout while a run closes and its process exits. Before:
    the run's close, its events since the last save, its checkpoint's completion and its
    budget settlement were dropped with an error, the run `running` for ever (and
    resumed by `kernel recover`). Now they are in a spill file beside the journal,
    and opening the journal again writes them, once."""
    db = tmp_path / "kernel.duckdb"
    path = journal_path(db)
    SQLiteStore(path).commit(None, [])  # the journal exists, for the other connection
    holder = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        with caplog.at_level(logging.WARNING, logger="kernel.journal"):
            journal, run_id = trio.run(_run_closing_on_a_locked_journal, db, holder)
        assert journal.unwritten == 0 and journal.spilled > 0
        spill = journal.spill_path
        assert spill is not None and spill.parent == path.parent
        assert spill.name.startswith(path.name + ".spill-")
        assert stat.S_IMODE(spill.stat().st_mode) == 0o600
        assert [r for r in caplog.records if "kept in" in r.getMessage()]
        assert not [r for r in caplog.records if "could not be written:" in r.getMessage()]
        # What the journal holds while it is still locked: the run open, not settled.
        with sqlite3.connect(path) as con:
            assert con.execute("SELECT run_id, status FROM runs").fetchall() == [
                (run_id, None)]
            assert con.execute("SELECT status FROM checkpoints").fetchall() == [("running",)]
            assert con.execute("SELECT settled FROM budget_spend").fetchall() == [(0,)]
    finally:
        holder.execute("ROLLBACK")
        holder.close()

    async def open_again() -> None:
        async with Journal.open(db) as again:
            await again.transact()

    trio.run(open_again)
    assert not spill.exists() and spill_files(path.parent, path.name) == []
    with sqlite3.connect(path) as con:
        [(status, steps, tokens)] = con.execute(
            "SELECT status, steps, input_tokens + output_tokens FROM runs").fetchall()
        assert (status, steps, tokens) == ("ok", 3, 12)
        kinds = [k for (k,) in con.execute("SELECT kind FROM events ORDER BY seq")]
        seqs = [s for (s,) in con.execute("SELECT seq FROM events ORDER BY seq")]
        assert seqs == list(range(len(seqs))) and kinds[0] == "run_start"
        assert kinds[-1] == "run_end" and kinds.count("step") == 3
        assert con.execute("SELECT status, state FROM checkpoints").fetchall() == [
            ("completed", None)]
        [(settled, runtime, spent)] = con.execute(
            "SELECT settled, runtime_seconds, tokens FROM budget_spend").fetchall()
        assert settled == 1 and runtime > 0 and spent == 12
    before = dump(path)
    assert len(meta_keys(path)) == 1
    trio.run(open_again)  # a second open: nothing written twice
    assert dump(path) == before


def _spill_of_a_closing_run(tmp_path: Path) -> tuple[Path, Path]:
    """A journal with a run whose close (5 events, the roll-up) is in a spill file."""
    path = tmp_path / "k.duckdb.journal"
    store = SQLiteStore(path)
    rec = Rec(RunInfo(name="spilled", run_id="run-s"), base=None, count=0)
    opening = Batch(new=[rec])
    store.commit(opening)
    assert rec.base == 1
    closing = Batch()
    for i in range(5):
        closing.recs.append(rec)
        closing.seqs.append(i)
        closing.ts.append(1_700_000_000_000_000 + i)
        closing.kinds.append("tick")
        closing.iters.append(None)
        closing.names.append(None)
        closing.durs.append(None)
        closing.payloads.append(json.dumps({"i": i}))
    closing.closes.append((rec, ("run-s", 1_700_000_000_000_010, "ok", "out", None, 5, 0,
                                 1.0, 0, 0, 0, 0.0, None, 0, False)))
    rec.count = 5
    store.close()
    return path, store.spill(closing, [])


def _events(path: Path) -> int:
    with sqlite3.connect(path) as con:
        return int(con.execute("SELECT count(*) FROM events").fetchone()[0])


def test_a_spill_found_twice_is_written_once(tmp_path: Path) -> None:
    """A process that died after committing a spill and before removing it leaves the
    file: the spill's key in the journal makes the next open remove it unwritten (here
    the same spill under two names: written once, both removed)."""
    path, spill = _spill_of_a_closing_run(tmp_path)
    twin = spill.with_name(spill.name.replace(".spill-", ".spill-1"))
    shutil.copy(spill, twin)
    store = SQLiteStore(path)
    store.commit(None, [])
    store.close()
    assert _events(path) == 1 + 5 and not spill.exists() and not twin.exists()


REPLAY = """
import sys
from pathlib import Path
from batteries.store import SQLiteStore
store = SQLiteStore(Path(sys.argv[1]), lock_timeout=60)
Path(sys.argv[2]).touch()
while not Path(sys.argv[3]).exists():
    pass
store.commit(None, [])
"""


def test_processes_opening_together_write_a_spill_once(tmp_path: Path) -> None:
    """Four processes open the journal for writing at the same moment: the spill is
    written by one of them, once."""
    path, spill = _spill_of_a_closing_run(tmp_path)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", REPLAY, str(path),
                               str(tmp_path / f"ready-{i}"), str(go)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
             for i in range(4)]
    deadline = time.monotonic() + PATIENCE
    while not all((tmp_path / f"ready-{i}").exists() for i in range(4)):
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        assert time.monotonic() < deadline, "the processes never got ready"
        time.sleep(0.01)
    go.touch()
    assert [p.wait(timeout=PATIENCE) for p in procs] == [0] * 4
    assert _events(path) == 1 + 5 and not spill.exists()
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("ok",)]


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe binary",
                                     b'{"format": "kernel-journal-spill", "version": 99}'])
def test_a_spill_that_cannot_be_read_is_moved_aside_and_never_fails_an_open(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "k.duckdb.journal"
    SQLiteStore(path).commit(None, [])
    bad = tmp_path / f"{path.name}.spill-1-{'0' * 32}"
    bad.write_bytes(content)
    store = SQLiteStore(path)
    with caplog.at_level(logging.WARNING, logger="kernel.journal"):
        [ok] = store.commit(None, [SetBudget("ivy", 60.0, 1, None, None, None)])
    store.close()
    assert ok is None and not bad.exists()
    assert bad.with_name(bad.name + ".bad").read_bytes() == content
    [line] = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert "\n" not in line and bad.name in line
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT caller_id FROM budgets").fetchall() == [("ivy",)]


def test_a_spill_the_journal_refuses_is_moved_aside_and_the_open_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A spill whose events another writer already recorded (the same seqs): refused
    whole (its savepoint undone), moved aside `.rejected`; the open's own write lands."""
    path, spill = _spill_of_a_closing_run(tmp_path)
    doc = json.loads(spill.read_text())
    store = SQLiteStore(path)
    store.commit(None, [])  # written (and removed)
    store.close()
    assert _events(path) == 1 + 5 and not spill.exists()
    # The same rows again under another spill id: their seqs are taken now.
    doc["id"] = "f" * 32
    forged = path.parent / f"{path.name}.spill-2-{'f' * 32}"
    forged.write_text(json.dumps(doc))
    store = SQLiteStore(path)
    with caplog.at_level(logging.WARNING, logger="kernel.journal"):
        [ok] = store.commit(None, [SetBudget("ivy", 60.0, 1, None, None, None)])
    store.close()
    assert ok is None and not forged.exists()
    assert forged.with_name(forged.name + ".rejected").exists()
    assert _events(path) == 1 + 5
    assert any("refused" in r.getMessage() and "moved aside" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------ kernel run, for real


def test_a_kernel_run_closing_on_a_locked_journal_is_recorded_by_the_next_command(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel run -- CMD` whose command ends while another connection holds the journal
    (`BEGIN EXCLUSIVE`) past `$KERNEL_AUDIT_LOCK_TIMEOUT`: the process exits with the
    command's code and leaves a spill file; once the lock is gone, `kernel recover`
    finds nothing to recover (before: the run looked interrupted and was closed `lost`)
    and `kernel runs` shows it `ok` with every event."""
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    go = tmp_path / "go"
    script = f"echo up; while [ ! -e {go} ]; do sleep 0.02; done; echo done"
    proc = subprocess.Popen([kernel_exe, "run", "--no-critic", "--", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    path = journal_path(Path(env["KERNEL_DB"]))
    holder = None
    try:
        deadline = time.monotonic() + PATIENCE
        while True:  # the run is open and its command started: its process_start row
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never recorded its command"
            if path.exists():
                with sqlite3.connect(path) as con:
                    if con.execute("SELECT count(*) FROM events "
                                   "WHERE kind = 'process_start'").fetchone()[0]:
                        break
            time.sleep(0.02)
        holder = sqlite3.connect(path, isolation_level=None, timeout=PATIENCE)
        holder.execute("BEGIN EXCLUSIVE")
        go.touch()
        out, err = proc.communicate(timeout=PATIENCE)
        assert proc.returncode == 0, err
        assert out.strip().endswith("done")
        [spill] = spill_files(path.parent, path.name)
        assert stat.S_IMODE(spill.stat().st_mode) == 0o600
        assert "Traceback" not in err
    finally:
        if holder is not None:
            holder.execute("ROLLBACK")
            holder.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with sqlite3.connect(path) as con:  # not yet written: nobody opened the journal since
        assert con.execute("SELECT status FROM runs").fetchall() == [(None,)]
    rec = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True,
                         env=cli_env, timeout=PATIENCE, cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    assert rec.stdout.strip() == "" and "no interrupted runs" in rec.stderr, rec.stderr
    assert not spill.exists()
    runs = subprocess.run([kernel_exe, "runs", "--json"], capture_output=True, text=True,
                          env=cli_env, timeout=PATIENCE, cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    [row] = [json.loads(line) for line in runs.stdout.splitlines() if line.strip()] \
        if not runs.stdout.lstrip().startswith("[") else json.loads(runs.stdout)
    assert row["status"] == "ok", row
    with sqlite3.connect(path) as con:
        kinds = [k for (k,) in con.execute("SELECT kind FROM events ORDER BY seq")]
        assert con.execute("SELECT status FROM checkpoints").fetchall() == [("completed",)]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and "process_exit" in kinds
