"""DuckDBAudit beyond the port's conformance: schema, migrations, views, batching, caps."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import batteries.audit._schema as schema
from batteries.audit import SCHEMA_VERSION, DuckDBAudit, Store, sync
from batteries.audit._encode import encode_payload, tail
from batteries.audit.queries import dicts
from kernel import (
    AuditError,
    AuditWriteError,
    Checkpoint,
    ConfigError,
    Kernel,
    Limits,
    Ports,
    RunInfo,
    RunStats,
    Status,
    Step,
    ToolCall,
    ToolResult,
)
from kernel.testing import ScriptedAgent

# The analysts' schema as DESIGN.md lists it (contract): these columns must exist.
RUN_CONTRACT = (
    "run_id", "parent_run_id", "subject_id", "name", "caller_id", "channel_id", "inputs",
    "started_at", "ended_at", "status", "output", "error", "steps", "tool_calls",
    "runtime_seconds", "input_tokens", "output_tokens", "thinking_tokens", "cost_usd", "host",
    "pid",
)
EVENT_CONTRACT = ("run_id", "seq", "ts", "kind", "iteration", "name", "duration_ms", "payload")


def query(path: Path, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
    """Read the file the way an analyst's tool would, in a short session."""
    with Store(path).reader() as cur:
        return dicts(cur, sql, params)


def columns(path: Path, table: str) -> dict[str, str]:
    rows = query(path, "SELECT column_name, data_type FROM information_schema.columns "
                       "WHERE table_name = ? AND table_catalog = current_database()", [table])
    return {r["column_name"]: r["data_type"] for r in rows}


