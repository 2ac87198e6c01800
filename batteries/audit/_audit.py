"""`JournalAudit`: the Audit port on the journal, read by analysts through DuckDB.

Recorder calls buffer rows in the shared `Journal` (no I/O); the journal
writes them with the next transaction of the process (a timed flush, a
checkpoint, a budget reservation, or the run's close). A run's rows are
durable when its `close` returns. The analysts' DuckDB file is brought up to
date from the journal by `sync` (every `kernel` analyst command does it
first), so nothing an analyst does with that file can make a run wait.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from batteries.redact import KEY_START, Redactor
from kernel import AuditError, AuditWriteError, RunInfo

from ._encode import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_OUTPUT_ENV,
    MAX_PAYLOAD_ENV,
    encode_payload,
    env_cap,
)
from ._recorder import DuckDBRecorder

_JOURNAL_OPTIONS = ("batch_size", "flush_interval", "lock_timeout", "max_pending_events")


class JournalAudit:
    """Records runs into the journal that feeds the analysts' DuckDB file.

    Use `JournalAudit.open(path)` for a standalone audit (it owns a
    `Journal` and its flusher), or `JournalAudit(journal)` to share a
    journal that is already open with the budget and checkpoint batteries.

    Args:
        journal: An open `batteries.store.Journal` (a path makes an audit
            that refuses runs until opened with `open`).
        max_output_bytes: Cap on one stored string value, tail kept (None:
            `$KERNEL_AUDIT_MAX_OUTPUT_BYTES`, else 64 KiB).
        max_payload_bytes: Cap on one whole payload (None:
            `$KERNEL_AUDIT_MAX_PAYLOAD_BYTES`, else 256 KiB).
        redactor: What replaces secrets before anything is buffered (None:
            `Redactor.from_env()`: the token shapes, the values of secret-named
            environment variables, `$KERNEL_REDACT`). See `batteries.redact`.

    Raises:
        ConfigError: An environment variable holds a bad value.
    """

    def __init__(self, journal: Any, *, max_output_bytes: int | None = None,
                 max_payload_bytes: int | None = None,
                 redactor: Redactor | None = None) -> None:
        from batteries.store import Journal

        # A path builds a journal that is not open: start_run refuses until open() is used.
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        self.path: Path | None = self.journal.db
        self.redactor = Redactor.from_env() if redactor is None else redactor
        self.max_output_bytes = (max_output_bytes if max_output_bytes is not None
                                 else env_cap(MAX_OUTPUT_ENV, DEFAULT_MAX_OUTPUT_BYTES))
        self.max_payload_bytes = (max_payload_bytes if max_payload_bytes is not None
                                  else env_cap(MAX_PAYLOAD_ENV, DEFAULT_MAX_PAYLOAD_BYTES))
        self.host = socket.gethostname()
        self.pid = os.getpid()
        # Payloads made of kernel values only, encoded and redacted once: a step's by
        # tool_calls * 2 + final, a run_end's (no reason, no error) by its status.
        self._kernel_texts: dict[int | str, str] = {}
        self._texts_redactor = self.redactor

    def __repr__(self) -> str:
        return f"JournalAudit({str(self.journal.store.path)!r})"

    @property
    def unwritten(self) -> int:
        """Events given up on (the journal never took them)."""
        return int(self.journal.unwritten)

    @property
    def last_error(self) -> str | None:
        """The last write error, if the last write failed."""
        return self.journal.last_error

    def step_text(self, final: bool, tool_calls: int) -> str | None:
        """The stored payload of a `step` event carrying nothing but `final` and a tool-call count.

        Encoded and redacted once per (final, count) with the audit's current
        redactor, exactly as `encode_payload` would each time, then reused:
        most steps' payloads are one of a handful of texts. None (encode it
        the long way) for an unusual count, or if redaction left a private
        key's first line in it.
        """
        if self._texts_redactor is not self.redactor:  # `_fresh_texts`, written out: per step
            self._kernel_texts, self._texts_redactor = {}, self.redactor
        key = tool_calls * 2 + bool(final)  # an int: no tuple made per step
        text = self._kernel_texts.get(key)
        if text is None:
            if tool_calls > 64:
                return None
            return self._kernel_text(key, {"final": final, "tool_calls": tool_calls})
        return text

    def end_text(self, status: str) -> str | None:
        """The stored payload of a `run_end` event with no reason and no error, once per
        status (as `step_text`: a run's close costs no encoding or redaction of it)."""
        text = self._fresh_texts().get(status)
        if text is None:
            return self._kernel_text(status, {"status": status, "reason": None, "error": None})
        return text

    def _fresh_texts(self) -> dict[int | str, str]:
        """The kept kernel-made texts, emptied if the redactor was replaced since."""
        if self._texts_redactor is not self.redactor:
            self._kernel_texts, self._texts_redactor = {}, self.redactor
        return self._kernel_texts

    def _kernel_text(self, key: int | str, payload: dict[str, Any]) -> str | None:
        """`payload` encoded and redacted as `encode_payload` would, kept under `key`."""
        text = encode_payload(payload, self.max_output_bytes, self.max_payload_bytes,
                              self.redactor)
        if KEY_START in text:
            return None
        self._kernel_texts[key] = text
        return text

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str | os.PathLike[str] | None = None,
                   **options: Any) -> AsyncIterator[JournalAudit]:
        """Open an audit writing the journal beside the analysts' file `path`.

        `path` None means `$KERNEL_DB`, else the user data dir. Journal
        options (`batch_size`, `flush_interval`, `lock_timeout`,
        `max_pending_events`) go to the `Journal`; the rest to the audit.
        Nothing is written until the first transaction; on exit everything
        still buffered is written (shielded; bounded by the lock timeout).

        Raises:
            ConfigError: An environment variable holds a bad value, or `path`
                cannot be the analysts' file (`resolve_db_path`: a directory, a
                path ending in a slash, a file that is not a DuckDB database
                with no journal beside it), checked before anything is recorded.
        """
        from batteries.store import Journal

        jopts = {k: options.pop(k) for k in _JOURNAL_OPTIONS if k in options}
        async with Journal.open(path, **jopts) as journal:
            yield cls(journal, **options)

    # ------------------------------------------------------------ the port

    async def start_run(self, info: RunInfo) -> DuckDBRecorder:
        """Begin recording `info`'s run; its row and `run_start` go out with the next write.

        A run_id already in the journal is a resumed run: no second row or
        `run_start` is written and its seq continues after its last event.
        """
        if not self.journal.running:
            raise AuditError("the audit's journal is not open: use "
                             "`async with JournalAudit.open(path)`")
        # No I/O and no checkpoint: a run's start costs no trip through trio's scheduler.
        rec = DuckDBRecorder(self, info)
        self.journal.pending.new.append(rec)
        self.journal.poke()
        return rec

    async def flush(self) -> None:
        """Make every event buffered so far durable.

        Raises:
            AuditWriteError: The write failed (the rows stay buffered for a retry).
        """
        await self._write()

    async def _write(self) -> None:
        try:
            await self.journal.commit_buffered()
        except AuditError as exc:
            raise AuditWriteError(str(exc)) from exc
        except Exception as exc:
            raise AuditWriteError(f"audit write failed: {type(exc).__name__}: {exc}") from exc

    async def close_run(self, rec: DuckDBRecorder, row: tuple[Any, ...]) -> None:
        """For its recorders (`RecorderHost`): write the run's roll-up `row`, return when durable.

        Raises:
            AuditError: The journal was closed before the run ended.
            AuditWriteError: The write failed (the rows stay buffered for a retry).
        """
        if not self.journal.running:
            raise AuditError(f"the audit's journal was closed before run {rec.run_id} ended")
        self.journal.pending.closes.append((rec, row))
        try:  # `_write`, inline: one coroutine less per closing run
            await self.journal.commit_buffered()
        except AuditError as exc:
            raise AuditWriteError(str(exc)) from exc
        except Exception as exc:
            raise AuditWriteError(f"audit write failed: {type(exc).__name__}: {exc}") from exc


#: The audit's former name (it wrote the DuckDB file directly); kept for hosts.
DuckDBAudit = JournalAudit
