"""`Journal`: the trio side of a `RunStore`, shared by the audit, budget and checkpointer.

The shape of it::

    trio thread                         Journal                        worker thread
    recorder.on_step / log_event ...    pending Batch (column lists)
      -> append, no I/O                 pending ops (finish, settle)
    budget.check / checkpoint.save      transact(ops): swap pending,   store.commit(batch, ops):
    recorder.close                      -> to_thread -------------->   one transaction
    flusher task (while open)           timed: after flush_interval,
                                        or at once when batch_size events wait

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

A transaction that fails keeps the buffered rows for the next one (a busy
journal is transient). A batch that fails twice for any other reason is
dropped and logged, so it cannot block every later run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from ._protocol import RunStore
from ._sqlite import WouldBlock
from ._types import Batch, Op, StoreBusyError

_log = logging.getLogger("kernel.journal")


#: Seconds after which `transact` yields to trio even when nobody could share its
#: transaction (see `Journal.transact`).
YIELD_EVERY = 0.002

#: Transactions carrying at most this many events may run on the trio thread when the
#: write lock is free at once (see `Journal.transact`).
INLINE_EVENTS = 256


def _abort_parked(raise_cancel: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
    """The abort function of a task parked in `Journal.commit_buffered`: it may go at once.

    Its entry in `Journal._parked` stays until the next release, which skips it
    (trio set the task's `custom_sleep_data` to None when it rescheduled it).
    """
    return trio.lowlevel.Abort.SUCCEEDED


class _Waiter:
    """A caller of `Journal.transact`: its ops, and what their transaction gave back."""

    __slots__ = ("error", "ops", "results", "taken")

    def __init__(self, ops: tuple[Op, ...]) -> None:
        self.ops = ops
        self.taken = False
        self.results: list[Any] = []
        self.error: BaseException | None = None


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
        batch_size: Buffered events that trigger a write without waiting for the timer.
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
        #: Transactions the flush timer started (events buffered past `flush_interval`).
        self.timed_flushes = 0
        #: The last write error, if the last write failed.
        self.last_error: str | None = None
        self.retry_len = 0
        #: Below this many buffered events (and above none) a new event needs none of
        #: the recorder's checks: the buffer is not full, the flush timer is running
        #: and the batch is not yet `batch_size` (see `_retrying`).
        self.fast_until = 0
        self._retrying(0)
        self._deferred: list[Op] = []
        self._failures = 0
        # Group commit: transactions are numbered as they take the pending rows;
        # `_durable` is the number of the last one that committed. Rows buffered
        # before transaction N took its batch are durable once `_durable >= N`.
        self._begun = 0
        self._durable = 0
        self._lock = trio.Lock()
        # The `commit_buffered` callers waiting for the write lock's release, woken
        # together by `_release` (see `commit_buffered`).
        self._parked: list[trio.lowlevel.Task] = []
        self._queue: list[_Waiter] = []
        self._dirty = trio.Event()
        self._wake = trio.Event()
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
        """Something was buffered: start the flush timer (or flush at once with `now`)."""
        self._dirty.set()
        if now:
            self._wake.set()

    async def transact(self, ops: Sequence[Op] = ()) -> list[Any]:
        """Write everything buffered, then `ops`, in one transaction; return the ops' results.

        Callers that are ready at the same moment share one transaction (group
        commit of operations): each queues its ops, yields once, and whoever
        takes the lock first writes every queued caller's ops in order; the
        others find their results waiting. A caller with no other task ready to
        run (nobody to share with) writes at once without yielding. Many runs
        opening at once (a batch) cost a few transactions, not one each. An op
        the store refuses (a save for a run never registered) raises its
        `StoreError` here after the rest of the transaction was committed; it
        never fails another caller's op.
        A caller cancelled after its ops were taken leaves them to commit.

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
            self._lock.acquire_nowait()  # it must wait for the write lock: in a thread
            try:
                return await self._transact(ops)
            finally:
                self._release()
        me = _Waiter(tuple(ops))
        self._queue.append(me)
        try:
            # Taking the lock yields once (trio's Lock checkpoints after acquiring), so
            # callers ready now queue theirs too before this one takes the queue.
            await self._lock.acquire()
            try:
                self._yielded_at = time.perf_counter()
                if not me.taken:
                    await self._transact_queued()
            finally:
                self._release()
        except BaseException:
            if not me.taken:
                self._queue.remove(me)
            raise
        if me.error is not None:
            raise me.error
        for res in me.results:
            if isinstance(res, Exception):
                raise res
        return me.results

    async def _transact_queued(self) -> None:
        # Called holding `_lock`: one transaction for every queued caller's ops.
        group, self._queue = self._queue, []
        for w in group:
            w.taken = True
        try:
            results = await self._transact([op for w in group for op in w.ops], raw=True)
        except BaseException as exc:
            for w in group:
                w.error = exc
            raise
        at = 0
        for w in group:
            w.results = results[at:at + len(w.ops)]
            at += len(w.ops)

    async def commit_buffered(self) -> None:
        """Make everything buffered so far durable, sharing transactions with other callers.

        Callers that arrive while a transaction is being written wait for it to
        end, all woken at once (parked on the journal, not handed the lock from
        each to the next: a task parked on a trio `Lock` keeps the `WouldBlock`
        it caught and its tracebacks alive); those whose rows it carried
        return, and the first of the others writes everything buffered
        meanwhile while the rest wait for that (many runs closing at once cost
        a few transactions, not one each). A caller no other task could join
        writes at once, as in `transact`.

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
        need = self._begun + 1  # the first transaction to take its batch after this call
        while self._lock.locked():
            task = trio.lowlevel.current_task()
            task.custom_sleep_data = self  # trio resets it if the wait is cancelled
            self._parked.append(task)
            await trio.lowlevel.wait_task_rescheduled(_abort_parked)
            if self._durable >= need:
                return
        await self._lock.acquire()
        try:
            self._yielded_at = time.perf_counter()
            if self._durable >= need:
                return
            await self._transact(())
        finally:
            self._release()

    def _release(self) -> None:
        """Release the write lock and wake every `commit_buffered` caller waiting for it."""
        self._lock.release()
        parked = self._parked
        if parked:
            self._parked = []
            for task in parked:
                # A task whose wait was cancelled was rescheduled by trio, which set its
                # `custom_sleep_data` to None: it is not woken twice (nor in a later wait
                # on something else).
                if task.custom_sleep_data is self:
                    trio.lowlevel.reschedule(task)

    def _alone(self) -> bool:
        """True when no other task could join a transaction started now (see `transact`)."""
        return (not self._queue and not self._lock.locked()
                and time.perf_counter() - self._yielded_at < YIELD_EVERY
                and trio.lowlevel.current_statistics().tasks_runnable == 0)

    async def _transact(self, ops: Sequence[Op], *, raw: bool = False) -> list[Any]:
        # Called holding `_lock`. `raw`: return refused ops' errors instead of raising.
        self._begun += 1
        number = self._begun
        # Nothing buffered: the pending batch stays (no new Batch per transaction).
        todo = None if self.pending.empty() else self.pending
        if todo is not None:
            self.pending = Batch()
        deferred = self._deferred
        if deferred:
            self._deferred = []
        todo_ops = [*deferred, *ops] if deferred else ops
        try:
            results = None
            if todo is None or len(todo) <= INLINE_EVENTS:
                # A small transaction that can start at once runs here: its commit
                # (tens of us) is cheaper than two thread switches (~100 us idle,
                # milliseconds on a loaded machine). One that would wait does not.
                try:
                    results = self.store.commit(todo, todo_ops, wait=False)
                except WouldBlock:
                    results = None
            if results is None:
                results = await trio.to_thread.run_sync(self.store.commit, todo, todo_ops)
            # No checkpoint after an inline commit: a cancel there would put rows
            # that are already committed back in the queue (callers checkpoint anyway).
        except BaseException as exc:
            batch = Batch() if todo is None else todo
            if isinstance(exc, Exception):
                self._failed(batch, deferred, exc)
            else:  # cancelled before the write started (e.g. waiting for a thread)
                self._keep(batch, deferred)
            raise
        self._durable = number
        return self._committed(deferred, results, raw)

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
        """`_transact` on the trio thread, for a caller no other task could join: the
        transaction if it can start at once, else None (nothing done: `_transact` then
        runs it in a thread). Called with `_lock` free; it never awaits, so no other
        task can start a transaction meanwhile and the lock is not taken (trio's Lock
        costs a few microseconds of a checkpoint save)."""
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
        """Write `op` with the next transaction (at once if the flusher is not running)."""
        if self.running:
            self._deferred.append(op)
            self.poke()
            await trio.lowlevel.checkpoint()
        else:
            await self.transact([op])

    async def read(self, fn: Any, *args: Any) -> Any:
        """Run a blocking read of the store (`fn(*args)`) in a worker thread."""
        return await trio.to_thread.run_sync(fn, *args)

    def _failed(self, batch: Batch, deferred: list[Op], exc: Exception) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        # A busy journal is transient: keep the rows. Anything else that fails
        # twice in a row is a batch the store will never take; drop it rather
        # than block every later transaction behind it.
        self._failures = 0 if isinstance(exc, StoreBusyError) else self._failures + 1
        if self._failures >= 2:
            self.unwritten += len(batch)
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
        # `_dirty`: something is buffered (start the timer); `_wake`: write now.
        with scope:
            while True:
                await self._dirty.wait()
                with trio.move_on_after(self.flush_interval) as timer:
                    await self._wake.wait()
                self._dirty, self._wake = trio.Event(), trio.Event()
                if self.pending.empty() and not self._deferred:
                    continue
                try:
                    await self.transact()
                    if timer.cancelled_caught:
                        self.timed_flushes += 1
                except Exception:
                    self._dirty.set()  # retry the kept rows after the interval

    async def _final_flush(self) -> None:
        if self.pending.empty() and not self._deferred:
            return
        try:
            await self.transact()
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
        if not self.pending.empty() or self._deferred:
            self.unwritten += len(self.pending)
            _log.error("journal rows could not be written: %d events and %d operations for %s: %s",
                       len(self.pending), len(self._deferred), self.store.path,
                       self.last_error)
            self.pending, self._deferred = Batch(), []
