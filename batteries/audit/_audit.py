"""`DuckDBAudit`: the Audit port on one embedded DuckDB file.

The shape of it::

    trio thread                         flusher task            worker thread
    recorder.on_step / log_event ...    wakes on size, time,    Store.write(batch):
      -> append to column buffers        or a close/flush        lock + attach (bounded wait)
    recorder.close(stats)               swaps the buffers,      one transaction: runs rows,
      -> buffer run_end + roll-up        to_thread(write)        events (Arrow), run updates
      -> await "durable"                 <- wakes the closers    detach (checkpoint, unlock)

A run's rows are durable when its `close` returns: `close` waits for the
flush that carries its roll-up. A flush that fails (the file stayed locked
past the lock timeout, the disk is read-only) keeps its rows for the next
flush and fails the closes waiting on it; the kernel reports that on the
run's result, and the rows still land once the file is free again.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from batteries.redact import Redactor
from kernel import AuditError, AuditWriteError, RunInfo

from ._encode import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_OUTPUT_ENV,
    MAX_PAYLOAD_ENV,
    env_cap,
)
from ._recorder import DuckDBRecorder
from ._store import AuditBusyError, Batch, Store
from .paths import resolve_db_path

_log = logging.getLogger("kernel.audit")


def _import_pyarrow() -> None:
    import pyarrow  # type: ignore[import-untyped, unused-ignore]  # noqa: F401


class _Waiter:
    """A task waiting for the flush that carries its rows."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: BaseException | None = None

    def done(self, error: BaseException | None = None) -> None:
        self.error = error
        self.event.set()


