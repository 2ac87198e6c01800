"""The `RunStore` contract, run against both stores: the embedded journal (SQLite) and a
real PostgreSQL server started by the test session (tests/pg_server.py)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.audit import JournalAudit, Store, sync
from batteries.budget import JournalBudget
from batteries.checkpoint import JournalCheckpointer
from batteries.store import (
    ClaimRun,
    FinishRun,
    Journal,
    LoseRun,
    Owner,
    RegisterRun,
    ReleaseRun,
    RemoveBudget,
    Reservation,
    ReserveBudget,
    RunStore,
    SaveCheckpoint,
    SetBudget,
    SettleBudget,
    SQLiteStore,
    StoreError,
    journal_path,
)
from batteries.store._types import _proc_start
from kernel import Checkpoint, Kernel, Ports, RunInfo, Status, Step, Usage
from kernel.testing import ScriptedAgent

SPEC: dict[str, Any] = {"agent": {"kind": "loop", "path": "/x.yaml"}, "info": {}, "limits": {}}


@pytest.fixture(params=["sqlite", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path, request: pytest.FixtureRequest,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[RunStore]:
    """The store under test; for PostgreSQL a new database, also made this process's store
    (`$KERNEL_STORE`) so that code choosing the store itself (sync) picks it."""
    made: Any
    if kind == "sqlite":
        made = SQLiteStore(journal_path(tmp_path / "kernel.duckdb"),
                           legacy=tmp_path / "kernel.duckdb")
    else:
        from batteries.store import PostgresStore

        url = request.getfixturevalue("pg_url")
        monkeypatch.setenv("KERNEL_STORE", url)
        made = PostgresStore(url)
    yield made
    made.close()


def _sql(store: Any, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read or change the store's tables directly (what another machine would see)."""
    if isinstance(store, SQLiteStore):
        import sqlite3

        with closing(sqlite3.connect(store.path, isolation_level=None)) as con:
            return con.execute(sql.replace("%s", "?"), params).fetchall()
    import psycopg

    with psycopg.connect(store.url, autocommit=True) as con:
        con.execute("SET search_path TO kernel")
        cur = con.execute(sql, params)
        return cur.fetchall() if cur.description else []


def _dead_owner() -> Owner:
    """A process of this host that has exited."""
    proc = subprocess.Popen(["true"])
    owner = Owner(socket.gethostname(), proc.pid, None)
    proc.wait()
    return owner


class TestRuns:
    def test_register_save_finish(self, store: RunStore) -> None:
        """A registered run is `running`, held by its owner; a save moves its state and
        usage; finishing drops the state."""
        me = Owner.me()
        store.commit(None, [RegisterRun("r1", SPEC, me)])
        [saved] = store.saved_runs(run_id="r1")
        assert (saved.status, saved.owner, saved.checkpoint.state) == ("running", me, None)
        assert saved.heartbeat_at is not None
        cp = Checkpoint("r1", 3, {"state": "b"}, Usage(10, 5, 0, 0.25), 2)
        assert store.commit(None, [SaveCheckpoint(cp, me)]) == [True]
        [saved] = store.saved_runs(prefix="r")
        assert (saved.checkpoint.steps, saved.checkpoint.state) == (3, {"state": "b"})
        assert saved.checkpoint.usage == Usage(10, 5, 0, 0.25)
        assert [s.run_id for s in store.saved_runs(running=True)] == ["r1"]
        store.commit(None, [FinishRun("r1", "completed")])
        [saved] = store.saved_runs(run_id="r1")
        assert (saved.status, saved.checkpoint.state) == ("completed", None)
        assert store.saved_runs(running=True) == []

    def test_a_refused_op_is_undone_alone(self, store: RunStore) -> None:
        """A save for a run never registered is refused (its error is its result); the
        other operations of the transaction are committed."""
        me = Owner.me()
        results = store.commit(None, [SaveCheckpoint(Checkpoint("nobody", 1, {}), me),
                                      RegisterRun("r2", SPEC, me)])
        assert isinstance(results[0], StoreError) and "never registered" in str(results[0])
        assert [s.run_id for s in store.saved_runs()] == ["r2"]
        # With its spec, a save registers the run itself.
        store.commit(None, [SaveCheckpoint(Checkpoint("r3", 1, {"s": 1}), me, SPEC)])
        assert [s.run_id for s in store.saved_runs()] == ["r2", "r3"]

    def test_lose_makes_a_row_for_a_run_that_never_wrote_one(self, store: RunStore) -> None:
        """LoseRun closes the run's row, making one from its info if there is none."""
        [made] = store.commit(None, [LoseRun("r4", "gone", {"name": "n", "caller_id": "c"})])
        [again] = store.commit(None, [LoseRun("r4", "gone", {"name": "n"})])
        assert (made, again) == (True, False)
        with store.changes(0, 0) as ch:
            [row] = ch.runs()
        assert (row[0], row[3], row[4], row[9]) == ("r4", "n", "c", "lost")

    def test_text_the_database_would_refuse_is_kept_readable(self, store: RunStore) -> None:
        """A NUL character or a lone surrogate in an error does not fail the transaction."""
        store.commit(None, [RegisterRun("r5", SPEC, Owner.me())])
        store.commit(None, [FinishRun("r5", "failed", "bad \x00 byte \udc80 here")])
        [saved] = store.saved_runs(run_id="r5")
        assert saved.status == "failed"


