"""The journal audit's recorder uses its audit only through `RecorderHost`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batteries.audit import DuckDBRecorder, JournalAudit, RecorderHost, Store
from batteries.audit.queries import dicts
from batteries.redact import Redactor
from batteries.store import Journal
from kernel import Kernel, Ports, RunInfo, Status, Step
from kernel.testing import ScriptedAgent


class Host:
    """A `RecorderHost` with nothing else: any other attribute the recorder used would fail."""

    __slots__ = ("audit", "closed")

    def __init__(self, audit: JournalAudit) -> None:
        self.audit = audit
        self.closed: list[str] = []

    @property
    def journal(self) -> Journal:
        return self.audit.journal

    @property
    def host(self) -> str:
        return "host-under-test"

    @property
    def pid(self) -> int:
        return 4242

    @property
    def redactor(self) -> Redactor:
        return self.audit.redactor

    @property
    def max_output_bytes(self) -> int:
        return 16

    @property
    def max_payload_bytes(self) -> int:
        return 1 << 16

    def step_text(self, final: bool, tool_calls: int) -> str | None:
        return None  # always encode the long way

    async def close_run(self, rec: DuckDBRecorder, row: tuple[Any, ...]) -> None:
        self.closed.append(rec.run_id)
        await self.audit.close_run(rec, row)


class HostedAudit:
    """An Audit that makes journal recorders for `Host`, as `JournalAudit.start_run` does."""

    def __init__(self, host: RecorderHost) -> None:
        self.host = host

    async def start_run(self, info: RunInfo) -> DuckDBRecorder:
        rec = DuckDBRecorder(self.host, info)
        self.host.journal.pending.new.append(rec)
        return rec


async def test_the_recorder_needs_only_the_recorder_host(tmp_path: Path) -> None:
    """A run recorded for a hand-written host is stored with the host's values and caps."""
    db = tmp_path / "k.duckdb"
    async with JournalAudit.open(db) as audit:
        host = Host(audit)
        checked: RecorderHost = host  # the type checker holds Host to the protocol
        result = await Kernel(Ports(audit=HostedAudit(checked))).run(
            ScriptedAgent([Step(output="x" * 100, final=True)]), RunInfo(name="hosted"))
        await audit.flush()
    assert result.status is Status.OK and result.port_failures == []
    assert host.closed == [result.run_id]
    with Store(db).reader() as cur:
        [row] = dicts(cur, "SELECT host, pid, output, status FROM runs WHERE run_id = ?",
                      [result.run_id])
    assert (row["host"], row["pid"], row["status"]) == ("host-under-test", 4242, "ok")
    assert len(row["output"].encode()) <= 16 + 64  # the host's cap, plus the marker