class DuckDBAudit:
    """Records runs into one DuckDB file that several processes and analysts share.

    Use it through `DuckDBAudit.open(path)`, which owns the background
    flusher; `start_run` outside it raises `AuditError`.

    Args:
        path: The database file; None means `$KERNEL_DB`, else the user data dir.
        batch_size: Buffered events that trigger a flush without waiting for the timer.
        flush_interval: Seconds between timed flushes (how stale an in-flight
            run may look to an analyst).
        lock_timeout: Seconds to keep retrying while another process holds the
            file (None: `$KERNEL_AUDIT_LOCK_TIMEOUT`, else 10).
        max_output_bytes: Cap on one stored string value, tail kept (None:
            `$KERNEL_AUDIT_MAX_OUTPUT_BYTES`, else 64 KiB).
        max_payload_bytes: Cap on one whole payload (None:
            `$KERNEL_AUDIT_MAX_PAYLOAD_BYTES`, else 256 KiB).
        max_pending_events: While flushes keep failing, at most this many
            events are buffered; later ones are dropped and reported at close.
        redactor: What replaces secrets before anything is buffered (None:
            `Redactor.from_env()`: the token shapes, the values of secret-named
            environment variables, `$KERNEL_REDACT`). See `batteries.redact`.

    Raises:
        ConfigError: An environment variable holds a bad value.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, batch_size: int = 10_000,
                 flush_interval: float = 1.0, lock_timeout: float | None = None,
                 max_output_bytes: int | None = None, max_payload_bytes: int | None = None,
                 max_pending_events: int = 1_000_000,
                 redactor: Redactor | None = None) -> None:
        self.path: Path = resolve_db_path(path)
        self.redactor = Redactor.from_env() if redactor is None else redactor
        self.batch_size = max(1, batch_size)
        self.flush_interval = flush_interval
        self.max_output_bytes = (max_output_bytes if max_output_bytes is not None
                                 else env_cap(MAX_OUTPUT_ENV, DEFAULT_MAX_OUTPUT_BYTES))
        self.max_payload_bytes = (max_payload_bytes if max_payload_bytes is not None
                                  else env_cap(MAX_PAYLOAD_ENV, DEFAULT_MAX_PAYLOAD_BYTES))
        self.max_pending_events = max_pending_events
        self.host = socket.gethostname()
        self.pid = os.getpid()
        #: Events given up on when the audit closed (the file never became writable).
        self.unwritten = 0
        #: The last flush error, if the last flush failed.
        self.last_error: str | None = None
        self._store = Store(self.path, lock_timeout=lock_timeout)
        self._pending = Batch()
        self._waiters: list[_Waiter] = []
        self._retry: Batch | None = None
        self._retry_len = 0
        self._retry_failures = 0
        self._wake = trio.Event()
        self._dirty = trio.Event()
        self._flush_lock = trio.Lock()
        self._running = False

    def __repr__(self) -> str:
        return f"DuckDBAudit({str(self.path)!r})"

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str | os.PathLike[str] | None = None,
                   **options: Any) -> AsyncIterator[DuckDBAudit]:
        """Open the audit at `path` (created and migrated as needed) for the `async with` body.

        On exit everything still buffered is flushed (shielded from
        cancellation; bounded by the lock timeout).

        Raises:
            AuditError: The file cannot be created, opened or migrated, or it
                stayed locked by another process beyond the lock timeout.
            ConfigError: An environment variable holds a bad value.
        """
        audit = cls(path, **options)
        await trio.to_thread.run_sync(audit._store.ensure_schema)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(audit._flusher, scope)
            # pyarrow is first needed by the first flush; import it while the
            # first run is already going, not on the way to its close.
            nursery.start_soon(trio.to_thread.run_sync, _import_pyarrow)
            audit._running = True
            try:
                yield audit
            finally:
                await audit._shutdown(scope)

    # ------------------------------------------------------------ the port

    async def start_run(self, info: RunInfo) -> DuckDBRecorder:
        """Begin recording `info`'s run; its row and `run_start` go out with the next flush.

        A run_id already in the database is a resumed run: no second row or
        `run_start` is written and its seq continues after its last event.
        """
        if not self._running:
            raise AuditError("DuckDBAudit is not open: use `async with DuckDBAudit.open(path)`")
        await trio.lowlevel.checkpoint()
        rec = DuckDBRecorder(self, info)
        self._pending.new.append(rec)
        self._dirty.set()
        return rec

    async def flush(self) -> None:
        """Make every event buffered so far durable.

        Raises:
            AuditWriteError: The flush failed (the rows stay buffered for a retry).
        """
        waiter = _Waiter()
        self._waiters.append(waiter)
        await self._await(waiter)

    # ----------------------------------------------------------- internals

    async def _close_run(self, rec: DuckDBRecorder, row: tuple[Any, ...]) -> None:
        if not self._running:
            raise AuditError(f"DuckDBAudit was closed before run {rec.run_id} ended")
        self._pending.closes.append((rec, row))
        waiter = _Waiter()
        self._waiters.append(waiter)
        await self._await(waiter)

    async def _await(self, waiter: _Waiter) -> None:
        self._dirty.set()
        self._wake.set()
        await waiter.event.wait()
        error = waiter.error
        if error is not None:
            message = str(error) if isinstance(error, AuditError) else (
                f"audit write failed: {type(error).__name__}: {error}")
            raise AuditWriteError(message) from error

    async def _flusher(self, scope: trio.CancelScope) -> None:
        # Two signals: `_dirty` (something is buffered: start the timer) and
        # `_wake` (flush now: the batch is full, or a close/flush is waiting).
        # An idle audit therefore sleeps without timers.
        with scope:
            while True:
                await self._dirty.wait()
                with trio.move_on_after(self.flush_interval):
                    await self._wake.wait()
                # Reset before the buffers are swapped: anything appended from
                # here on sets the new events.
                self._dirty, self._wake = trio.Event(), trio.Event()
                async with self._flush_lock:
                    if not await self._flush():
                        self._dirty.set()  # retry the kept rows after the interval

    async def _flush(self) -> bool:
        """Write everything buffered (and any earlier failed batch); True on success."""
        batch, self._pending = self._pending, Batch()
        waiters, self._waiters = self._waiters, []
        if self._retry is not None:
            retry, self._retry, self._retry_len = self._retry, None, 0
            retry.extend(batch)
            batch = retry
        if not batch.empty():
            try:
                await trio.to_thread.run_sync(self._store.write, batch)
            except Exception as exc:
                self._failed(batch, exc)
                for w in waiters:
                    w.done(exc)
                return False
        self.last_error = None
        self._retry_failures = 0
        for w in waiters:
            w.done()
        return True

    def _failed(self, batch: Batch, exc: Exception) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        # A locked file is transient: keep the rows. Anything else that fails
        # twice in a row is a batch DuckDB will never take; drop it rather
        # than block every later run behind it.
        self._retry_failures = 0 if isinstance(exc, AuditBusyError) else (
            self._retry_failures + 1)
        if self._retry_failures >= 2:
            self.unwritten += len(batch)
            self._retry_failures = 0
            _log.error("audit batch dropped: %d events for %s: %s", len(batch), self.path, exc)
            return
        self._retry, self._retry_len = batch, len(batch)
        _log.warning("audit flush failed; will retry: %d events for %s: %s", len(batch),
                     self.path, exc)

    async def _shutdown(self, scope: trio.CancelScope) -> None:
        with trio.CancelScope(shield=True):
            scope.cancel()
            async with self._flush_lock:
                await self._flush()
            self._running = False
            if self._retry is not None:
                self.unwritten += len(self._retry)
                _log.error("audit events could not be written: %d events for %s: %s",
                           len(self._retry), self.path, self.last_error)
                self._retry, self._retry_len = None, 0
