"""Library findings of the library/analysts' review: run id reuse, the analysts' views,
budget counts, and run specs. Real journals and DuckDB files throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from batteries.audit import JournalAudit, Store
from batteries.budget import JournalBudget
from kernel import (
    CommandSpec,
    ConfigError,
    Kernel,
    Limits,
    Ports,
    PortSpec,
    RunInfo,
    RunSpec,
    RunStats,
    Status,
    Step,
)


class Echo:
    """One final step with `text` as its output."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def step(self, ctx: object) -> Step:
        await trio.lowlevel.checkpoint()
        return Step(output=self.text, final=True)


def rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    with Store(db).reader() as cur:
        return list(cur.execute(sql).fetchall())


class TestRunIdReuse:
    """#2: a fresh run under the id of a run that is over is refused, never merged into it."""

    def test_a_reused_runinfo_does_not_overwrite_the_first_run(self, tmp_path: Path) -> None:
        """Two kernel.run calls with one RunInfo: the first run's row and events stay whole."""
        db = tmp_path / "k.duckdb"

        async def go() -> tuple[object, object]:
            async with JournalAudit.open(db) as audit:
                k = Kernel(Ports(audit=audit))
                info = RunInfo(name="reused")
                return await k.run(Echo("first"), info), await k.run(Echo("second"), info)

        first, second = trio.run(go)
        assert first.status is Status.OK  # type: ignore[attr-defined]
        # The kernel tells the audit the second is a fresh run: refused before it runs.
        assert second.status is Status.ERROR  # type: ignore[attr-defined]
        assert (second.steps, second.port_failures) == (0, [])  # type: ignore[attr-defined]
        assert "already names a run that ended ok" in second.error  # type: ignore[attr-defined]
        assert rows(db, "select output, steps from runs") == [("first", 1)]
        assert [k for (k,) in rows(db, "select kind from events order by seq")] == [
            "run_start", "step", "run_end"]

    def test_a_resume_still_continues_the_record(self, tmp_path: Path) -> None:
        """A run whose first event is `resumed` continues its record, as before."""
        db = tmp_path / "k.duckdb"
        info = RunInfo(name="resumable")

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                rec = await audit.start_run(info)
                await rec.close(RunStats(Status.CANCELLED, steps=1, reason="SIGTERM"))
                again = await audit.start_run(info)
                again.log_event("resumed", payload={"steps": 1})
                await again.close(RunStats(Status.OK, steps=2))

        trio.run(go)
        assert rows(db, "select status, steps from runs") == [("ok", 2)]

    def test_resumed_true_and_false_are_taken_at_their_word(self, tmp_path: Path) -> None:
        """resumed=True skips the check; resumed=False refuses even a cancelled run's id."""
        db = tmp_path / "k.duckdb"
        info = RunInfo(name="said")

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                rec = await audit.start_run(info)
                await rec.close(RunStats(Status.CANCELLED, steps=1))
                with pytest.raises(ConfigError, match="ended cancelled"):
                    await audit.start_run(info, resumed=False)
                again = await audit.start_run(info, resumed=True)
                await again.close(RunStats(Status.OK, steps=2))
                fresh = await audit.start_run(info)  # not said: its first call decides
                fresh.on_step(0, Step(output="other"), 0.1)
                with pytest.raises(ConfigError, match="ended ok"):
                    await fresh.close(RunStats(Status.OK, steps=1))
                live = await audit.start_run(RunInfo(name="open"))
                with pytest.raises(ConfigError, match="is still open"):
                    await audit.start_run(RunInfo(run_id=live.run_id))
                await live.close(RunStats(Status.OK))

        trio.run(go)
        assert rows(db, "select status, steps from runs where name = 'said'") == [("ok", 2)]

    def test_a_resume_in_kernel_after_max_steps_is_kept(self, tmp_path: Path) -> None:
        """Kernel.run(resume=...) under the id of a run that ended max_steps continues it."""
        from kernel import Checkpoint
        from kernel.testing import ScriptedAgent

        db = tmp_path / "k.duckdb"
        info = RunInfo(name="long job")

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                k = Kernel(Ports(audit=audit))
                first = await k.run(ScriptedAgent([Step(), Step()]), info, Limits(max_steps=2))
                assert first.status is Status.MAX_STEPS
                again = await k.run(Echo("done"), info,
                                    resume=Checkpoint(info.run_id, 2, {"calls": 2}))
                assert again.port_failures == [], again.port_failures

        trio.run(go)
        assert rows(db, "select output from runs") == [("done",)]

    def test_a_host_id_reused_in_a_new_process_is_refused(self, tmp_path: Path) -> None:
        """A host's own id ("job-42") is looked up in the journal: a second audit refuses it."""
        db = tmp_path / "k.duckdb"

        async def once(text: str) -> object:
            async with JournalAudit.open(db) as audit:  # a new audit: nothing remembered
                return await Kernel(Ports(audit=audit)).run(Echo(text),
                                                            RunInfo(run_id="job-42"))

        assert trio.run(once, "first").status is Status.OK  # type: ignore[attr-defined]
        second = trio.run(once, "second")
        assert second.status is Status.ERROR  # type: ignore[attr-defined]
        assert "'job-42' already names a run" in second.error  # type: ignore[attr-defined]
        assert rows(db, "select output from runs") == [("first",)]


