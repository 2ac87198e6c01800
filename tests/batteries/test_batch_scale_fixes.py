"""Batch defects found at fleet scale, fixed in `batteries.batch` (real journals)."""

from __future__ import annotations

import os
import socket
import sqlite3
from pathlib import Path
from typing import Any

from batteries.audit import JournalAudit
from batteries.batch import BatchBusyError, BatchRunner, KernelDispatch
from batteries.checkpoint import JournalCheckpointer
from batteries.store import BatchTask, Journal, Owner, journal_path
from kernel import Checkpoint, Limits, Ports, Result, RunInfo, Status, Step, new_run_id


class Echo:
    def __init__(self, n: int) -> None:
        self.n = n

    async def step(self, ctx: Any) -> Step:
        return Step(output=self.n, final=True)


def build(spec: Any) -> tuple[Any, RunInfo, Limits]:
    return Echo(spec["n"]), RunInfo(name=f"t{spec['n']}"), Limits(timeout=60)


class EndsThenDies:
    """Runs every task, but for `task_id` the process "dies" between the two commits
    that end a run: its checkpoint is completed, its row never closed (the kernel
    completes the checkpoint, a deferred op that rides with whichever transaction comes
    next, before it closes the run's row; SIGKILL between the two)."""

    def __init__(self, inner: KernelDispatch, journal: Journal, task_id: str) -> None:
        self.inner = inner
        self.journal = journal
        self.task_id = task_id
        self.calls: list[str] = []

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result:
        self.calls.append(task.task_id)
        if task.task_id != self.task_id:
            return await self.inner(task, resume)
        ports = self.inner.ports
        cp, audit = ports.checkpointer, ports.audit
        assert isinstance(cp, JournalCheckpointer) and audit is not None
        await cp.register(task.run_id, task.spec)
        info = RunInfo(name=task.task_id)
        info.run_id = task.run_id
        recorder = await audit.start_run(info)
        assert recorder is not None
        await cp.complete(task.run_id)
        await self.journal.commit_buffered()  # both committed; the row is never closed
        raise RuntimeError("the batch process died")


async def test_a_run_that_ended_before_its_row_was_closed_is_not_said_to_keep_no_checkpoint(
        tmp_path: Path) -> None:
    """SIGKILLed `kernel batch` runs of quick commands, resumed: a few tasks each time
    (1-6 of 600 in the experiments) were closed `lost` "the batch was interrupted and
    the run kept no checkpoint", while their checkpoint said they had ended (the
    command ran, once). Now the reason says so: the run ended, its status was not
    recorded, it is not run again."""
    dead = Owner(socket.gethostname(), os.getpid(), 1)  # this pid, another start: gone
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        checkpointer = JournalCheckpointer(journal)
        checkpointer.owner = dead
        ports = Ports(audit=JournalAudit(journal), checkpointer=checkpointer)
        first = EndsThenDies(KernelDispatch(ports, build), journal, "t1")
        runner = BatchRunner(journal, first, concurrency=2, owner=dead)
        ts = [BatchTask(f"t{i}", new_run_id(), {"n": i}) for i in range(3)]
        bid = await runner.create(ts)
        outs = await runner.run(bid)
        assert [o.status for o in outs] == ["ok", "running", "ok"]
        assert not runner.finished
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        again = EndsThenDies(KernelDispatch(ports, build), journal, "none")
        resumed = await BatchRunner(journal, again).run(bid)
    assert again.calls == []  # nothing runs again
    assert [(o.status, o.skipped) for o in resumed] == [
        ("ok", True), (Status.LOST, False), ("ok", True)]
    why = resumed[1].error or ""
    assert "kept no checkpoint" not in why
    assert why == ("the run ended (its checkpoint is completed), but the batch process died "
                   "before the run's status was recorded; not run again")
    con = sqlite3.connect(journal_path(tmp_path / "k.duckdb"))
    try:
        rows = con.execute("SELECT run_id, error FROM runs WHERE status = 'lost'").fetchall()
    finally:
        con.close()
    assert rows == [(ts[1].run_id, why)]


async def test_claim_says_the_batch_is_taken_before_anything_runs(tmp_path: Path) -> None:
    """`BatchRunner.claim` (what `kernel batch` calls before it starts its workers) raises
    `BatchBusyError` for a batch another live process holds, and `run` after a claim does
    not claim again."""
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        holder = BatchRunner(journal, KernelDispatch(ports, build))
        ts = [BatchTask(f"t{i}", new_run_id(), {"n": i}) for i in range(2)]
        bid = await holder.create(ts)
        await holder.claim(bid)
        other = BatchRunner(journal, KernelDispatch(ports, build),
                            owner=Owner(socket.gethostname(), 1, None))  # pid 1: alive
        try:
            await other.claim(bid)
        except BatchBusyError as exc:
            assert f"batch {bid} is being run by pid" in str(exc)
        else:
            raise AssertionError("a held batch was claimed")
        outs = await holder.run(bid)
        assert [o.status for o in outs] == ["ok", "ok"] and holder.finished
