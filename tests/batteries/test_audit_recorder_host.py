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

    def end_text(self, status: str) -> str | None:
        return None

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


async def test_kernel_made_payloads_are_cached_as_the_long_way_gives_them(
        tmp_path: Path) -> None:
    """`step_text` and `end_text` give exactly what `encode_payload` gives, with the audit's
    current redactor (a new redactor is applied to them at once)."""
    from batteries.audit._encode import encode_payload

    async with JournalAudit.open(tmp_path / "k.duckdb") as audit:
        def long_way(payload: dict[str, Any]) -> str:
            return encode_payload(payload, audit.max_output_bytes, audit.max_payload_bytes,
                                  audit.redactor)

        assert audit.end_text("ok") == long_way(
            {"status": "ok", "reason": None, "error": None})
        assert audit.end_text("ok") == '{"status":"ok","reason":null,"error":null}'
        assert audit.step_text(True, 2) == long_way({"final": True, "tool_calls": 2})
        audit.redactor = Redactor(patterns=["kil+ed"])
        assert audit.end_text("killed") == long_way(
            {"status": "killed", "reason": None, "error": None})
        assert "[REDACTED:pattern]" in (audit.end_text("killed") or "")


async def test_a_run_end_with_a_reason_or_error_is_encoded_whole(tmp_path: Path) -> None:
    """Only a run_end with neither reason nor error comes from the cache; the others keep
    theirs (redacted)."""
    db = tmp_path / "k.duckdb"
    async with JournalAudit.open(db) as audit:
        kernel = Kernel(Ports(audit=audit))
        ok = await kernel.run(ScriptedAgent([Step(final=True)]), RunInfo(name="ok"))
        secret = "token ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
        bad = await kernel.run(ScriptedAgent([Step(error=secret, final=True)]),
                               RunInfo(name="bad"))
    with Store(db).reader() as cur:
        ends = {r["run_id"]: r["payload"] for r in dicts(
            cur, "SELECT run_id, payload FROM events WHERE kind = 'run_end'")}
    assert ends[ok.run_id] == '{"status":"ok","reason":null,"error":null}'
    assert ends[bad.run_id].startswith('{"status":"error","reason":null,"error":"token ')
    assert "[REDACTED:github_token]" in ends[bad.run_id] and "ghp_" not in ends[bad.run_id]