class TestLeases:
    def test_a_live_holder_keeps_its_run(self, store: RunStore) -> None:
        """A claim is refused while the holder on this host is alive, taken once it is gone,
        and then refused to everyone else."""
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            alive = Owner(socket.gethostname(), sleeper.pid, _proc_start(sleeper.pid))
            store.commit(None, [RegisterRun("r1", SPEC, alive)])
            me = Owner.me()
            assert store.commit(None, [ClaimRun("r1", me)]) == [False]
        finally:
            sleeper.kill()
            sleeper.wait()
        assert store.commit(None, [ClaimRun("r1", me)]) == [True]
        assert store.commit(None, [ClaimRun("r1", me)]) == [True]  # already mine
        other = Owner(socket.gethostname(), 1, None)  # pid 1 is alive
        assert store.commit(None, [ClaimRun("r1", other)]) == [False]
        # Released, it is anybody's.
        store.commit(None, [ReleaseRun("r1", me)])
        assert store.commit(None, [ClaimRun("r1", other)]) == [True]

    def test_a_recycled_pid_is_not_the_holder(self, store: RunStore) -> None:
        """A holder whose pid now belongs to a process started at another time is gone."""
        me = Owner.me()
        assert me.started is not None
        store.commit(None, [RegisterRun("r1", SPEC, Owner(me.host, me.pid, me.started - 1))])
        assert store.commit(None, [ClaimRun("r1", me)]) == [True]

    def test_interrupted_lists_what_a_recoverer_may_take(self, store: RunStore,
                                                         kind: str) -> None:
        """A dead local holder's run is interrupted; a live one's and a fresh remote one's
        are not; a remote one silent past the lease is, on the shared store only."""
        store.commit(None, [RegisterRun("dead", SPEC, _dead_owner()),
                            RegisterRun("live", SPEC, Owner.me()),
                            RegisterRun("remote", SPEC, Owner("elsewhere.example", 9, 1)),
                            RegisterRun("done", SPEC, _dead_owner()),
                            FinishRun("done", "completed")])
        assert [r.run_id for r in store.interrupted()] == ["dead"]
        _sql(store, "UPDATE checkpoints SET heartbeat_at = heartbeat_at - 120000000")
        expected = ["dead", "remote"] if kind == "postgres" else ["dead"]
        assert [r.run_id for r in store.interrupted()] == expected

    def test_a_holder_proved_gone_by_the_claimer(self, store: RunStore) -> None:
        """A claimer with proof of the holder's death (a dispatcher saw its node die) takes
        the run over from any host; proof about another owner is no proof."""
        remote = Owner("another-host.example", 4242, 99)
        store.commit(None, [RegisterRun("r1", SPEC, remote)])
        me = Owner.me()
        wrong = Owner("another-host.example", 4242, 98)
        assert store.commit(None, [ClaimRun("r1", me, gone=wrong)]) == [False]
        assert store.commit(None, [ClaimRun("r1", me, gone=remote)]) == [True]

    def test_finished_runs_cannot_be_claimed(self, store: RunStore) -> None:
        store.commit(None, [RegisterRun("r1", SPEC, _dead_owner()), FinishRun("r1", "failed")])
        assert store.commit(None, [ClaimRun("r1", Owner.me())]) == [False]

    def test_a_holder_on_another_host(self, store: RunStore, kind: str) -> None:
        """On another host nothing is provable from here: the embedded store never takes
        such a run over; the shared store does once the holder's heartbeat is older than
        the lease by the server's clock, never before."""
        remote = Owner("another-host.example", 4242, 99)
        store.commit(None, [RegisterRun("r1", SPEC, remote)])
        me = Owner.me()
        assert store.commit(None, [ClaimRun("r1", me)]) == [False]
        # Its heartbeat stopped two minutes ago (the lease is 60 s).
        _sql(store, "UPDATE checkpoints SET heartbeat_at = heartbeat_at - 120000000")
        [taken] = store.commit(None, [ClaimRun("r1", me)])
        assert taken is (kind == "postgres")
        # A run its remote holder released is held by nobody: anyone may take it.
        store.commit(None, [RegisterRun("r2", SPEC, remote), ReleaseRun("r2", remote)])
        assert store.commit(None, [ClaimRun("r2", me)]) == [True]