def p95(values: list[float]) -> float:
    """quantile_cont(x, 0.95): linear interpolation between closest ranks."""
    xs = sorted(values)
    pos = 0.95 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class TestSchema:
    async def test_new_file_has_the_contract_schema(self, tmp_path: Path) -> None:
        """A new file has every contract column, typed durations and JSON payloads."""
        db = tmp_path / "new" / "audit.duckdb"  # the parent directory is created too
        async with DuckDBAudit.open(db) as audit:
            await audit.flush()  # the journal now exists; the analysts' file is made from it
        runs, events = columns(db, "runs"), columns(db, "events")
        assert set(RUN_CONTRACT) <= set(runs)
        assert set(EVENT_CONTRACT) <= set(events)
        assert events["duration_ms"] == "DOUBLE"
        assert events["seq"] == "INTEGER"
        assert events["payload"] == "JSON"
        assert runs["inputs"] == "JSON"
        assert runs["runtime_seconds"] == "DOUBLE"
        assert runs["started_at"] == "TIMESTAMP WITH TIME ZONE"
        versions = query(db, "SELECT version FROM schema_version ORDER BY version")
        assert versions == [{"version": v} for v in range(1, SCHEMA_VERSION + 1)]
        views = {r["view_name"] for r in query(
            db, "SELECT view_name FROM duckdb_views() WHERE NOT internal")}
        assert {"run_stats", "tool_stats", "critic_decisions", "attempts"} <= views

    async def test_reopening_applies_no_migration_twice(self, tmp_path: Path) -> None:
        """Opening an up-to-date file again leaves schema_version with one row per version."""
        db = tmp_path / "a.duckdb"
        for _ in range(3):
            Store(db).ensure_schema()
        assert len(query(db, "SELECT * FROM schema_version")) == SCHEMA_VERSION

    async def test_an_older_file_is_migrated_forward(self, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        """A file at an older version gets the newer migrations and keeps its rows."""
        db = tmp_path / "old.duckdb"
        async with DuckDBAudit.open(db) as audit:
            rec = await audit.start_run(RunInfo(name="before"))
            await rec.close(RunStats(Status.OK))
        sync(db)
        v2 = schema.Migration(SCHEMA_VERSION + 1, "test: add runs.region",
                              ("ALTER TABLE runs ADD COLUMN region VARCHAR",))
        monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, v2))
        assert Store(db).ensure_schema() == SCHEMA_VERSION
        assert "region" in columns(db, "runs")
        assert [r["version"] for r in query(db, "SELECT version FROM schema_version "
                                                "ORDER BY version")] == list(
            range(1, SCHEMA_VERSION + 2))
        assert [r["name"] for r in query(db, "SELECT name FROM runs")] == ["before"]
        # And this code keeps writing to the newer file (inserts name their columns).
        async with DuckDBAudit.open(db) as audit:
            rec = await audit.start_run(RunInfo(name="after"))
            await rec.close(RunStats(Status.OK))
        assert len(query(db, "SELECT * FROM runs")) == 2

    async def test_a_failing_migration_leaves_the_previous_version(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A migration that fails is rolled back whole: version and tables stay as they were."""
        db = tmp_path / "bad.duckdb"
        Store(db).ensure_schema()
        bad = schema.Migration(SCHEMA_VERSION + 1, "test: broken",
                               ("ALTER TABLE runs ADD COLUMN half_done VARCHAR",
                                "THIS IS NOT SQL"))
        monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, bad))
        with pytest.raises(AuditError, match="cannot set up audit database"):
            Store(db).ensure_schema()
        monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:-1])
        assert "half_done" not in columns(db, "runs")
        assert [r["version"] for r in query(
            db, "SELECT version FROM schema_version ORDER BY version")] == list(
            range(1, SCHEMA_VERSION + 1))

    def test_arrow_schemas_match_the_insert_columns(self) -> None:
        """The writer's Arrow schemas list exactly the columns it inserts, in order."""
        arrow = schema.arrow_schemas()
        assert tuple(arrow["runs"].names) == schema.RUN_COLUMNS
        assert tuple(arrow["events"].names) == schema.EVENT_COLUMNS


class TestViews:
    async def test_views_answer_the_usual_questions(self, tmp_path: Path) -> None:
        """run_stats, tool_stats and critic_decisions agree with the same numbers computed here."""
        db = tmp_path / "views.duckdb"
        runtimes = {"ok": [1.0, 2.0, 3.0, 10.0], "error": [5.0]}
        tool_ms = {"grep": [10.0, 20.0, 30.0, 40.0, 500.0], "ls": [1.0, 2.0]}
        async with DuckDBAudit.open(db) as audit:
            for status, values in runtimes.items():
                for runtime in values:
                    rec = await audit.start_run(RunInfo(name="r", subject_id="lint"))
                    await rec.close(RunStats(Status(status), runtime_seconds=runtime, steps=2))
            rec = await audit.start_run(RunInfo(name="tools", subject_id="search"))
            for tool, durations in tool_ms.items():
                for ms in durations:
                    rec.on_tool(ToolResult(ToolCall(tool), output="x", duration_s=ms / 1000), 0)
            rec.log_event("critic", name="steer", payload={"message": "try another tool"})
            rec.log_event("critic", name="kill", payload={"reason": "looping",
                                                          "evidence": {"repeats": 5}})
            await rec.close(RunStats(Status.KILLED, runtime_seconds=4.0))

        stats = {(r["subject_id"], r["status"]): r for r in query(db, "SELECT * FROM run_stats")}
        ok = stats[("lint", "ok")]
        assert ok["runs"] == 4
        assert math.isclose(ok["mean_runtime_s"], 4.0)
        assert math.isclose(ok["p95_runtime_s"], p95(runtimes["ok"]))
        assert ok["steps"] == 8
        assert stats[("lint", "error")]["runs"] == 1
        assert stats[("search", "killed")]["runs"] == 1

        tools = {r["tool"]: r for r in query(db, "SELECT * FROM tool_stats")}
        assert tools["grep"]["calls"] == 5
        assert math.isclose(tools["grep"]["p95_ms"], p95(tool_ms["grep"]))
        assert math.isclose(tools["ls"]["mean_ms"], 1.5)

        decisions = query(db, "SELECT decision, reason, evidence, run_status "
                              "FROM critic_decisions ORDER BY seq")
        assert [(d["decision"], d["reason"], d["run_status"]) for d in decisions] == [
            ("steer", "try another tool", "killed"), ("kill", "looping", "killed")]
        assert json.loads(decisions[1]["evidence"]) == {"repeats": 5}


async def _wait_for(path: Path, sql: str, want: int, timeout: float = 10.0) -> int:
    """Poll the file (from a worker thread) until `sql` counts at least `want`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            n = await trio.to_thread.run_sync(lambda: next(iter(query(path, sql)[0].values())))
        except AuditError:  # nothing written yet: no journal, no analysts' file
            n = 0
        if n >= want or time.monotonic() > deadline:
            return int(n)
        await trio.sleep(0.05)


class TestBuffering:
    async def test_recorder_calls_write_nothing_until_a_flush(self, tmp_path: Path) -> None:
        """Events stay in memory until a flush: the file does not see them before."""
        db = tmp_path / "buf.duckdb"
        async with DuckDBAudit.open(db, flush_interval=3600) as audit:
            await audit.flush()  # the journal exists, and nothing is in it
            rec = await audit.start_run(RunInfo(name="buffered"))
            for i in range(1000):
                rec.log_event("tick", payload={"i": i})
            assert query(db, "SELECT count(*) AS n FROM events") == [{"n": 0}]
            assert query(db, "SELECT count(*) AS n FROM runs") == [{"n": 0}]
            await audit.flush()
            assert query(db, "SELECT count(*) AS n FROM events") == [{"n": 1001}]
            open_run = query(db, "SELECT status FROM runs")
            assert open_run == [{"status": None}]  # in flight: no status until close
            await rec.close(RunStats(Status.OK))

    async def test_a_full_batch_is_flushed_without_waiting_for_the_timer(
            self, tmp_path: Path) -> None:
        """Reaching batch_size triggers a flush even with an hour-long flush interval."""
        db = tmp_path / "size.duckdb"
        async with DuckDBAudit.open(db, batch_size=100, flush_interval=3600) as audit:
            rec = await audit.start_run(RunInfo(name="size"))
            for i in range(250):
                rec.log_event("tick", payload={"i": i})
            n = await _wait_for(db, "SELECT count(*) FROM events", 200)
            assert n >= 200
            await rec.close(RunStats(Status.OK))

    async def test_plain_steps_fill_a_batch_and_start_the_timer(self, tmp_path: Path) -> None:
        """Plain steps (the recorder's fast path) flush when a batch fills, and the
        first one buffered starts the flush timer."""
        db = tmp_path / "size.duckdb"
        async with DuckDBAudit.open(db, batch_size=100, flush_interval=3600) as audit:
            rec = await audit.start_run(RunInfo(name="size"))
            for i in range(250):
                rec.on_step(i, Step(), 0.001)
            n = await _wait_for(db, "SELECT count(*) FROM events WHERE kind = 'step'", 200)
            assert n >= 200
            await rec.close(RunStats(Status.OK))
        db = tmp_path / "timer.duckdb"
        async with DuckDBAudit.open(db, flush_interval=0.05) as audit:
            rec = await audit.start_run(RunInfo(name="live"))
            await audit.flush()  # the run's start written: the buffer is empty again
            with trio.fail_after(10):  # and the timer its poke started has run out
                # (polled: the flusher clears the flag by replacing its event, which no
                # one is told of)
                while audit.journal._dirty.is_set():  # noqa: ASYNC110
                    await trio.sleep(0.01)
            rec.on_step(0, Step(), 0.001)
            n = await _wait_for(db, "SELECT count(*) FROM events WHERE kind = 'step'", 1)
            assert n == 1
            await rec.close(RunStats(Status.OK))

    async def test_events_past_a_full_buffer_are_dropped_and_reported(
            self, tmp_path: Path) -> None:
        """With `max_pending_events` buffered, more steps and events are refused and
        counted, and the run's close says so; what was buffered is written."""
        db = tmp_path / "full.duckdb"
        async with DuckDBAudit.open(db, batch_size=10**6, flush_interval=3600,
                                    max_pending_events=50) as audit:
            rec = await audit.start_run(RunInfo(name="full"))
            for i in range(60):
                rec.on_step(i, Step(), 0.001)
            rec.log_event("tick")
            assert (len(audit.journal.pending), rec.dropped) == (50, 11)
            with pytest.raises(AuditWriteError, match=r"11 events of run \w+ were dropped"):
                await rec.close(RunStats(Status.OK))
        assert query(db, "SELECT kind, count(*) AS n FROM events GROUP BY kind ORDER BY kind") == [
            {"kind": "run_end", "n": 1}, {"kind": "run_start", "n": 1}, {"kind": "step", "n": 50}]

    async def test_the_timer_flushes_an_in_flight_run(self, tmp_path: Path) -> None:
        """With a short flush interval an analyst sees a run's events before it ends."""
        db = tmp_path / "timer.duckdb"
        async with DuckDBAudit.open(db, flush_interval=0.05) as audit:
            rec = await audit.start_run(RunInfo(name="live"))
            rec.log_event("tick")
            n = await _wait_for(db, "SELECT count(*) FROM events", 2)
            assert n == 2  # run_start + tick
            await rec.close(RunStats(Status.OK))

    async def test_exit_flushes_what_is_still_buffered(self, tmp_path: Path) -> None:
        """Leaving `async with` writes events of runs that never closed."""
        db = tmp_path / "exit.duckdb"
        async with DuckDBAudit.open(db, flush_interval=3600) as audit:
            rec = await audit.start_run(RunInfo(name="unclosed"))
            rec.log_event("tick")
        assert query(db, "SELECT kind FROM events ORDER BY seq") == [
            {"kind": "run_start"}, {"kind": "tick"}]

    async def test_start_run_outside_open_is_refused(self, tmp_path: Path) -> None:
        """A DuckDBAudit not entered through open() refuses to start runs."""
        audit = DuckDBAudit(tmp_path / "x.duckdb")
        with pytest.raises(AuditError, match=r"async with JournalAudit\.open"):
            await audit.start_run(RunInfo())

    async def test_a_run_resumed_from_a_checkpoint_continues_its_seq(
            self, tmp_path: Path) -> None:
        """Kernel.run(resume=...) with the same run_id appends `resumed` after the old events."""
        db = tmp_path / "resume.duckdb"
        info = RunInfo(name="long job")
        async with DuckDBAudit.open(db) as audit:
            kernel = Kernel(Ports(audit=audit))
            first = await kernel.run(ScriptedAgent([Step(), Step()]), info, Limits(max_steps=2))
            assert first.status is Status.MAX_STEPS
            again = await kernel.run(ScriptedAgent([Step(output="done", final=True)]), info,
                                     resume=Checkpoint(info.run_id, 2, {"calls": 2}))
            assert again.status is Status.OK
        events = query(db, "SELECT seq, kind FROM events ORDER BY seq")
        assert [e["kind"] for e in events] == ["run_start", "step", "step", "run_end",
                                               "resumed", "step", "run_end"]
        assert [e["seq"] for e in events] == list(range(7))
        assert query(db, "SELECT status, steps FROM runs") == [{"status": "ok", "steps": 3}]


class TestCaps:
    def test_small_payloads_are_stored_as_is(self) -> None:
        """A payload under the caps is plain compact JSON."""
        assert encode_payload({"a": 1, "b": "x"}, 1024, 4096) == '{"a":1,"b":"x"}'
        assert encode_payload(None, 1024, 4096) == "{}"

    def test_a_long_value_keeps_its_tail(self) -> None:
        """A string over the value cap keeps its last bytes and marks the payload truncated."""
        text = "HEAD" + "x" * 5000 + "TAIL"
        stored = json.loads(encode_payload({"output": text, "exit": 1}, 1024, 1 << 20))
        assert stored["truncated"] is True
        assert stored["exit"] == 1
        assert stored["output"].endswith("TAIL") and "HEAD" not in stored["output"]
        assert len(stored["output"].encode()) <= 1024

    def test_a_huge_payload_is_replaced_by_its_tail(self) -> None:
        """A payload still over the total cap becomes {truncated, bytes, tail}."""
        payload = {f"k{i}": "v" * 100 for i in range(200)}
        stored = json.loads(encode_payload(payload, 1024, 2048))
        assert stored["truncated"] is True
        assert stored["bytes"] > 2048
        assert len(json.dumps(stored).encode()) <= 2048 + 200

    def test_the_tail_never_splits_a_character(self) -> None:
        """Cutting multi-byte text keeps whole characters."""
        kept, cut = tail("é" * 1000, 101)
        assert cut and set(kept) == {"é"} and len(kept.encode()) <= 101

    async def test_caps_apply_to_stored_outputs(self, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        """KERNEL_AUDIT_MAX_OUTPUT_BYTES caps step outputs and runs.output, tail kept."""
        monkeypatch.setenv("KERNEL_AUDIT_MAX_OUTPUT_BYTES", "2048")
        db = tmp_path / "caps.duckdb"
        big = "first line\n" + "y" * 100_000 + "\nlast line"
        async with DuckDBAudit.open(db) as audit:
            result = await Kernel(Ports(audit=audit)).run(
                ScriptedAgent([Step(output=big, final=True)]), RunInfo(name="big"))
        step = query(db, "SELECT payload FROM events WHERE kind = 'step'")[0]
        payload = json.loads(step["payload"])
        assert payload["truncated"] is True
        assert payload["output"].endswith("last line")
        assert len(payload["output"].encode()) <= 2048
        run = query(db, "SELECT output, output_truncated FROM runs")[0]
        assert run["output_truncated"] is True
        assert run["output"].endswith("last line") and len(run["output"]) <= 2048
        assert result.output == big  # the caller's result is never capped

    @pytest.mark.parametrize("value", ["lots", "12"])
    def test_a_bad_cap_setting_is_a_config_error(self, value: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
        """A cap that is not a whole number >= 64 is refused, naming the variable."""
        monkeypatch.setenv("KERNEL_AUDIT_MAX_PAYLOAD_BYTES", value)
        with pytest.raises(ConfigError, match="KERNEL_AUDIT_MAX_PAYLOAD_BYTES"):
            DuckDBAudit(tmp_path / "x.duckdb")


class TestAwkwardValues:
    async def test_text_that_is_not_unicode_does_not_poison_the_batch(
            self, tmp_path: Path) -> None:
        """Lone surrogates are replaced, NaN and odd keys are stored, and nothing is lost."""
        db = tmp_path / "odd.duckdb"
        async with DuckDBAudit.open(db) as audit:
            rec = await audit.start_run(RunInfo(name="odd\udcff"))
            rec.log_event("output", name="std\udcffout", payload={"line": "bad \udcff byte"})
            rec.log_event("log", payload={"nan": float("nan"), (1, 2): "tuple key"})
            rec.log_event("log", payload={"fine": True})
            await rec.close(RunStats(Status.OK, output="out \udcff"))
        events = query(db, "SELECT kind, name, payload FROM events ORDER BY seq")
        assert [e["kind"] for e in events] == ["run_start", "output", "log", "log", "run_end"]
        assert events[1]["name"] == "std?out"
        assert json.loads(events[1]["payload"]) == {"line": "bad ? byte"}
        odd = json.loads(events[2]["payload"])
        assert odd["(1, 2)"] == "tuple key"
        assert json.loads(events[3]["payload"]) == {"fine": True}
        assert query(db, "SELECT name, output FROM runs") == [{"name": "odd?",
                                                              "output": "out ?"}]
