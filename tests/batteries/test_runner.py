"""batteries.runner: one spec run with the usual ports, on a real journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.checkpoint import JournalCheckpointer
from batteries.runner import RunControl, run_spec
from kernel import Limits, LoopSpec, PortSpec, RunContext, RunInfo, RunSpec, Status, Step


class Stepper:
    """Counts steps; from step `hang_at` on it waits forever (until cancelled)."""

    def __init__(self, hang_at: int | None = None) -> None:
        self.n = 0
        self.hang_at = hang_at
        self.hanging = trio.Event()

    async def step(self, ctx: RunContext) -> Step:
        self.n += 1
        if self.hang_at is not None and self.n >= self.hang_at:
            self.hanging.set()
            await trio.sleep_forever()
        return Step(output=self.n, final=self.n == 3)

    def snapshot(self) -> dict[str, Any]:
        return {"n": self.n}


def _spec(tmp_path: Path, **limits: Any) -> RunSpec:
    return RunSpec(LoopSpec(str(tmp_path / "loop.yaml"), {"k": "v"}), RunInfo(name="stepper"),
                   Limits(timeout=60, **limits),
                   PortSpec(db=str(tmp_path / "k.duckdb"), no_critic=True), cwd=str(tmp_path))


def test_a_run_registers_its_versioned_spec(tmp_path: Path) -> None:
    """The spec is stored (version 2) before the run; it reads back equal; the run ends ok."""
    spec = _spec(tmp_path)
    result = trio.run(run_spec, spec, Stepper())
    assert result.status is Status.OK and result.output == 3 and not result.port_failures
    saved = JournalCheckpointer(tmp_path / "k.duckdb").load(spec.run_id)
    assert saved is not None and saved.status == "completed"
    assert saved.spec["version"] == 2
    assert RunSpec.from_dict(saved.spec) == spec


def test_a_dry_run_is_not_registered(tmp_path: Path) -> None:
    """A dry run executes nothing, so there is nothing to recover: no spec is stored."""
    spec = _spec(tmp_path, dry_run=True)
    trio.run(run_spec, spec, Stepper())
    assert JournalCheckpointer(tmp_path / "k.duckdb").load(spec.run_id) is None


@pytest.mark.parametrize(("final", "left"), [(False, "running"), (True, "failed")],
                         ids=["resumable", "final"])
def test_cancelled_run_hands_back_its_result(tmp_path: Path, final: bool, left: str) -> None:
    """RunControl.cancel gives the host the cancelled Result; only a final cancel closes
    the checkpoint (a resumable one stays `running` for recover)."""
    spec = _spec(tmp_path)
    agent = Stepper(hang_at=2)
    control = RunControl()

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            async def cancel_when_hanging() -> None:
                await agent.hanging.wait()
                control.cancel(final=final, reason="stopped by the test")

            nursery.start_soon(cancel_when_hanging)
            return await run_spec(spec, agent, control=control)

    result = trio.run(main)
    assert result.status is Status.CANCELLED and result.steps == 1
    assert control.cancelled
    saved = JournalCheckpointer(tmp_path / "k.duckdb").load(spec.run_id)
    assert saved is not None and saved.status == left
    assert saved.checkpoint.steps == 1
    if not final:  # kept to resume from; a closed checkpoint drops its state
        assert saved.checkpoint.state == {"n": 1}


def test_cancel_before_the_run_starts(tmp_path: Path) -> None:
    """A control cancelled before the run cancels it as soon as it starts: no step runs."""
    control = RunControl()
    control.cancel()
    result = trio.run(lambda: run_spec(_spec(tmp_path), Stepper(), control=control))
    assert result.status is Status.CANCELLED and result.steps == 0
