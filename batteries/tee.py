"""`TeeAudit`: one run recorded by several audits (DuckDB and OpenTelemetry, say)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kernel import (
    Audit,
    AuditError,
    ConfigError,
    RunInfo,
    RunRecorder,
    RunStats,
    Step,
    ToolResult,
    takes_resumed,
)


class TeeAudit:
    """Record every run in each of `audits`, in order.

    Observer, like each audit it holds: one that raises does not keep the
    others from an event. Every recorder gets each call; afterwards the first
    error is raised again (the kernel reports it once on the result), naming
    the audit. An audit whose `start_run` returns None or raises is left out
    of that run.
    """

    def __init__(self, *audits: Audit) -> None:
        self.audits = list(audits)

    async def start_run(self, info: RunInfo, *,
                        resumed: bool | None = None) -> RunRecorder | None:
        """Start the run in every audit; None when none of them records it.

        `resumed` (`kernel.SupportsResumedStart`) goes to the audits that take
        it; a refusal by one of them (`ConfigError`) refuses the run.
        """
        recorders: list[tuple[str, RunRecorder]] = []
        errors: list[str] = []
        for audit in self.audits:
            try:
                if resumed is not None and takes_resumed(audit):
                    told: Any = audit
                    rec = await told.start_run(info, resumed=resumed)
                else:
                    rec = await audit.start_run(info)
            except ConfigError:
                raise  # the run is refused (its id names another run): not an observer's fault
            except Exception as exc:
                errors.append(f"{type(audit).__name__}: {type(exc).__name__}: {exc}")
                continue
            if rec is not None:
                recorders.append((type(audit).__name__, rec))
        tee = TeeRecorder(recorders) if recorders else None
        if errors:
            if tee is not None:
                tee.pending = errors
            else:
                raise AuditError("; ".join(errors))
        return tee


class TeeRecorder:
    """Hands each call to every recorder; raises the first failure after all were called."""

    def __init__(self, recorders: Sequence[tuple[str, RunRecorder]]) -> None:
        self.recorders = list(recorders)
        self.pending: list[str] = []

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        first: str | None = None
        for name, rec in self.recorders:
            try:
                getattr(rec, method)(*args, **kwargs)
            except Exception as exc:
                first = first or f"{name}: {type(exc).__name__}: {exc}"
        if first is not None:
            raise AuditError(first)

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """Every recorder's `on_step`."""
        self._each("on_step", iteration, step, duration_s)

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """Every recorder's `on_tool`."""
        self._each("on_tool", result, iteration)

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Every recorder's `log_event`."""
        self._each("log_event", kind, name=name, payload=payload, duration_ms=duration_ms,
                   iteration=iteration)

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Every recorder's `log_error`."""
        self._each("log_error", message, payload=payload)

    async def close(self, stats: RunStats) -> None:
        """Close every recorder; then raise one error naming each that failed."""
        errors = list(self.pending)
        for name, rec in self.recorders:
            try:
                await rec.close(stats)
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        if errors:
            raise AuditError("; ".join(errors))
