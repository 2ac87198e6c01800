"""`Journal`: the trio side of a `RunStore`, shared by the audit, budget and checkpointer.

The shape of it::

    trio thread                         Journal                        worker thread
    recorder.on_step / log_event ...    pending Batch (column lists)
      -> append, no I/O                 pending ops (finish, settle)
    budget.check / checkpoint.save      transact(ops): swap pending,   store.commit(batch, ops):
    recorder.close                      -> start_thread_soon ------>   one transaction
                                        _done <- run_sync_soon -----   (one write at a time)
    the event that fills a batch        starts its write at once; a batch filled during a
                                        write starts as that write ends (`_done`)
    flusher task (while open)           after flush_interval: whatever is left

A write starts from a plain call on the trio thread and its end comes back
through trio's `run_sync_soon` queue, so no task is scheduled to start or to
end a write: at 10,000 runs a trip through trio's scheduler takes ~0.1 s,
and the three or four trips a write used to need (the flusher's wake-up, a
lock, a thread's return) left the writer idle between transactions and the
last rows to be written after the runs ended (BENCHMARKS.md, "Writes back to
back").

A transaction runs on the trio thread itself when it is small (at most
`INLINE_EVENTS` events), this process's connection is open and the write
lock is free at that instant (SQLite's busy timeout is 0 for that attempt:
no waiting); otherwise in a worker thread. A commit costs tens of
microseconds; two thread switches ~100 us on an idle machine and
milliseconds on a loaded one.

Every transaction carries whatever is buffered, so the writes a run needs
anyway (a budget reservation when it opens, a checkpoint after each step,
its roll-up when it closes) also make its events durable: after a crash
the audit holds every event up to the last checkpoint. Operations that need
no answer before the run goes on (a checkpoint's `complete`, a budget's
settlement) are deferred and ride along with the next transaction, which
is why a `kernel run` touches the store twice: when its run opens and when
it closes.

A transaction that fails keeps the buffered rows for the next one when the
failure is transient (`StoreBusyError`: a journal locked past the lock
timeout, and its subclass `StoreUnreachableError`, a PostgreSQL server that
cannot be reached or closed the connection); the rows wait for the next
transaction however long that takes (up to `max_pending_events`). A batch
that fails twice in a row for any other reason (a value the store will never
take, a disk I/O error) is dropped and logged, so it cannot block every
later run. On exit (`Journal.open`) what is left is written with retries
(pauses from `RETRY_FIRST` doubling to `RETRY_MAX`) while the failure is
transient, for at most the store's lock timeout: a store back within it
gets every row. Rows still not written then (the journal locked past the
timeout, the server unreachable, or a failure that is not transient) are
never dropped: the store keeps them in a *spill file* (`store.spill`: beside
the journal, 0600, named by pid and a random id so processes never collide,
written to a temporary name, fsynced and renamed into place, versioned JSON
of every buffered row and operation), with a warning naming it. The next
transaction that opens that store for writing, in any process, commits every
spill it finds before its own rows, exactly once (a key per spill in the
store's `meta` table, set in the same transaction), then removes the files;
readers that find the write lock free do it too (`kernel recover`, `sync`).
The same writers remove the temporary file of a spill whose writer died before
renaming it, and delete the `meta` keys of spills none of whose files is left
(see "Tidying" in `_sqlite`). `spilled` and `spill_path` say what was kept
and where (`JournalAudit` has them too; the CLI prints a line naming the file).
A spill that cannot be read is moved aside (`.bad`) with a one-line warning.
Only a spill that cannot be written (a full or read-only disk) loses the
rows, with an error logged and `unwritten` counting them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import outcome
import trio

from ._protocol import RunStore
from ._sqlite import WouldBlock
from ._types import Batch, FinishRun, Op, StoreBusyError

_log = logging.getLogger("kernel.journal")


#: Seconds after which `transact` yields to trio even when nobody could share its
#: transaction (see `Journal.transact`).
YIELD_EVERY = 0.002

#: Transactions carrying at most this many events may run on the trio thread when the
#: write lock is free at once (see `Journal.transact`).
INLINE_EVENTS = 256

#: The exit flush retries a transient failure after this many seconds, the pause doubling
#: up to `RETRY_MAX`, for at most the store's lock timeout (see `Journal._final_flush`).
RETRY_FIRST = 0.05
RETRY_MAX = 1.0

#: The exit flush's bound when the store names no lock timeout of its own.
DEFAULT_LOCK_TIMEOUT = 10.0


def transient(exc: BaseException) -> bool:
    """True for a failure the next transaction may not meet: the journal stayed locked
    (`StoreBusyError`) or the server could not be reached (`StoreUnreachableError`, a
    `StoreBusyError` too). Rows that failed so are kept, never dropped."""
    return isinstance(exc, StoreBusyError)


def _abort_parked(raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
    """The abort function of a task parked in `Journal.commit_buffered`: it may go at once.

    Its entry in `Journal._parked` stays until the next write ends, which skips it
    (trio set the task's `custom_sleep_data` to None when it rescheduled it).
    """
    return trio.lowlevel.Abort.SUCCEEDED


class _Waiter:
    """A caller waiting for a write: its ops, and what their transaction gave back."""

    __slots__ = ("done", "error", "ops", "results", "taken", "task")

    def __init__(self, ops: tuple[Op, ...]) -> None:
        self.ops = ops
        self.taken = False  # a write carries its ops
        self.done = False  # that write ended
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.task: trio.lowlevel.Task | None = None  # parked until `done`


class Journal:
    """The per-process writer of one journal (see the module docstring).

    Use `Journal.open(db)` to run the timed flusher; a Journal that is not
    open still works, writing every deferred operation at once.

    Args:
        db: The analysts' DuckDB file; the journal is the file beside it
            (`batteries.store.journal_path`). None means `$KERNEL_DB`, else
            the user data dir.
        store: The store to write (default: `batteries.store.open_store(db)`: the
            PostgreSQL store chosen with `--store` / `$KERNEL_STORE`, else
            `SQLiteStore` on that journal).
        batch_size: Buffered events that start a write without waiting for the timer.
        flush_interval: Seconds after which buffered events are written anyway.
        lock_timeout: Seconds to wait for the journal's write lock
            (None: `$KERNEL_AUDIT_LOCK_TIMEOUT`, else 10).
        max_pending_events: While writes keep failing, at most this many
            events are buffered; later ones are dropped and reported.
    """

    def __init__(self, db: str | os.PathLike[str] | None = None, *,
                 store: RunStore | None = None, batch_size: int = 10_000,
                 flush_interval: float = 1.0, lock_timeout: float | None = None,
                 max_pending_events: int = 1_000_000) -> None:
        if store is None:
            from ._select import open_store

            store = open_store(db, lock_timeout=lock_timeout)
        self.store = store
        self.db: Path | None = store.legacy
        self.batch_size = max(1, batch_size)
        self.flush_interval = flush_interval
        self.max_pending_events = max_pending_events
        #: Events buffered on the trio thread, not yet written.
        self.pending = Batch()
        #: Events given up on (the journal never took them).
        self.unwritten = 0
        #: Deferred operations given up on with them, or alone (a batch's finish, its
        #: delivery marks, a checkpoint's end): lost writes too, though not events.
        self.unwritten_ops = 0
        #: Events kept in a spill file at exit (see `_final_flush`), and its path.
        self.spilled = 0
        self.spill_path: Path | None = None
        #: Transactions the flush timer started (events buffered past `flush_interval`).
        self.timed_flushes = 0
        #: The last write error, if the last write failed.
        self.last_error: str | None = None
        self.retry_len = 0
        #: Below this many buffered events (and above none) a new event needs none of
        #: the recorder's checks: the buffer is not full, the flush timer is running
        #: and the batch is not yet `batch_size`, or its fill was noted while a write
        #: was in flight (`poke`; see `_retrying`).
        self.fast_until = 0
        self._retrying(0)
        self._deferred: list[Op] = []
        #: Runs with an open recorder on this journal (the audit's `start_run` adds,
        #: its close takes away), and the `FinishRun`s held until that close.
        self.recording: set[str] = set()
        self._held: dict[str, list[Op]] = {}
        self._failures = 0
        # Group commit: writes are numbered as they take the pending rows; `_durable`
        # is the number of the last one that committed. Rows buffered before write N
        # took its batch are durable once `_durable >= N`.
        self._begun = 0
        self._durable = 0
        # A write is in flight in a worker thread (one at a time: it owns the store).
        self._writing = False
        self._urgent = False  # `soon`: write what is buffered as the write in flight ends
        # The `commit_buffered` callers waiting for the write in flight, woken together
        # when it ends (see `commit_buffered`).
        self._parked: list[trio.lowlevel.Task] = []
        # `transact` callers whose ops no write has taken yet.
        self._queue: list[_Waiter] = []
        self._dirty = trio.Event()
        self._yielded_at = 0.0  # when `transact` last yielded to trio
        self.running = False

    def __repr__(self) -> str:
        return f"Journal({str(self.store.path)!r})"

    @classmethod
    @asynccontextmanager
    async def open(cls, db: str | os.PathLike[str] | None = None,
                   **options: Any) -> AsyncIterator[Journal]:
        """Run the timed flusher for the `async with` body; write everything left on exit.

        Opening does no I/O: the journal is created (and migrated) by the
        first transaction that needs it.
        """
        journal = cls(db, **options)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(journal._flusher, scope)
            journal.running = True
            try:
                yield journal
            finally:
                with trio.CancelScope(shield=True):
                    scope.cancel()
                    journal.running = False
                    await journal._final_flush()
                    await trio.to_thread.run_sync(journal.store.close)

    # ------------------------------------------------------------- writing

    def poke(self, *, now: bool = False) -> None:
        """Something was buffered: start the flush timer; with `now` (the batch is full),
        start writing it at once unless a write is in flight (whose end starts the next).

        Called on the trio thread by the recorders, so it never writes here: the write
        goes to a worker thread (`_start`), with no trip through trio's scheduler.
        """
        self._dirty.set()
        if now:
            if self.running and not self._writing:
                self._start((), inline=False)
            else:
                # The full batch is noted (the write in flight starts the next as it ends):
                # until the next swap, the recorder's only check is the buffer's limit.
                self.fast_until = self.max_pending_events - self.retry_len

    def soon(self) -> None:
        """Something was buffered that must not wait for the flush timer: start writing
        it now (in a worker thread), or as soon as the write in flight ends.

        For what recovery reads if this process dies in the next second: a process
        group starting (`process_start`: `kernel recover` stops it before resuming)
        or a tool call starting (`tool_start`: it may have had its effect). It does
        not wait for the write: the window shrinks from the flush interval to the
        write's own milliseconds. On the trio thread, like `poke`.
        """
        self._dirty.set()
        if not self.running:
            return
        if self._writing:
            self._urgent = True
        else:
            self._start((), inline=False)

    async def transact(self, ops: Sequence[Op] = ()) -> list[Any]:
        """Write everything buffered, then `ops`, in one transaction; return the ops' results.

        Callers that are ready at the same moment share one transaction (group
        commit of operations): each queues its ops and yields once, and the
        first to go on starts one write of every queued caller's ops in order;
        the others find their results waiting. Callers arriving while a write
        is in flight are taken together by the next write, which starts as that
        one ends. A caller with no other task ready to run (nobody to share
        with) writes at once without yielding. Many runs opening at once (a
        batch) cost a few transactions, not one each. An op the store refuses
        (a save for a run never registered) raises its `StoreError` here after
        the rest of the transaction was committed; it never fails another
        caller's op. A caller cancelled after a write took its ops waits for
        that write to end and gets its results (as `trio.to_thread.run_sync`);
        its cancellation is raised at its next checkpoint.

        Raises:
            StoreBusyError: The journal stayed locked past the lock timeout
                (the buffered rows are kept for the next transaction).
            StoreError: The journal cannot be written.
        """
        if self._alone():
            # No other task is ready to run, so none could join this transaction: write
            # it now, without a trip through trio's scheduler (~10 us of a checkpoint
            # save). A cancelled caller still stops here, and a caller that has not
            # yielded here for YIELD_EVERY does (timers and I/O get their turn even if
            # the run's agent never awaits anything between its saves).
            await trio.lowlevel.checkpoint_if_cancelled()
            results = self._transact_now(ops)
            if results is not None:
                return results
            me = _Waiter(tuple(ops))  # it must wait for the write lock: in a thread
            self._queue.append(me)
            self._start((), inline=False)
        else:
            me = _Waiter(tuple(ops))
            self._queue.append(me)
            if not self._writing:
                try:
                    await trio.lowlevel.checkpoint()  # callers ready now queue theirs too
                except BaseException:
                    if not me.taken:
                        self._queue.remove(me)
                    raise
                if not me.taken and not self._writing:
                    self._yielded_at = time.perf_counter()
                    self._start((), inline=True)
        while not me.done:
            if not me.taken and not self._writing:  # handed the next write by `_done`
                self._yielded_at = time.perf_counter()
                self._start((), inline=True)
            else:
                await self._wait(me)
        if me.error is not None:
            raise me.error
        for res in me.results:
            if isinstance(res, Exception):
                raise res
        return me.results

    async def _wait(self, me: _Waiter) -> None:
        """Park until the write carrying `me` ends. Cancellable while no write took it."""
        me.task = trio.lowlevel.current_task()

        def abort(raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            if me.taken:
                # Its write is in flight: it waits for the write's end (as
                # `trio.to_thread.run_sync` does) and sees the cancellation at its next
                # checkpoint.
                return trio.lowlevel.Abort.FAILED
            self._queue.remove(me)
            me.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def commit_buffered(self) -> None:
        """Make everything buffered so far durable, sharing transactions with other callers.

        Callers that arrive while a write is in flight wait for it to end, all
        woken at once (parked on the journal: a task parked on a trio `Lock`
        keeps the `WouldBlock` it caught and its tracebacks alive); those whose
        rows it carried return, and the first of the others writes everything
        buffered meanwhile while the rest wait for that (many runs closing at
        once cost a few transactions, not one each). A caller no other task
        could join writes at once, as in `transact`.

        A waiting caller is the task itself in a list, parked with trio's
        `wait_task_rescheduled` and a module-level abort function: three
        objects while it waits, against eight for a `trio.Event.wait` (its
        coroutine, abort closure and cells). At 10,000 runs closing together
        each waits through a write of ~100,000 events, long enough for the
        collector to move what it holds to the oldest generation, and those
        objects were what set off its full passes over every live run
        (BENCHMARKS.md, "The runs' close and the collector, shared parameters").

        Raises:
            StoreBusyError: The journal stayed locked past the lock timeout.
            StoreError: The journal cannot be written.
        """
        if self._alone():  # nobody could share it: at once, as `transact` does
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._transact_now(()) is not None:
                return
        need = self._begun + 1  # the first write to take its batch after this call
        if not self._writing:
            await trio.lowlevel.checkpoint()  # callers ready now buffer theirs too
        while self._writing:
            task = trio.lowlevel.current_task()
            task.custom_sleep_data = self  # trio resets it if the wait is cancelled
            self._parked.append(task)
            await trio.lowlevel.wait_task_rescheduled(_abort_parked)
            if self._durable >= need:
                return
        if self._durable >= need:
            return
        self._yielded_at = time.perf_counter()
        me = _Waiter(())
        self._start((me,), inline=True)
        if not me.done:
            await self._wait(me)
        if me.error is not None:
            raise me.error

    def _alone(self) -> bool:
        """True when no other task could join a transaction started now (see `transact`)."""
        return (not self._queue and not self._writing
                and time.perf_counter() - self._yielded_at < YIELD_EVERY
                and trio.lowlevel.current_statistics().tasks_runnable == 0)

    def _start(self, extra: Sequence[_Waiter], *, inline: bool) -> None:
        """Start one write of everything buffered, the deferred ops, the queued callers'
        ops and `extra`'s. On the trio thread, with no write in flight.

        With `inline`, a small write (at most `INLINE_EVENTS` events) that can take the
        write lock at once commits here: tens of microseconds against two thread
        switches (~100 us idle, milliseconds on a loaded machine). Otherwise it goes
        to a worker thread, and `_done` runs on the trio thread when it ends (from
        trio's `run_sync_soon` queue: no task is scheduled to start or end a write).
        """
        group = [*self._queue, *extra] if self._queue else list(extra)
        self._queue = []
        for w in group:
            w.taken = True
        self._begun += 1
        number = self._begun
        # Nothing buffered: the pending batch stays (no new Batch per write).
        todo = None if self.pending.empty() else self.pending
        if todo is not None:
            self.pending = Batch()
            self._retrying(self.retry_len)  # a new batch to fill: the recorder checks again
        deferred = self._deferred
        if deferred:
            self._deferred = []
        ops = [*deferred, *(op for w in group for op in w.ops)]
        if inline and (todo is None or len(todo) <= INLINE_EVENTS):
            try:
                results = self.store.commit(todo, ops, wait=False)
            except WouldBlock:
                pass
            except BaseException as exc:
                self._done(number, todo, deferred, group, outcome.Error(exc))
                if not isinstance(exc, Exception):
                    raise
                return
            else:
                self._done(number, todo, deferred, group, outcome.Value(results))
                return
        self._writing = True
        token = trio.lowlevel.current_trio_token()
        commit = self.store.commit

        def deliver(result: outcome.Outcome[list[Any]]) -> None:  # in the worker thread
            with contextlib.suppress(trio.RunFinishedError):  # nobody is left to tell
                token.run_sync_soon(self._done, number, todo, deferred, group, result)

        trio.lowlevel.start_thread_soon(lambda: commit(todo, ops), deliver,
                                        name=f"kernel journal write {number}")

    def _done(self, number: int, todo: Batch | None, deferred: list[Op],
              group: list[_Waiter], result: outcome.Outcome[list[Any]]) -> None:
        """A write ended (on the trio thread): tell its callers and every parked caller;
        then start the next write at once if a full batch is buffered, else wake a
        queued caller to start it."""
        self._writing = False
        ok = isinstance(result, outcome.Value)
        if isinstance(result, outcome.Value):
            self._durable = number
            results = result.value
            self._committed(deferred, results, True)
            at = len(deferred)
            for w in group:
                w.results = results[at:at + len(w.ops)]
                at += len(w.ops)
        else:
            assert isinstance(result, outcome.Error)
            exc = result.error
            batch = Batch() if todo is None else todo
            if isinstance(exc, Exception):
                self._failed(batch, deferred, exc)
            else:
                self._keep(batch, deferred)
            for w in group:
                w.error = exc
            self._dirty.set()  # the flusher retries kept rows after its interval
        if len(group) > 1 or self._parked:
            # Other callers go on now, perhaps later in trio's current batch, which
            # `_alone` cannot see: the next caller yields (and they may join it).
            self._yielded_at = 0.0
        for w in group:
            w.done = True
            if w.task is not None:
                trio.lowlevel.reschedule(w.task)
                w.task = None
        parked = self._parked
        if parked:
            self._parked = []
            for task in parked:
                # A task whose wait was cancelled was rescheduled by trio, which set its
                # `custom_sleep_data` to None: it is not woken twice (nor in a later wait
                # on something else).
                if task.custom_sleep_data is self:
                    trio.lowlevel.reschedule(task)
        urgent, self._urgent = self._urgent, False
        if ok and self.running and (urgent or len(self.pending) >= self.batch_size):
            self._start((), inline=False)  # the next full (or `soon`) batch, at once
        else:
            # Callers queued during the write: the first of them parked starts the next
            # one when it runs, after the tasks ready now (which may queue theirs too, as
            # with a lock). Not one still running (in its yield, before it parks): it
            # may yet be cancelled there and leave the others waiting. If it starts the
            # write first, the woken one finds itself taken.
            for w in self._queue:
                if w.task is not None:
                    trio.lowlevel.reschedule(w.task)
                    w.task = None
                    break

    def _committed(self, deferred: list[Op], results: list[Any], raw: bool) -> list[Any]:
        """After a commit: the failure count reset, refused deferred ops logged; the results
        of the caller's ops (a refused one raised unless `raw`)."""
        self.last_error = None
        self._failures = 0
        self._retrying(0)
        for op, res in zip(deferred, results, strict=False):
            if isinstance(res, Exception):
                _log.error("journal operation refused: %s: %s", type(op).__name__, res)
        mine = results[len(deferred):]
        for res in mine:
            if isinstance(res, Exception) and not raw:
                raise res
        return mine

    def _transact_now(self, ops: Sequence[Op]) -> list[Any] | None:
        """A write on the trio thread for a caller no other task could join, with no
        `_Waiter` and no group: the ops' results if it can start at once, else None
        (nothing done: the caller then `_start`s it in a thread). Called with no write
        in flight; it never awaits, so none can start meanwhile."""
        todo = self.pending
        if len(todo) > INLINE_EVENTS:
            return None
        deferred = self._deferred
        todo_ops = [*deferred, *ops] if deferred else ops
        try:
            results = self.store.commit(None if todo.empty() else todo, todo_ops, wait=False)
        except WouldBlock:
            return None
        except Exception as exc:
            self._begun += 1
            self.pending, self._deferred = Batch(), []
            self._failed(todo, deferred, exc)
            raise
        self._begun += 1
        self._durable = self._begun
        if not todo.empty():
            self.pending = Batch()
        if deferred:
            self._deferred = []
        return self._committed(deferred, results, False)

    async def later(self, op: Op) -> None:
        """Write `op` with the next transaction (at once if the flusher is not running).

        A run's `FinishRun` (its checkpoint completed or failed) while the run has an
        open recorder on this journal is held until that recorder's close is buffered
        (`release`), and goes in the same transaction: the ports the kernel calls in
        between (the budget's commit, a delivery: a webhook may take seconds) must not
        let the checkpoint say "completed" while the run's row is still open. A
        process dying there left a run `kernel recover` never closed (nothing to
        resume) and analysts never saw end; now its checkpoint is still running, and
        it is resumed like any run interrupted before its close.
        """
        if self.running:
            if type(op) is FinishRun and op.run_id in self.recording:
                self._held.setdefault(op.run_id, []).append(op)
                await trio.lowlevel.checkpoint()
                return
            self._deferred.append(op)
            self.poke()
            await trio.lowlevel.checkpoint()
        else:
            await self.transact([op])

    def release(self, run_id: str) -> None:
        """The run's close is being buffered: what `later` held for it rides with it."""
        self.recording.discard(run_id)
        held = self._held.pop(run_id, None)
        if held:
            self._deferred.extend(held)

    async def read(self, fn: Any, *args: Any) -> Any:
        """Run a blocking read of the store (`fn(*args)`) in a worker thread."""
        return await trio.to_thread.run_sync(fn, *args)

    def _failed(self, batch: Batch, deferred: list[Op], exc: Exception) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        # A busy journal or an unreachable server is transient (`transient`): keep the
        # rows. Anything else that fails twice in a row is a batch the store will never
        # take; drop it rather than block every later transaction behind it.
        self._failures = 0 if transient(exc) else self._failures + 1
        if self._failures >= 2:
            self.unwritten += len(batch)
            self.unwritten_ops += len(deferred)
            self._failures = 0
            _log.error("journal batch dropped: %d events and %d operations for %s: %s",
                       len(batch), len(deferred), self.store.path, exc)
            return
        self._keep(batch, deferred)
        _log.warning("journal write failed; will retry: %d events for %s: %s", len(batch),
                     self.store.path, exc)

    def _keep(self, batch: Batch, deferred: list[Op]) -> None:
        """Put rows and operations that were not written back in front of the pending ones."""
        batch.extend(self.pending)
        self.pending = batch
        self._retrying(len(batch))
        self._deferred[:0] = deferred

    def _retrying(self, rows: int) -> None:
        """Note the `rows` kept from a failed write (`retry_len`), and `fast_until` with them."""
        self.retry_len = rows
        self.fast_until = min(self.batch_size - 1, self.max_pending_events - rows)

    async def _flusher(self, scope: trio.CancelScope) -> None:
        # `_dirty`: something is buffered (start the timer). A full batch does not wait
        # for it: `poke(now=True)` and `_done` start those writes.
        with scope:
            while True:
                await self._dirty.wait()
                await trio.sleep(self.flush_interval)
                self._dirty = trio.Event()
                if self.pending.empty() and not self._deferred:
                    continue
                try:
                    await self.transact()
                    self.timed_flushes += 1
                except Exception:
                    self._dirty.set()  # retry the kept rows after the interval

    async def _final_flush(self) -> None:
        # Runs whose recorder never closed (the host gave up on them): their ops go now,
        # as they always did, rather than never.
        for run_id in list(self._held):
            self.release(run_id)
        while self._writing:  # a write no caller waits for (a full batch): let it end
            task = trio.lowlevel.current_task()
            task.custom_sleep_data = self
            self._parked.append(task)
            await trio.lowlevel.wait_task_rescheduled(_abort_parked)
        if self.pending.empty() and not self._deferred:
            return
        # A transient failure (a locked journal, a server restarting) is tried again,
        # with growing pauses, until the store's lock timeout is spent since the exit
        # began: a store whose commit already waited that long (SQLite's busy handler,
        # `PostgresStore.commit`'s own retries) is not waited for twice as long.
        bound = getattr(self.store, "lock_timeout", None)
        deadline = trio.current_time() + (DEFAULT_LOCK_TIMEOUT if bound is None else bound)
        pause = RETRY_FIRST
        while True:
            try:
                await self.transact()
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                left = deadline - trio.current_time()
                if (transient(exc) and left > 0
                        and (not self.pending.empty() or self._deferred)):
                    await trio.sleep(min(pause, left))
                    pause = min(pause * 2, RETRY_MAX)
                    continue
            break
        if not self.pending.empty() or self._deferred:
            await self._spill()

    async def _spill(self) -> None:
        """Keep what the exit flush could not write in a spill file (`store.spill`), which the
        next process that opens the store writes; only if that fails too are the rows lost
        (an error logged, `unwritten` counting them)."""
        pending, deferred = self.pending, self._deferred
        self.pending, self._deferred = Batch(), []
        spill = getattr(self.store, "spill", None)
        why = "the store keeps no spill files"
        if callable(spill):
            try:
                path = await trio.to_thread.run_sync(spill, pending, deferred)
            except Exception as exc:
                why = f"nor can they be kept in a spill file: {type(exc).__name__}: {exc}"
            else:
                self.spilled += len(pending)
                self.spill_path = Path(path)
                _log.warning("journal rows could not be written (%s): %d events and %d "
                             "operations for %s kept in %s; the next process that opens it "
                             "writes them", self.last_error, len(pending), len(deferred),
                             self.store.path, path)
                return
        self.unwritten += len(pending)
        self.unwritten_ops += len(deferred)
        _log.error("journal rows could not be written: %d events and %d operations for %s: "
                   "%s; %s", len(pending), len(deferred), self.store.path, self.last_error,
                   why)
