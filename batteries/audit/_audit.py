"""`JournalAudit`: the Audit port on the journal, read by analysts through DuckDB.

Recorder calls buffer rows in the shared `Journal` (no I/O); the journal
writes them with the next transaction of the process (a timed flush, a
checkpoint, a budget reservation, or the run's close). A run's rows are
durable when its `close` returns. The analysts' DuckDB file is brought up to
date from the journal by `sync` (every `kernel` analyst command does it
first), so nothing an analyst does with that file can make a run wait.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from batteries.redact import KEY_START, Redactor
from kernel import AuditError, AuditWriteError, RunInfo, RunStats, Step, ToolResult

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

_log = logging.getLogger("kernel.audit")

#: A run id the kernel made (`kernel.new_run_id`): 32 hex digits. Only this process's
#: runs are checked for its reuse (a new one is never in the store).
_KERNEL_ID = re.compile(r"[0-9a-f]{32}")
#: How many run ids a `JournalAudit` remembers starting, to refuse their reuse
#: without I/O (a few MB at most; older ones: a host's own ids are looked up).
_REMEMBER_RUNS = 100_000


def _reuse_message(run_id: str, seen: str) -> str:
    """Why a fresh run under the id of run `seen` (its end status, or `running`) is refused."""
    state = "is still open" if seen == "running" else f"ended {seen}"
    return (f"run_id {run_id!r} already names a run that {state}: a run id names one run "
            "(give the new run its own RunInfo, or resume= to continue an interrupted "
            "one); this run was not recorded")


class UnconfirmedRecorder:
    """The recorder of a run whose id already names a run, until it says it resumes it.

    A resumed run's first event is `resumed` (the kernel logs it before any
    step): then a `DuckDBRecorder` is started for it and every call goes to
    that, the run's seq continuing. Any other first call means a fresh run
    reusing the id: nothing of it is recorded (the earlier run's row and
    events stay as they were) and `close` raises the `ConfigError` saying so.

    Attributes:
        run_id: The run's id.
        recorder: The run's `DuckDBRecorder` once it resumed (None before, or if refused).
        refused: Why it is not recorded, once decided.
    """

    __slots__ = ("audit", "info", "recorder", "refused", "run_id", "seen")

    def __init__(self, audit: JournalAudit, info: RunInfo, seen: str) -> None:
        self.audit, self.info, self.seen = audit, info, seen
        self.run_id = info.run_id
        self.recorder: DuckDBRecorder | None = None
        self.refused: str | None = None

    def _verdict(self, kind: str) -> DuckDBRecorder | None:
        if self.recorder is None and self.refused is None:
            if kind == "resumed":
                self.recorder = self.audit._begin(self.info)
            else:
                self.refused = _reuse_message(self.run_id, self.seen)
                _log.warning("%s", self.refused)
        return self.recorder

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """As `DuckDBRecorder.on_step`, once the run resumed; else nothing."""
        rec = self._verdict("step")
        if rec is not None:
            rec.on_step(iteration, step, duration_s)

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """As `DuckDBRecorder.on_tool`, once the run resumed; else nothing."""
        rec = self._verdict("tool_end")
        if rec is not None:
            rec.on_tool(result, iteration)

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """As `DuckDBRecorder.log_event`; a first `resumed` confirms the resume."""
        rec = self._verdict(kind)
        if rec is not None:
            rec.log_event(kind, name=name, payload=payload, duration_ms=duration_ms,
                          iteration=iteration)

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """As `DuckDBRecorder.log_error`, once the run resumed; else nothing."""
        rec = self._verdict("error")
        if rec is not None:
            rec.log_error(message, payload=payload)

    async def close(self, stats: RunStats) -> None:
        """Close the resumed run's record.

        Raises:
            ConfigError: The run did not resume the run its id names: not recorded.
            AuditWriteError: As `DuckDBRecorder.close`.
        """
        rec = self._verdict("run_end")
        if rec is None:
            from kernel import ConfigError

            raise ConfigError(self.refused or _reuse_message(self.run_id, self.seen))
        await rec.close(stats)


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

    `start_run` takes `resumed=` (`kernel.SupportsResumedStart`): the kernel
    says whether each run it starts is a resume, so a fresh run reusing an
    id is refused before it runs.

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
        # The runs this audit started, newest last: run_id -> its open recorder, or the
        # status it ended with (`start_run` refuses a fresh run under an id in use).
        self._started: dict[str, DuckDBRecorder | str] = {}

    def __repr__(self) -> str:
        return f"JournalAudit({str(self.journal.store.path)!r})"

    @property
    def unwritten(self) -> int:
        """Events given up on (the journal never took them)."""
        return int(self.journal.unwritten)

    @property
    def spilled(self) -> int:
        """Events the journal could not write at exit and kept in a spill file (`spill_path`),
        which the next process that writes to the store commits: safe, not lost."""
        return int(self.journal.spilled)

    @property
    def spill_path(self) -> Path | None:
        """The spill file holding what the journal could not write at exit (None: none)."""
        path = self.journal.spill_path
        return None if path is None else Path(path)

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

    async def start_run(self, info: RunInfo, *,
                        resumed: bool | None = None) -> DuckDBRecorder | UnconfirmedRecorder:
        """Begin recording `info`'s run; its row and `run_start` go out with the next write.

        A run_id already in the journal is a resumed run: no second row or
        `run_start` is written and its seq continues after its last event.
        A run id names one run, though: a *fresh* run under the id of an
        earlier run would append to that run's events and overwrite its
        roll-up, so it is not recorded:

        - `resumed=True`: the caller says it resumes the run; nothing is checked.
        - `resumed=False`: the caller says it is a fresh run; an id in use is
          refused at once (`ConfigError`).
        - `resumed=None` (not said; the kernel does not say yet): for an id in
          use, an `UnconfirmedRecorder` is returned. The kernel logs `resumed`
          before anything else in a resumed run: that confirms the resume;
          any other first call refuses the run (nothing recorded, `close`
          raises `ConfigError`).

        An id is *in use* if this audit started a run under it (remembered
        without I/O: a run's start costs no trip through trio's scheduler),
        or, for an id a host chose (`RunInfo(run_id="job-42")`, not 32 hex
        digits), if the store holds a run under it (looked up in a worker
        thread; the kernel's own ids are new to the store). A run under the
        id that is still open in this audit is refused at once, unless
        `resumed=True`.

        Raises:
            AuditError: The journal is not open.
            ConfigError: The id names a run still open in this audit, or one
                in use with `resumed=False`.
        """
        if not self.journal.running:
            raise AuditError("the audit's journal is not open: use "
                             "`async with JournalAudit.open(path)`")
        rid = info.run_id
        if resumed is not True:
            seen = self._started.get(rid)
            if isinstance(seen, DuckDBRecorder):
                seen = "running"
                resumed = False  # two open recorders of one run: refused whatever is said
            elif seen is None and not _KERNEL_ID.fullmatch(rid):
                seen = await self._look_up(rid)
            if seen is not None:
                if resumed is False:
                    from kernel import ConfigError

                    raise ConfigError(_reuse_message(rid, seen))
                return UnconfirmedRecorder(self, info, seen)
        return self._begin(info)

    def _begin(self, info: RunInfo) -> DuckDBRecorder:
        """The run's recorder, its row and `run_start` (or its resume) queued (no I/O)."""
        rec = DuckDBRecorder(self, info)
        self._remember(info.run_id, rec)
        self.journal.recording.add(info.run_id)
        self.journal.pending.new.append(rec)
        self.journal.poke()
        return rec

    def _remember(self, run_id: str, value: DuckDBRecorder | str) -> None:
        """Keep what this audit knows of `run_id` (its open recorder, or its end status)."""
        started = self._started
        started.pop(run_id, None)
        started[run_id] = value
        if len(started) > _REMEMBER_RUNS:  # the oldest first (insertion order)
            del started[next(iter(started))]

    async def _look_up(self, run_id: str) -> str | None:
        """The status the store's run `run_id` ended with (`running`: none yet); None if
        the store has no such run (a worker thread)."""
        import trio

        store = self.journal.store

        def look() -> str | None:
            if not store.exists() or not store.payloads(run_id, "run_start"):
                return None
            ends = store.payloads(run_id, "run_end")
            if not ends:
                return "running"
            try:
                doc = json.loads(ends[-1])
            except ValueError:
                return "ended"
            status = doc.get("status") if isinstance(doc, dict) else None
            return str(status) if status else "ended"

        try:
            return await trio.to_thread.run_sync(look)
        except Exception as exc:  # the store's own failure: the write will say it again
            _log.debug("run id %s not looked up: %s", run_id, exc)
            return None

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
        if self._started.get(rec.run_id) is rec:
            self._started[rec.run_id] = str(row[2])  # its status: what a reuse is judged by
        if not self.journal.running:
            raise AuditError(f"the audit's journal was closed before run {rec.run_id} ended")
        # Its checkpoint's end (held by the journal) goes in the same transaction.
        self.journal.release(rec.run_id)
        self.journal.pending.closes.append((rec, row))
        try:  # `_write`, inline: one coroutine less per closing run
            await self.journal.commit_buffered()
        except AuditError as exc:
            raise AuditWriteError(str(exc)) from exc
        except Exception as exc:
            raise AuditWriteError(f"audit write failed: {type(exc).__name__}: {exc}") from exc


#: The audit's former name (it wrote the DuckDB file directly); kept for hosts.
DuckDBAudit = JournalAudit
