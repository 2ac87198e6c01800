"""`DuckDBRecorder`: the hot-path half of the audit.

Every recorder call appends one row to the journal's column buffers and
returns: no I/O, no locks, no awaiting. Payloads are encoded to capped JSON
here, secrets redacted (the payload may be mutated by its owner after the
call returns, so it cannot be kept by reference), which is the only per-event
cost beyond a few list appends. This is the one funnel every audit row passes
through, whatever store sits under it: the run's RunInfo is redacted once
when its recorder is made, each payload as it is encoded, the roll-up at close.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from batteries.redact import KEY_START, Redactor
from kernel import AuditWriteError, RunInfo, RunStats, Step, ToolResult

from ._encode import EMPTY, encode_payload, tail, to_text

_time_ns = time.time_ns

#: After a private key's BEGIN line without its END, the body's lines are looked
#: for (`Redactor.key_body`) in at most this many events, or up to the END line
#: (a 4096-bit RSA key is ~50 lines); the rest of those events is kept.
_KEY_LINES = 200

if TYPE_CHECKING:
    from batteries.store import Journal


#: The range of a store's integer column (SQLite's and PostgreSQL's BIGINT).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int64(value: Any) -> int | None:
    """`value` as an integer a store can keep; None (NULL) for anything else."""
    if type(value) is not int:
        if isinstance(value, (bool, float)):
            return None
        try:
            value = operator.index(value)
        except TypeError:
            return None
    return value if _INT64_MIN <= value <= _INT64_MAX else None


def _real(value: Any) -> float | None:
    """`value` as a finite float; None (NULL) for NaN, an infinity or a non-number."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            return None
    return value if math.isfinite(value) else None


#: Event kinds written at once rather than at the next timed flush: what recovery
#: needs if this process dies in the next second (`Journal.soon`): a process group
#: that started, which `kernel recover` stops before resuming, so a state never runs
#: beside its own orphan. (A tool call's start is not: a transaction per call for a
#: record the checkpoint saved before the tools already covers, the call answered
#: "interrupted" on resume.)
_SOON = frozenset({"process_start"})


class RecorderHost(Protocol):
    """What a `DuckDBRecorder` uses of the audit that made it (`JournalAudit` is one).

    **Protocol:** the recorder only reads these attributes and calls these
    methods; it writes nothing of the audit's. Events go to `journal`'s
    pending batch (its documented column buffers), so nothing here is called
    per event except `step_text`, which must not block.
    """

    @property
    def journal(self) -> Journal:
        """The journal whose pending batch the recorder appends its events to."""

    @property
    def host(self) -> str:
        """The host name recorded on each run row."""

    @property
    def pid(self) -> int:
        """The process id recorded on each run row."""

    @property
    def redactor(self) -> Redactor:
        """What replaces secrets before anything is buffered."""

    @property
    def max_output_bytes(self) -> int:
        """Cap on one stored string value (its tail is kept)."""

    @property
    def max_payload_bytes(self) -> int:
        """Cap on one whole encoded payload."""

    def step_text(self, final: bool, tool_calls: int) -> str | None:
        """The stored payload of a step carrying only `final` and a tool-call count, if cached."""

    def end_text(self, status: str) -> str | None:
        """The stored payload of a `run_end` with only its status (no reason or error)."""

    async def close_run(self, rec: DuckDBRecorder, row: tuple[Any, ...]) -> None:
        """Queue the run's roll-up `row` and return once the run's rows are durable."""


