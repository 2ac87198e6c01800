"""Checkpoints in a real DuckDB file: save, complete, fail, find interrupted runs."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from batteries.checkpoint import DuckDBCheckpointer
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import Hang, ScriptedAgent

SPEC = {"agent": {"kind": "test"}, "info": {}, "limits": {}}


class TestDuckDBCheckpointer:
    async def test_saves_and_completes(self, tmp_path: Path) -> None:
        """Saves are durable as they happen; an ok run ends completed with its state dropped."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo(name="c")
        await cp.register(info.run_id, SPEC)
        seen: list[int] = []

        async def look(ctx: RunContext) -> Step:
            saved = await trio.to_thread.run_sync(cp.load, info.run_id)
            assert saved is not None
            seen.append(saved.checkpoint.steps)
            return Step(final=ctx.iteration == 3)

        agent = ScriptedAgent(then=look)
        result = await Kernel(Ports(checkpointer=cp)).run(agent, info, Limits())
        assert result.status is Status.OK
        assert seen == [0, 1, 2, 3]  # each step sees the previous step's save
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "completed"
        assert saved.checkpoint.state is None

    async def test_failed_run_is_not_interrupted(self, tmp_path: Path) -> None:
        """A run that failed is marked failed and never offered for recovery."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo()
        await cp.register(info.run_id, SPEC)
        await Kernel(Ports(checkpointer=cp)).run(ScriptedAgent([Step(), ValueError("v")]), info)
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "failed"
        assert cp.interrupted() == []

    async def test_cancelled_run_keeps_its_checkpoint(self, tmp_path: Path) -> None:
        """A run cancelled by shutdown stays `running` with its last state, for recovery."""
        cp = DuckDBCheckpointer(tmp_path / "k.duckdb")
        info = RunInfo()
        await cp.register(info.run_id, SPEC)
        with trio.move_on_after(1):
            await Kernel(Ports(checkpointer=cp)).run(
                ScriptedAgent([Step(), Step(), Hang()]), info, Limits())
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "running"
        assert saved.checkpoint.steps == 2 and saved.checkpoint.state == {"calls": 2}
        # This process is alive, so it is not interrupted yet.
        assert cp.interrupted() == []

    async def test_dead_process_is_interrupted(self, tmp_path: Path) -> None:
        """A running row whose pid is gone is offered for recovery; find() takes a prefix."""
        import subprocess
        import sys

        db = tmp_path / "k.duckdb"
        code = ("import trio, sys\nfrom batteries.checkpoint import DuckDBCheckpointer\n"
                "trio.run(DuckDBCheckpointer(sys.argv[1]).register, 'deadbeef' * 4, "
                "{'agent': {'kind': 'loop'}})")
        subprocess.run([sys.executable, "-c", code, str(db)], check=True)
        cp = DuckDBCheckpointer(db)
        [saved] = cp.interrupted()
        assert saved.run_id == "deadbeef" * 4 and saved.pid != os.getpid()
        assert [r.run_id for r in cp.find("deadbe")] == [saved.run_id]
        cp.mark_failed(saved.run_id, "given up")
        assert cp.interrupted() == []


def test_export_includes_the_batteries_tables(tmp_path: Path) -> None:
    """`kernel export` writes the checkpoint and budget tables too, not only runs/events."""
    import subprocess
    import sys

    from batteries.budget import DuckDBBudget

    db = tmp_path / "k.duckdb"
    DuckDBBudget(db).set("x", max_runs=1)
    trio.run(DuckDBCheckpointer(db).register, "ab" * 16, SPEC)
    exe = str(Path(sys.executable).parent / "kernel")
    out = subprocess.run([exe, "export", str(tmp_path / "out"), "--db", str(db)],
                         check=True, capture_output=True, text=True).stdout
    names = {Path(p).name for p in out.split()}
    assert {"runs.parquet", "events.parquet", "budgets.parquet", "checkpoints.parquet"} <= names
