"""Taking a dead worker's run back waits, within a bound, for its process to be gone.

Ray reports a node dead before the processes of its workers have exited, so
the first claim of such a run can find its holder still alive. These tests
drive `RayDispatch.take_back` in virtual time over a real journal, with a
dispatcher whose claim stands in for the holder's death (no cluster needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from batteries.ray_dispatch import RayDispatch, RunHeldElsewhereError, WorkerCall
from batteries.store import Journal, Owner, RegisterRun
from kernel import Agent, Checkpoint, RunSpec


def _never_built(spec: RunSpec) -> Agent:
    raise AssertionError("no run is built here")


class _HolderDiesLater(RayDispatch):
    """A dispatcher whose holder is proved gone only after `alive_for` seconds."""

    def __init__(self, journal: Journal, db: Path, *, alive_for: float,
                 holder_grace: float) -> None:
        super().__init__(journal, WorkerCall(str(db), _never_built), holder_grace=holder_grace)
        self.dies_at = trio.current_time() + alive_for
        self.asked = 0

    async def claim(self, run_id: str) -> bool:
        self.asked += 1
        return trio.current_time() >= self.dies_at


async def _running_run(journal: Journal) -> str:
    run_id = "ab" * 16
    await journal.transact([RegisterRun(run_id, {"agent": {}}, Owner("elsewhere", 4242, 1))])
    return run_id


async def test_a_holder_that_dies_after_rays_verdict_is_waited_for(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """Alive for 5 s after the verdict: the run is taken back once it is gone."""
    db = tmp_path / "k.duckdb"
    async with Journal.open(db) as journal:
        run_id = await _running_run(journal)
        dispatch = _HolderDiesLater(journal, db, alive_for=5.0, holder_grace=60.0)
        t0 = trio.current_time()
        back = await dispatch.take_back(run_id)
        assert isinstance(back, Checkpoint)
        assert 5.0 <= trio.current_time() - t0 < 6.0
        assert dispatch.asked > 1


async def test_a_holder_alive_past_the_grace_is_given_up(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """Still alive when `holder_grace` has passed: one error naming the holder."""
    db = tmp_path / "k.duckdb"
    async with Journal.open(db) as journal:
        run_id = await _running_run(journal)
        dispatch = _HolderDiesLater(journal, db, alive_for=1e9, holder_grace=30.0)
        t0 = trio.current_time()
        with pytest.raises(RunHeldElsewhereError, match=r"pid 4242 on elsewhere.*in 30 s"):
            await dispatch.take_back(run_id)
        assert 30.0 <= trio.current_time() - t0 < 31.0


def test_the_grace_must_be_finite(tmp_path: Path) -> None:
    """A negative, infinite or NaN grace is refused when the dispatcher is made."""
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="holder_grace"):
            RayDispatch(None, WorkerCall(str(tmp_path), _never_built),  # type: ignore[arg-type]
                        holder_grace=bad)