class DuckDBRecorder:
    """Records one run for a `RecorderHost` (see `kernel.RunRecorder` for the contract).

    Attributes:
        run_id: The run being recorded.
        count: Events buffered so far by this recorder (its next relative seq).
        dropped: Events refused because the audit's buffer was full.
    """

    __slots__ = ("audit", "base", "closed", "count", "dropped", "host", "info", "journal",
                 "key_lines", "pid", "run_id", "started_us")

    def __init__(self, audit: RecorderHost, info: RunInfo) -> None:
        self.audit = audit
        self.journal = audit.journal
        self.host = audit.host
        self.pid = audit.pid
        # What the store writes (runs row, run_start) comes from this copy:
        # secrets are replaced before anything leaves the recorder.
        self.info = audit.redactor.run_info(info)
        self.run_id = info.run_id
        self.started_us = time.time_ns() // 1000
        # Set by the writer (in a worker thread) once the run's rows are
        # committed: the absolute seq of this recorder's relative seq 0.
        self.base: int | None = None
        self.count = 0
        self.dropped = 0
        self.closed = False
        # Events left to blank after a private key's BEGIN line was seen without
        # its END (a key printed one line per output event).
        self.key_lines = 0

    def _add(self, kind: str, name: str | None, payload: str, duration_ms: float | None,
             iteration: int | None, *, force: bool = False) -> None:
        journal = self.journal
        buf = journal.pending
        recs = buf.recs
        n = len(recs)
        if n + journal.retry_len >= journal.max_pending_events and not force:
            self.dropped += 1
            return
        recs.append(self)
        buf.seqs.append(self.count)
        self.count += 1
        buf.ts.append(_time_ns() // 1000)
        buf.kinds.append(kind)
        buf.iters.append(iteration)
        buf.names.append(name)
        buf.durs.append(duration_ms)
        buf.payloads.append(payload)
        if n == 0:
            journal.poke()  # start the flush timer
        if n + 1 == journal.batch_size:
            # Once, as the batch fills: the flusher remembers it (it swaps its events
            # before it writes), so the events that keep coming while a write is in
            # flight do not set it again, each of them.
            journal.poke(now=True)

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """Buffer a `step` event (payload: final, tool_calls, output, and the step's payload)."""
        if step.output is None and not step.payload and not self.key_lines:
            # Only values the kernel made (a bool, a count): the encoded, redacted text
            # depends on nothing else, so the audit keeps it (see `JournalAudit.step_text`).
            text = self.audit.step_text(step.final, len(step.tool_calls))
            if text is not None:
                journal = self.journal
                buf = journal.pending
                recs = buf.recs
                # `_add`, written out for the per-step hot path, with its three checks
                # (buffer full, first event, batch full) as one: in between, none applies.
                if 0 < len(recs) < journal.fast_until:
                    recs.append(self)
                    buf.seqs.append(self.count)
                    self.count += 1
                    buf.ts.append(_time_ns() // 1000)
                    buf.kinds.append("step")
                    buf.iters.append(iteration)
                    buf.names.append(step.name)
                    buf.durs.append(duration_s * 1000)
                    buf.payloads.append(text)
                    return
                self._add("step", step.name, text, duration_s * 1000, iteration)
                return
        payload: dict[str, Any] = {"final": step.final, "tool_calls": len(step.tool_calls)}
        if step.output is not None:
            payload["output"] = step.output
        if step.payload:
            payload.update(step.payload)
        self._add("step", step.name, self._encode(payload), duration_s * 1000, iteration)

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """Buffer a `tool_end` event named for the tool, with its typed duration."""
        self._add("tool_end", result.call.name,
                  self._encode({"output": result.output, "error": result.error}),
                  result.duration_s * 1000, iteration)

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Buffer any event (tool_start, steer, critic, checkpoint, adapter kinds, ...)."""
        if iteration is not None and (type(iteration) is not int
                                      or not _INT64_MIN <= iteration <= _INT64_MAX):
            iteration = _int64(iteration)  # (from a host: one a store cannot keep is NULL)
        if duration_ms is not None and type(duration_ms) is not float:
            duration_ms = _real(duration_ms)
        self._add(kind, name, self._encode(payload) if payload else EMPTY, duration_ms,
                  iteration)
        if kind in _SOON:
            self.journal.soon()

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Buffer an `error` event."""
        self._add("error", None, self._encode({"message": message, **(payload or {})}),
                  None, None)

    def _encode(self, payload: Mapping[str, Any]) -> str:
        audit = self.audit
        text = encode_payload(payload, audit.max_output_bytes, audit.max_payload_bytes,
                              audit.redactor)
        if self.key_lines:  # inside a private key: its body's lines go, up to its END line
            text, ended = audit.redactor.key_body(text)
            if not ended:
                self.key_lines -= 1
                return text
            self.key_lines = 0
        if KEY_START in text:
            self.key_lines = _KEY_LINES
        return text

    def _end(self, stats: RunStats) -> tuple[Any, ...]:
        """Buffer `run_end`; the run's roll-up row (`RecorderHost.close_run`)."""
        status = str(stats.status)
        text = None
        if stats.reason is None and stats.error is None and not self.key_lines:
            text = self.audit.end_text(status)
        if text is None:
            text = self._encode({"status": status, "reason": stats.reason,
                                 "error": stats.error})
        runtime = _real(stats.runtime_seconds)
        self._add("run_end", status, text, None if runtime is None else _real(runtime * 1000),
                  None, force=True)
        cap = self.audit.max_output_bytes
        redactor = self.audit.redactor
        inside = self.key_lines > 0  # the run ended inside a private key: its lines may be here

        def redact(text: str) -> str:
            text = redactor.text(text)
            return redactor.key_body(text)[0] if inside else text

        output, truncated = (None, False) if stats.output is None else tail(
            redact(to_text(stats.output)), cap)
        error = None if stats.error is None else tail(redact(stats.error), cap)[0]
        reason = None if stats.reason is None else redact(stats.reason)
        usage = stats.usage
        # Every number as a store can keep it (an integer in int64, a finite float),
        # else NULL: one run's impossible count must not fail the transaction that
        # carries other runs' rows (the kernel refuses such usage from agents; a
        # recorder is also driven by hosts directly).
        return (self.run_id, time.time_ns() // 1000, status, output, error,
                _int64(stats.steps), _int64(stats.tool_calls), runtime,
                _int64(usage.input_tokens), _int64(usage.output_tokens),
                _int64(usage.thinking_tokens), _real(usage.cost_usd), reason,
                _int64(stats.exit_code), truncated)

    async def close(self, stats: RunStats) -> None:
        """Buffer `run_end` and the run's roll-up, then wait until the run's rows are durable.

        Raises:
            AuditWriteError: The rows could not be written (they stay buffered
                and are retried by later flushes), or events were dropped
                because the buffer was full.
            AuditError: The audit was already closed.
        """
        if self.closed:
            return
        self.closed = True
        # Built in a plain call: nothing it makes stays referenced by this coroutine
        # while it waits (at 10,000 runs closing at once, every object a waiting
        # close keeps is work for the collector); nor does `stats`.
        row = self._end(stats)
        del stats
        await self.audit.close_run(self, row)
        if self.dropped:
            raise AuditWriteError(
                f"{self.dropped} events of run {self.run_id} were dropped: the audit buffer "
                f"was full (max_pending_events={self.journal.max_pending_events})")
