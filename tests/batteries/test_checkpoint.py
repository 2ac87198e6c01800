"""Checkpoints in a real journal: save, complete, fail, find and claim interrupted runs."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.checkpoint import DuckDBCheckpointer, JournalCheckpointer
from batteries.store import ClaimRun, Journal, Owner, StoreError, journal_path
from kernel import Checkpoint, Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import Hang, ScriptedAgent

SPEC = {"agent": {"kind": "test"}, "info": {}, "limits": {}}


class TestDuckDBCheckpointer:
    async def test_saves_and_completes(self, tmp_path: Path) -> None:
        """Saves are durable as they happen; an ok run ends completed with its state dropped."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo(name="c")
        await cp.register(info.run_id, SPEC)
        seen: list[int] = []

        async def look(ctx: RunContext) -> Step:
            saved = await trio.to_thread.run_sync(cp.load, info.run_id)
            assert saved is not None
            seen.append(saved.checkpoint.steps)
            return Step(final=ctx.iteration == 3)

        agent = ScriptedAgent(then=look)
        result = await Kernel(Ports(checkpointer=cp)).run(agent, info, Limits())
        assert result.status is Status.OK
        assert seen == [0, 1, 2, 3]  # each step sees the previous step's save
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "completed"
        assert saved.checkpoint.state is None

    async def test_failed_run_is_not_interrupted(self, tmp_path: Path) -> None:
        """A run that failed is marked failed and never offered for recovery."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo()
        await cp.register(info.run_id, SPEC)
        await Kernel(Ports(checkpointer=cp)).run(ScriptedAgent([Step(), ValueError("v")]), info)
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "failed"
        assert cp.interrupted() == []

    async def test_cancelled_run_keeps_its_checkpoint(self, tmp_path: Path) -> None:
        """A run cancelled by shutdown stays `running` with its last state, for recovery."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo()
        await cp.register(info.run_id, SPEC)
        with trio.move_on_after(1):
            await Kernel(Ports(checkpointer=cp)).run(
                ScriptedAgent([Step(), Step(), Hang()]), info, Limits())
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "running"
        assert saved.checkpoint.steps == 2 and saved.checkpoint.state == {"calls": 2}
        # This process is alive, so it is not interrupted yet.
        assert cp.interrupted() == []

    async def test_dead_process_is_interrupted(self, tmp_path: Path) -> None:
        """A running row whose pid is gone is offered for recovery; find() takes a prefix."""
        import subprocess
        import sys

        db = tmp_path / "k.duckdb"
        code = ("import trio, sys\nfrom batteries.checkpoint import DuckDBCheckpointer\n"
                "trio.run(DuckDBCheckpointer(sys.argv[1]).register, 'deadbeef' * 4, "
                "{'agent': {'kind': 'loop'}})")
        subprocess.run([sys.executable, "-c", code, str(db)], check=True)
        cp = DuckDBCheckpointer(db)
        [saved] = cp.interrupted()
        assert saved.run_id == "deadbeef" * 4 and saved.pid != os.getpid()
        assert [r.run_id for r in cp.find("deadbe")] == [saved.run_id]
        cp.mark_failed(saved.run_id, "given up")
        assert cp.interrupted() == []


def test_export_includes_the_batteries_tables(tmp_path: Path) -> None:
    """`kernel export` writes the checkpoint and budget tables too, not only runs/events."""
    import subprocess
    import sys

    from batteries.budget import DuckDBBudget

    db = tmp_path / "k.duckdb"
    DuckDBBudget(db).set("x", max_runs=1)
    trio.run(DuckDBCheckpointer(db).register, "ab" * 16, SPEC)
    exe = str(Path(sys.executable).parent / "kernel")
    out = subprocess.run([exe, "export", str(tmp_path / "out"), "--db", str(db)],
                         check=True, capture_output=True, text=True).stdout
    names = {Path(p).name for p in out.split()}
    assert {"runs.parquet", "events.parquet", "budgets.parquet", "checkpoints.parquet"} <= names


