"""The Audit conformance suite, run against the memory fake and the DuckDB audit."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from audit_conformance import (
    CHECKS,
    AuditMaker,
    AuditReader,
    Check,
    EventView,
    MemoryReader,
    RunView,
    check_audit,
)

from batteries.audit import DuckDBAudit, Store
from batteries.audit.queries import dicts
from kernel import Audit
from kernel.testing import MemoryAudit


class DuckDBReader:
    """Reads a `DuckDBAudit`'s file the way an analyst would, after a flush."""

    def __init__(self, audit: DuckDBAudit) -> None:
        self.audit = audit

    async def runs(self) -> dict[str, RunView]:
        """Every run, keyed by run_id."""
        await self.audit.flush()
        found = await trio.to_thread.run_sync(self._query, "SELECT * FROM runs", [])
        out = {}
        for r in found:
            out[r["run_id"]] = RunView(
                r["run_id"], r["name"], r["subject_id"], r["caller_id"], r["channel_id"],
                r["parent_run_id"], json.loads(r["inputs"]), r["status"], r["output"],
                r["error"], r["reason"], r["steps"], r["tool_calls"], r["runtime_seconds"],
                r["input_tokens"], r["output_tokens"], r["thinking_tokens"], r["cost_usd"],
                r["exit_code"], extra=r)
        return out

    async def events(self, run_id: str) -> list[EventView]:
        """The run's events in seq order."""
        await self.audit.flush()
        found = await trio.to_thread.run_sync(
            self._query, "SELECT * FROM events WHERE run_id = ? ORDER BY seq", [run_id])
        return [EventView(e["seq"], e["kind"], e["name"], e["iteration"], e["duration_ms"],
                          json.loads(e["payload"]), e["ts"].timestamp()) for e in found]

    def _query(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        with Store(self.audit.path).reader() as cur:
            return dicts(cur, sql, params)


@asynccontextmanager
async def memory_maker() -> AsyncIterator[tuple[Audit, AuditReader]]:
    """A fresh `MemoryAudit` and its reader."""
    audit = MemoryAudit()
    yield audit, MemoryReader(audit)


def duckdb_maker(directory: Path) -> AuditMaker:
    """Fresh DuckDB audits, one new file per check, in `directory`."""
    counter = itertools.count()

    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Audit, AuditReader]]:
        path = directory / f"conformance-{next(counter)}.duckdb"
        async with DuckDBAudit.open(path) as audit:
            yield audit, DuckDBReader(audit)

    return maker


def _name(check: Check) -> str:
    return check.__name__.removeprefix("check_")


class TestConformance:
    @pytest.mark.parametrize("check", CHECKS, ids=_name)
    async def test_memory_audit(self, check: Check) -> None:
        """The memory fake passes this conformance check."""
        await check(memory_maker)

    @pytest.mark.parametrize("check", CHECKS, ids=_name)
    async def test_duckdb_audit(self, check: Check, tmp_path: Path) -> None:
        """The DuckDB audit passes this conformance check."""
        await check(duckdb_maker(tmp_path))

    async def test_check_audit_runs_every_check(self) -> None:
        """check_audit runs the whole suite (every registered check) in one call."""
        ran: list[str] = []

        @asynccontextmanager
        async def counting() -> AsyncIterator[tuple[Audit, AuditReader]]:
            async with memory_maker() as pair:
                ran.append("made")
                yield pair

        await check_audit(counting)
        assert len(ran) == len(CHECKS) >= 9