class TestSharedStore:
    """The shared store's alone: heartbeats (on one machine liveness is proved by the pid),
    and a feed cursor that stays exact while transactions commit out of order."""

    @pytest.fixture
    def store(self, pg_url: str) -> Iterator[Any]:
        from batteries.store import PostgresStore

        made = PostgresStore(pg_url)
        yield made
        made.close()

    def test_a_fresh_heartbeat_keeps_a_remote_holder(self, store: Any) -> None:
        """A remote holder whose heartbeat is within the lease keeps its run."""
        remote = Owner("another-host.example", 4242, 99)
        store.commit(None, [RegisterRun("r1", SPEC, remote)])
        _sql(store, "UPDATE checkpoints SET heartbeat_at = heartbeat_at - 30000000")
        assert store.commit(None, [ClaimRun("r1", Owner.me())]) == [False]

    def test_the_heartbeat_refreshes_this_process_runs(self, store: Any) -> None:
        """Only the runs this process holds are refreshed."""
        me = Owner.me()
        store.commit(None, [RegisterRun("mine", SPEC, me),
                            RegisterRun("theirs", SPEC, Owner("elsewhere", 7, 1))])
        _sql(store, "UPDATE checkpoints SET heartbeat_at = heartbeat_at - 120000000")
        assert store.heartbeat() == 1
        ages = dict(_sql(store, "SELECT run_id, (extract(epoch from clock_timestamp()) "
                                "* 1000000)::bigint - heartbeat_at FROM checkpoints"))
        assert ages["mine"] < 60e6 < ages["theirs"]

    def test_the_heartbeat_thread_runs_while_runs_are_held(self, pg_url: str) -> None:
        """Registering a run starts the heartbeat thread; closing the store stops it."""
        from batteries.store import PostgresStore

        store = PostgresStore(pg_url, lease=0.2)
        store.commit(None, [RegisterRun("mine", SPEC, Owner.me())])
        _sql(store, "UPDATE checkpoints SET heartbeat_at = heartbeat_at - 120000000")
        deadline = time.monotonic() + 60
        while _sql(store, "SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint "
                          "- heartbeat_at FROM checkpoints")[0][0] > 60e6:
            assert time.monotonic() < deadline, "no heartbeat in 60 s"
            time.sleep(0.05)
        beat = store._beat
        assert beat is not None and beat.is_alive()
        store.close()
        assert not beat.is_alive()


    def test_a_row_committed_late_is_synced_once(self, store: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        """A slow transaction that wrote first and commits last: the sync in between copies
        nothing of what committed after it started, the next one copies both, once."""
        import psycopg

        monkeypatch.setenv("KERNEL_STORE", store.url)
        db = tmp_path / "kernel.duckdb"
        store.commit(None, [])  # create the tables
        insert = ("INSERT INTO kernel.events (run_id, seq, ts, kind) VALUES (%s, 0, 0, 'x')")
        with psycopg.connect(store.url) as slow, \
                psycopg.connect(store.url, autocommit=True) as fast:
            slow.execute(insert, ("slow",))  # its transaction stays open
            fast.execute(insert, ("fast",))  # committed now, by a later transaction
            early = sync(db)
            slow.commit()
        late = sync(db)
        assert (early.events, late.events) == (0, 2)
        with Store(db).reader(fresh=False) as cur:
            assert sorted(cur.execute("SELECT run_id FROM events").fetchall()) == \
                [("fast",), ("slow",)]


class TestBudgets:
    def test_check_and_reserve(self, store: RunStore) -> None:
        """Runs are reserved until the budget is used up; settling records the spend."""
        assert store.commit(None, [ReserveBudget("ann", "")]) == [None]  # no budget
        store.commit(None, [SetBudget("ann", 3600, 2, None, None, None)])
        found = [store.commit(None, [ReserveBudget("ann", f"r{i}")])[0] for i in range(3)]
        assert all(isinstance(r, Reservation) for r in found)
        assert [r.reservation_id is not None for r in found] == [True, True, False]
        assert found[2].budget.refusal() == "caller 'ann' used 2 of 2 runs in the last 1h"
        rid = found[0].reservation_id
        store.commit(None, [SettleBudget(rid, 1.5, 100, 0.5)])
        spent = store.budget("ann")
        assert spent is not None
        assert (spent.runs, spent.runtime_seconds, spent.tokens, spent.cost_usd) == \
            (2, 1.5, 100, 0.5)

    def test_a_lost_run_is_charged_what_its_checkpoint_saw(self, store: RunStore) -> None:
        """A run whose supervisor died before settling is charged, when it is closed
        `lost`, the tokens and cost of its last checkpoint: before, its reservation
        stayed at a run and nothing else, so killing the supervisor of an expensive
        run kept the spend out of the caller's budget. A settled run is left alone."""
        me = Owner.me()
        store.commit(None, [SetBudget("bob", 3600, None, None, 10_000, 5.0)])
        store.commit(None, [RegisterRun("dead", SPEC, me), RegisterRun("done", SPEC, me)])
        [held] = store.commit(None, [ReserveBudget("bob", "dead")])
        [fine] = store.commit(None, [ReserveBudget("bob", "done")])
        store.commit(None, [SaveCheckpoint(Checkpoint("dead", 4, {}, Usage(900, 80, 20, 1.25)),
                                           me)])
        store.commit(None, [SaveCheckpoint(Checkpoint("done", 2, {}, Usage(9, 9, 0, 9.0)), me)])
        store.commit(None, [SettleBudget(fine.reservation_id, 2.0, 30, 0.5)])
        spent = store.budget("bob")
        assert spent is not None and (spent.tokens, spent.cost_usd) == (30, 0.5)
        assert held.reservation_id is not None
        store.commit(None, [LoseRun("dead", "its supervisor is gone"),
                            LoseRun("done", "its supervisor is gone")])
        spent = store.budget("bob")
        assert spent is not None
        assert (spent.runs, spent.tokens, spent.cost_usd) == (2, 1030, 1.75)
        store.commit(None, [LoseRun("dead", "again")])  # settled once: not twice
        again = store.budget("bob")
        assert again is not None and (again.tokens, again.cost_usd) == (1030, 1.75)

    def test_a_resumed_run_gets_its_own_reservation_back(self, store: RunStore) -> None:
        """Resumed: not refused, no second row, own tokens/cost out of the spend; settles add."""
        store.commit(None, [SetBudget("ann", 3600, 1, None, 1000, None)])
        [first] = store.commit(None, [ReserveBudget("ann", "r1")])
        assert first.reservation_id is not None
        store.commit(None, [SettleBudget(first.reservation_id, 2.0, 300, 0.25)])
        [again] = store.commit(None, [ReserveBudget("ann", "r1", resumed=True)])
        assert again.reservation_id == first.reservation_id
        assert (again.budget.runs, again.budget.tokens) == (1, 0)  # caps as before r1 began
        [other] = store.commit(None, [ReserveBudget("ann", "r2")])
        assert other.reservation_id is None  # the run count is used up for new runs
        # The second session: its own runtime is added, tokens and cost are the run's totals.
        store.commit(None, [SettleBudget(first.reservation_id, 1.0, 450, 0.5)])
        spent = store.budget("ann")
        assert spent is not None
        assert (spent.runs, spent.runtime_seconds, spent.tokens, spent.cost_usd) == \
            (1, 3.0, 450, 0.5)
        # Resumed without a row of its own (the budget came later): one is made, not refused.
        [late] = store.commit(None, [ReserveBudget("ann", "r3", resumed=True)])
        after = store.budget("ann")
        assert late.reservation_id is not None and after is not None and after.runs == 2

    def test_a_resumed_run_past_the_window_reserves_anew(self, store: RunStore) -> None:
        """A run whose reservation has left the window counts (once) in the current one."""
        store.commit(None, [SetBudget("ann", 0.05, 1, None, None, None)])
        [first] = store.commit(None, [ReserveBudget("ann", "r1")])
        time.sleep(0.1)  # at least the window: the reservation is outside it now
        [again] = store.commit(None, [ReserveBudget("ann", "r1", resumed=True)])
        assert again.reservation_id is not None
        assert again.reservation_id != first.reservation_id

    def test_default_budget_and_removal(self, store: RunStore) -> None:
        """`*` applies to callers without their own budget; removing says if there was one."""
        assert store.budget("bob") is None and store.budgets() == []
        store.commit(None, [SetBudget("*", 86400, 1, None, None, None)])
        store.commit(None, [ReserveBudget("bob", "r1")])
        [refused] = store.commit(None, [ReserveBudget("bob", "r2")])
        assert refused.reservation_id is None
        bob = store.budget("bob")
        assert bob is not None and (bob.caller_id, bob.runs) == ("bob", 1)
        assert [b.caller_id for b in store.budgets()] == ["*"]
        assert store.commit(None, [RemoveBudget("*"), RemoveBudget("*")]) == [True, False]
        assert store.budget("bob") is None

    def test_a_new_budget_replaces_the_old(self, store: RunStore) -> None:
        store.commit(None, [SetBudget("ann", 60, 1, None, None, None)])
        store.commit(None, [SetBudget("ann", 120, None, 30.0, 1000, 2.5)])
        [b] = store.budgets()
        assert (b.window_seconds, b.max_runs, b.max_runtime_seconds, b.max_tokens,
                b.max_cost_usd) == (120, None, 30.0, 1000, 2.5)


class TestAudit:
    async def test_runs_events_and_the_analysts_file(self, store: RunStore,
                                                     tmp_path: Path) -> None:
        """Kernel runs through a Journal on the store: events contiguous from seq 0, rows
        closed, budgets metered, and the analysts' DuckDB file fed incrementally."""
        store.commit(None, [SetBudget("ann", 86400, 3, None, None, None)])
        async with Journal.open(tmp_path / "kernel.duckdb", store=store) as journal:
            kernel = Kernel(Ports(audit=JournalAudit(journal), budget=JournalBudget(journal),
                                  checkpointer=JournalCheckpointer(journal)))

            async def one(i: int) -> None:
                await kernel.run(ScriptedAgent([Step(), Step(), Step(final=True)]),
                                 RunInfo(name=f"r{i}", caller_id="ann"))

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(one, i)
        first = await trio.to_thread.run_sync(sync, tmp_path / "kernel.duckdb")
        again = await trio.to_thread.run_sync(sync, tmp_path / "kernel.duckdb")
        assert (first.runs, again.events, again.runs) == (5, 0, 0)
        with Store(tmp_path / "kernel.duckdb").reader(fresh=False) as cur:
            statuses = sorted(r[0] for r in cur.execute("SELECT status FROM runs").fetchall())
            seqs = cur.execute("SELECT run_id, count(*), count(DISTINCT seq), min(seq), "
                               "max(seq) FROM events GROUP BY run_id").fetchall()
            spend = cur.execute("SELECT count(*) FROM budget_spend").fetchall()
        assert statuses == ["budget_exceeded"] * 2 + ["ok"] * 3
        for _, n, distinct, lo, hi in seqs:
            assert n == distinct == hi + 1 and lo == 0
        assert spend == [(3,)]

    async def test_a_resumed_run_continues_its_seq(self, store: RunStore,
                                                   tmp_path: Path) -> None:
        """A second recorder for the same run id writes after the first one's last event."""
        async with Journal.open(tmp_path / "kernel.duckdb", store=store) as journal:
            audit = JournalAudit(journal)
            info = RunInfo(name="twice")
            rec = await audit.start_run(info)
            rec.log_event("a")
            rec.log_event("b")
            await audit.flush()
            # (Said to be a resume: a second open recorder of a run is otherwise refused.)
            again = await audit.start_run(info, resumed=True)
            again.log_event("c")
            await audit.flush()
        with store.changes(0, 0) as ch:
            events = [row for rows in ch.events() for row in rows]
        assert [(e[2], e[4]) for e in events] == [(0, "run_start"), (1, "a"), (2, "b"),
                                                  (3, "c")]

    async def test_purge(self, store: RunStore, tmp_path: Path) -> None:
        async with Journal.open(tmp_path / "kernel.duckdb", store=store) as journal:
            result = await Kernel(Ports(audit=JournalAudit(journal))).run(
                ScriptedAgent([Step(final=True)]))
        assert result.status is Status.OK
        assert store.purge(0) == (0, 0)
        runs, events = store.purge(2**62)
        assert (runs, events) == (1, 3)


def test_payloads(store: RunStore) -> None:
    """What `kernel recover` reads to find the process groups a run left."""
    assert store.payloads("nobody", "process_start") == []


def test_an_unreachable_server_refuses_runs() -> None:
    """Fail closed: a store that cannot be reached is an error (never "no budget"), and the
    kernel refuses the run budget_exceeded rather than running it unmetered."""
    pytest.importorskip("psycopg")
    from batteries.store import PostgresStore

    dead = PostgresStore("postgresql://postgres@127.0.0.1:1/nothing", lock_timeout=2)
    with pytest.raises(StoreError, match="unreachable"):
        dead.exists()

    async def main() -> Any:
        journal = Journal(store=dead)
        kernel = Kernel(Ports(audit=JournalAudit(journal), budget=JournalBudget(journal)))
        return await kernel.run(ScriptedAgent([Step(final=True)]), RunInfo(caller_id="x"))

    result = trio.run(main)
    assert result.status is Status.BUDGET_EXCEEDED and result.steps == 0
    assert "unreachable" in str(result.error)


async def test_rows_are_kept_while_the_server_is_unreachable() -> None:
    """An unreachable server is transient, like a busy journal: failed writes keep the
    buffered rows for the next transaction instead of dropping them after two tries."""
    pytest.importorskip("psycopg")
    from batteries.store import PostgresStore
    from kernel import AuditWriteError

    dead = PostgresStore("postgresql://postgres@127.0.0.1:1/nothing", lock_timeout=1)
    async with Journal.open(store=dead, flush_interval=3600) as journal:
        audit = JournalAudit(journal)
        rec = await audit.start_run(RunInfo(name="kept"))
        for i in range(10):
            rec.log_event("tick", payload={"i": i})
        for _ in range(3):
            with pytest.raises(AuditWriteError, match="unreachable"):
                await audit.flush()
        assert journal.unwritten == 0 and len(journal.pending) == 10
        assert journal.pending.new == [rec]