class TestSaveNeverLost:
    async def test_a_save_for_a_run_never_registered_fails_loudly(self, tmp_path: Path) -> None:
        """Saving a run nobody registered raises (it used to save nothing, silently)."""
        cp = JournalCheckpointer(tmp_path / "k.duckdb")
        with pytest.raises(StoreError, match="never registered"):
            await cp.save(Checkpoint("ab" * 16, 1, {"state": "x"}))
        assert cp.load("ab" * 16) is None

    async def test_a_save_upserts_when_the_spec_is_known(self, tmp_path: Path) -> None:
        """Registered with this checkpointer but not yet written: the save writes the row."""
        async with Journal.open(tmp_path / "k.duckdb") as shared:
            cp = JournalCheckpointer(shared)
            await cp.register("cd" * 16, SPEC)  # deferred: rides along with the next write
            await cp.save(Checkpoint("cd" * 16, 2, {"state": "b"}))
            saved = await trio.to_thread.run_sync(cp.load, "cd" * 16)
        assert saved is not None and saved.status == "running"
        assert saved.checkpoint.steps == 2 and saved.checkpoint.state == {"state": "b"}
        assert shared.store.stats.transactions == 2  # the save (registration included), the load

    async def test_a_kernel_run_saves_after_every_step_in_one_transaction_each(
            self, tmp_path: Path) -> None:
        """With the audit and the checkpointer on one journal, each save also makes the
        events so far durable: after step N the journal holds step N's events."""
        async with JournalAudit.open(tmp_path / "k.duckdb", flush_interval=3600) as audit:
            journal = audit.journal
            cp = JournalCheckpointer(journal)
            info = RunInfo(name="c")
            await cp.register(info.run_id, SPEC)
            seen: list[int] = []

            async def look(ctx: RunContext) -> Step:
                seen.append(await trio.to_thread.run_sync(_steps_in_journal, tmp_path, info))
                return Step(final=ctx.iteration == 3)

            before = journal.store.stats.transactions
            result = await Kernel(Ports(audit=audit, checkpointer=cp)).run(
                ScriptedAgent(then=look), info, Limits())
        assert result.status is Status.OK
        assert seen == [0, 1, 2, 3]
        # 3 saves (after steps 1-3; the final step needs none) and the close.
        assert journal.store.stats.transactions - before == 4


    async def test_an_agent_that_never_awaits_still_times_out(self, tmp_path: Path) -> None:
        """Saves that nobody could share skip trio's scheduler, but not for long: a run
        whose steps never await anything still reaches its deadline (and the critic's
        and the journal's tasks their turn) through its saves."""
        async with JournalAudit.open(tmp_path / "k.duckdb") as audit:
            cp = JournalCheckpointer(audit.journal)
            info = RunInfo(name="busy")
            await cp.register(info.run_id, SPEC)

            async def busy(ctx: RunContext) -> Step:  # never yields to trio
                return Step(final=ctx.iteration >= 200_000)  # a bound, so a bug fails, not hangs

            result = await Kernel(Ports(audit=audit, checkpointer=cp)).run(
                ScriptedAgent(then=busy), info, Limits(max_steps=None, timeout=0.2))
        assert result.status is Status.TIMEOUT, result
        assert not result.port_failures


def _steps_in_journal(tmp_path: Path, info: RunInfo) -> int:
    with closing(sqlite3.connect(journal_path(tmp_path / "k.duckdb"))) as con:
        try:
            return int(con.execute("SELECT count(*) FROM events WHERE run_id = ? AND "
                                   "kind = 'step'", (info.run_id,)).fetchone()[0])
        except sqlite3.OperationalError:
            return 0  # no journal yet