class TestOpenRunStatusInViews:
    """#13: a run still open is `running` in critic_decisions, as in run_stats and `kernel runs`."""

    def test_critic_decisions_say_running(self, tmp_path: Path) -> None:
        """run_status is 'running' while the run is open, its status once closed."""
        db = tmp_path / "k.duckdb"
        info = RunInfo(name="live")

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                rec = await audit.start_run(info)
                rec.log_event("critic", name="nudge", payload={"reason": "quiet"})
                await audit.flush()
                assert rows(db, "select run_status from critic_decisions") == [("running",)]
                assert rows(db, "select status from runs") == [(None,)]  # the column: NULL
                await rec.close(RunStats(Status.KILLED, reason="stalled"))

        trio.run(go)
        assert rows(db, "select run_status from critic_decisions") == [("killed",)]


class TestBudgetCounts:
    """#15: budget counts are whole numbers in the library as in the CLI."""

    @pytest.mark.parametrize("field", ["max_runs", "max_tokens"])
    @pytest.mark.parametrize("value", [1.5, 2.0, True])
    def test_a_fractional_count_is_refused(self, tmp_path: Path, field: str,
                                           value: object) -> None:
        """max_runs=1.5 (or a float, or a bool) is a ValueError naming the field."""
        budget = JournalBudget(tmp_path / "k.duckdb")
        with pytest.raises(ValueError, match=f"{field} must be a whole number"):
            budget.set("y", **{field: value})  # type: ignore[arg-type]
        budget.set("y", **{field: 2})
        got = budget.status("y")
        assert got is not None and getattr(got, field) == 2


class TestRunSpecRoundTrip:
    """#12: a CommandSpec keeps argv as a tuple, so specs round-trip equal and hash."""

    def test_list_argv_round_trips_equal(self) -> None:
        """RunSpec(CommandSpec([...])) == RunSpec.from_json(its JSON); the spec hashes."""
        what = CommandSpec(["echo", "hi"], {"k": "v"})  # type: ignore[arg-type]
        assert what.argv == ("echo", "hi")
        spec = RunSpec(what, RunInfo(name="x"), Limits(), PortSpec())
        assert RunSpec.from_json(spec.to_json()) == spec
        assert hash(what) == hash(CommandSpec(("echo", "hi"), {"k": "other"}))
        assert {what} == {CommandSpec(("echo", "hi"), {"k": "v"})}


class TestWhatRecoveryNeedsIsWrittenAtOnce:
    @pytest.mark.parametrize("kind", ["process_start"])
    async def test_it_does_not_wait_for_the_flush_timer(self, tmp_path: Path,
                                                        kind: str) -> None:
        """A `process_start` (the group `kernel recover` must stop before resuming) is
        written at once, not at the next timed flush: a supervisor killed in that second
        (with its lifeline watcher) left no trace of it, and a state ran beside its own
        orphan. Here the timer is an hour; the event is
        in the journal (read by another connection) while the run is still open."""
        import sqlite3
        from contextlib import closing

        from batteries.store import journal_path

        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db, flush_interval=3600.0) as audit:
            rec = await audit.start_run(RunInfo(name="r"))
            assert rec is not None
            rec.log_event("step_note", name="not urgent")  # waits for the timer ...
            rec.log_event(kind, name="x", payload={"pid": 1})  # ... until this one comes

            def seen() -> list[str]:
                if not journal_path(db).exists():
                    return []  # made by the first write
                with closing(sqlite3.connect(f"file:{journal_path(db)}?mode=ro",
                                             uri=True)) as con:
                    try:
                        return [k for (k,) in con.execute("SELECT kind FROM events")]
                    except sqlite3.OperationalError:  # created, not yet migrated
                        return []

            with trio.fail_after(120):  # real time: a worker thread writes it
                while True:  # another connection's view: no event to wait on
                    if kind in await trio.to_thread.run_sync(seen):
                        break
                    await trio.sleep(0.01)
            assert "step_note" in await trio.to_thread.run_sync(seen)
            await rec.close(RunStats(status=Status.OK))
