"""The shipped Audit conformance suite (`kernel.testing.check_audit`), run against every audit.

The memory fake, the journal audit (read back through the analysts' DuckDB
file), the OpenTelemetry audit (port checks: it keeps no rows), and a
`TeeAudit` of the memory fake and the OpenTelemetry audit (store checks
read through the memory fake, while the exporter sees every call too).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batteries.audit import JournalAudit, Store
from batteries.audit.queries import dicts
from batteries.otel import OTelAudit, OTLPTraces
from batteries.tee import TeeAudit
from kernel import Audit
from kernel.testing import (
    AUDIT_CHECKS,
    AUDIT_PORT_CHECKS,
    AUDIT_STORE_CHECKS,
    AuditMaker,
    AuditReader,
    Check,
    MemoryAudit,
    MemoryReader,
    StoredEvent,
    StoredRun,
    check_audit,
)


class JournalReader:
    """Reads a `JournalAudit`'s analysts' file the way an analyst would, after a flush."""

    def __init__(self, audit: JournalAudit) -> None:
        self.audit = audit

    async def runs(self) -> dict[str, StoredRun]:
        """Every run, keyed by run_id."""
        await self.audit.flush()
        found = await trio.to_thread.run_sync(self._query, "SELECT * FROM runs", [])
        out = {}
        for r in found:
            out[r["run_id"]] = StoredRun(
                r["run_id"], r["name"], r["subject_id"], r["caller_id"], r["channel_id"],
                r["parent_run_id"], json.loads(r["inputs"]), r["status"], r["output"],
                r["error"], r["reason"], r["steps"], r["tool_calls"], r["runtime_seconds"],
                r["input_tokens"], r["output_tokens"], r["thinking_tokens"], r["cost_usd"],
                r["exit_code"], extra=r)
        return out

    async def events(self, run_id: str) -> list[StoredEvent]:
        """The run's events in seq order."""
        await self.audit.flush()
        found = await trio.to_thread.run_sync(
            self._query, "SELECT * FROM events WHERE run_id = ? ORDER BY seq", [run_id])
        return [StoredEvent(e["seq"], e["kind"], e["name"], e["iteration"], e["duration_ms"],
                            json.loads(e["payload"]), e["ts"].timestamp()) for e in found]

    def _query(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        assert self.audit.path is not None
        with Store(self.audit.path).reader() as cur:
            return dicts(cur, sql, params)


@asynccontextmanager
async def memory_maker() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
    """A fresh `MemoryAudit` and its reader."""
    audit = MemoryAudit()
    yield audit, MemoryReader(audit)


def journal_maker(directory: Path) -> AuditMaker:
    """Fresh journal audits, one new file per check, in `directory`."""
    counter = itertools.count()

    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
        path = directory / f"conformance-{next(counter)}.duckdb"
        async with JournalAudit.open(path) as audit:
            yield audit, JournalReader(audit)

    return maker


def otel_maker(spans: list[Any]) -> AuditMaker:
    """Fresh OpenTelemetry audits exporting into memory; `spans` collects what they sent."""

    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
        exporter = InMemorySpanExporter()
        traces = OTLPTraces(exporter=exporter, batch=False)
        try:
            yield OTelAudit(traces), None
        finally:
            traces.shutdown()
            spans.extend(exporter.get_finished_spans())

    return maker


def tee_maker(spans: list[Any]) -> AuditMaker:
    """A memory audit and an OpenTelemetry audit behind one `TeeAudit`, read via the memory one."""

    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
        memory = MemoryAudit()
        async with otel_maker(spans)() as (otel, _):
            yield TeeAudit(memory, otel), MemoryReader(memory)

    return maker


def _name(check: Check) -> str:
    return check.__name__.removeprefix("check_")


class TestConformance:
    @pytest.mark.parametrize("check", AUDIT_CHECKS, ids=_name)
    async def test_memory_audit(self, check: Check) -> None:
        """The memory fake passes this conformance check."""
        await check(memory_maker)

    @pytest.mark.parametrize("check", AUDIT_CHECKS, ids=_name)
    async def test_journal_audit(self, check: Check, tmp_path: Path) -> None:
        """The journal audit, read through the analysts' file, passes this conformance check."""
        await check(journal_maker(tmp_path))

    @pytest.mark.parametrize("check", AUDIT_PORT_CHECKS, ids=_name)
    async def test_otel_audit(self, check: Check) -> None:
        """The OpenTelemetry audit passes this port check and sends a span for each run."""
        spans: list[Any] = []
        await check(otel_maker(spans))
        assert any(s.name.startswith("invoke_agent") for s in spans), [s.name for s in spans]

    @pytest.mark.parametrize("check", AUDIT_CHECKS, ids=_name)
    async def test_tee_of_memory_and_otel(self, check: Check) -> None:
        """A TeeAudit of the memory fake and the OpenTelemetry audit passes this check."""
        await check(tee_maker([]))


class TestCheckAudit:
    async def test_runs_every_check(self) -> None:
        """check_audit runs the whole suite (every registered check) in one call."""
        ran: list[str] = []

        @asynccontextmanager
        async def counting() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
            async with memory_maker() as pair:
                ran.append("made")
                yield pair

        await check_audit(counting)
        assert len(ran) == len(AUDIT_CHECKS) == len(AUDIT_PORT_CHECKS) + len(AUDIT_STORE_CHECKS)
        assert len(AUDIT_PORT_CHECKS) >= 5 and len(AUDIT_STORE_CHECKS) >= 8

    async def test_port_checks_only_without_a_reader(self) -> None:
        """stored=False runs the port checks only; a store check without a reader says why."""
        spans: list[Any] = []
        await check_audit(otel_maker(spans), stored=False)
        with pytest.raises(TypeError, match="a store check needs a reader"):
            await check_audit(otel_maker(spans))

    async def test_a_broken_audit_fails(self) -> None:
        """An audit that loses events fails the suite (the checks can fail)."""

        class Forgetful(MemoryAudit):
            async def start_run(self, info: Any) -> Any:
                rec = await super().start_run(info)
                rec.log_event = lambda *a, **k: None  # type: ignore[method-assign]
                return rec

        @asynccontextmanager
        async def maker() -> AsyncIterator[tuple[Audit, AuditReader | None]]:
            audit = Forgetful()
            yield audit, MemoryReader(audit)

        with pytest.raises(AssertionError):
            await check_audit(maker)