class TestLeases:
    async def test_two_claims_one_winner(self, tmp_path: Path) -> None:
        """A dead holder's run is claimed by exactly one of two recoverers; a live holder's
        run by none."""
        db = tmp_path / "k.duckdb"
        code = ("import trio, sys\nfrom batteries.checkpoint import JournalCheckpointer\n"
                "trio.run(JournalCheckpointer(sys.argv[1]).register, 'dead' * 8, "
                "{'agent': {'kind': 'loop'}})")
        subprocess.run([sys.executable, "-c", code, str(db)], check=True)
        alive = JournalCheckpointer(db)
        await alive.register("a1" * 16, SPEC)
        first, second = JournalCheckpointer(db), JournalCheckpointer(db)
        # Two checkpointers in one process share its pid: make the second another owner.
        second.owner = Owner(second.owner.host, os.getpid(), -1)
        assert [r.run_id for r in first.interrupted()] == ["dead" * 8]
        assert first.claim("dead" * 8) is True
        assert second.claim("dead" * 8) is False  # the first holder is alive
        assert first.claim("a1" * 16) is True  # same process and start time: its own lease
        assert second.claim("a1" * 16) is False
        assert first.interrupted() == []

    def test_a_zombie_holder_is_gone(self) -> None:
        """A holder that died and was never reaped (a zombie) is gone: it holds nothing."""
        from batteries.store._types import _proc_stat

        child = subprocess.Popen(["true"])  # not waited for: a zombie once it exits
        try:
            start = None
            deadline = time.monotonic() + 120  # wide: the machine may be loaded
            while time.monotonic() < deadline:  # until the kernel reports it dead
                stat = _proc_stat(child.pid)
                if stat is None:
                    pytest.skip("no /proc here")
                start = stat[1]
                if stat[0] == "Z":
                    break
                os.sched_yield()
            else:
                pytest.fail("the child never became a zombie")
            assert Owner(Owner.me().host, child.pid, start).gone()
        finally:
            child.wait()

    def test_a_holder_on_another_host_is_taken_over_only_with_proof(
            self, tmp_path: Path) -> None:
        """A holder on another host is never presumed dead; a claim that names it as gone
        (a cluster manager saw it die) takes it over, and one naming anyone else does not."""
        db = tmp_path / "k.duckdb"
        away = JournalCheckpointer(db)
        away.owner = Owner("another-host", 4242, 99)
        trio.run(away.register, "r" * 32, SPEC)
        store = JournalCheckpointer(db).store
        me = Owner.me()
        assert store.commit(None, [ClaimRun("r" * 32, me)]) == [False]
        stale = Owner("another-host", 4242, 98)  # the pid, but another start time
        assert store.commit(None, [ClaimRun("r" * 32, me, gone=stale)]) == [False]
        assert store.commit(None, [ClaimRun("r" * 32, me, gone=away.owner)]) == [True]
        [saved] = store.saved_runs(run_id="r" * 32)
        assert saved.owner == me
        # The proof was about the old holder: it takes nothing from the new one.
        other = Owner("third-host", 1, 1)
        assert store.commit(None, [ClaimRun("r" * 32, other, gone=away.owner)]) == [False]

    def test_a_recycled_pid_is_not_the_holder(self, tmp_path: Path) -> None:
        """A holder whose pid now belongs to a process that started later is gone."""
        me = Owner.me()
        if me.started is None:
            pytest.skip("no /proc here: process start times are unknown")
        assert not me.gone()
        assert Owner(me.host, me.pid, me.started - 1).gone()
        assert not Owner("another-host", 1, None).gone()  # nothing provable from here


async def test_a_refused_save_does_not_take_the_audit_down(tmp_path: Path) -> None:
    """A save for an unregistered run fails alone: the run's events in the same transaction
    are still written, and later writes go on."""
    async with JournalAudit.open(tmp_path / "k.duckdb", flush_interval=3600) as audit:
        cp = JournalCheckpointer(audit.journal)
        info = RunInfo(name="unregistered")
        result = await Kernel(Ports(audit=audit, checkpointer=cp)).run(
            ScriptedAgent([Step(), Step(), Step(final=True)]), info)
    assert result.status is Status.OK
    assert [(f.port, f.method) for f in result.port_failures] == [("checkpointer", "save")]
    assert "never registered" in result.port_failures[0].error
    assert _steps_in_journal(tmp_path, info) == 3
