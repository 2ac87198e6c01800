"""`BatchDelivery`: a batch's results delivered as its runs end, off their slots, bounded.

Kernel-free logic runs under trio's virtual clock with hand-written `Delivery` fakes;
the runner test uses a real journal and real `DirectoryDelivery` folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.batch import BatchDelivery, BatchRunner, KernelDispatch, TaskOutcome
from batteries.checkpoint import JournalCheckpointer
from batteries.delivery import DirectoryDelivery, FanOutDelivery, check_delivery_options
from batteries.store import Journal
from kernel import ConfigError, DeliveryError, Ports, Result, Status
from tests.batteries.test_batch import build, tasks


def outcome(i: int, *, result: bool = True) -> TaskOutcome:
    run_id = f"r{i}"
    return TaskOutcome(i, f"t{i}", run_id, "ok",
                       Result(status=Status.OK, run_id=run_id) if result else None)


class Slow:
    """A delivery that takes `seconds` (virtual) and counts how many run at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.now = 0
        self.peak = 0
        self.delivered: list[str] = []

    async def deliver(self, result: Result) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await trio.sleep(self.seconds)
        finally:
            self.now -= 1
        self.delivered.append(result.run_id)


class Gate:
    """A delivery that waits until `open` is set; `failing` ones raise after it."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.open = trio.Event()
        self.waiting = 0
        self.failing = failing
        self.delivered: list[str] = []

    async def deliver(self, result: Result) -> None:
        self.waiting += 1
        await self.open.wait()
        if result.run_id in self.failing:
            raise DeliveryError(f"refused {result.run_id}")
        self.delivered.append(result.run_id)


async def test_at_most_limit_deliveries_at_once_and_all_of_them(autojump_clock: object
                                                                ) -> None:
    """100 results, 8 at once: all delivered, each reported once, in 13 rounds of 1 s."""
    slow = Slow(1.0)
    seen: list[TaskOutcome] = []
    d = BatchDelivery(slow, limit=8, on_delivered=seen.append)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.serve)
        for i in range(100):
            d.submit(outcome(i))
        assert d.pending == 100
        d.close()
    assert slow.peak == 8 and sorted(slow.delivered) == sorted(f"r{i}" for i in range(100))
    assert len(seen) == 100 and len({o.run_id for o in seen}) == 100
    assert d.pending == 0 and d.failed == 0 and d.served.is_set()
    assert trio.current_time() - start == pytest.approx(13.0)


async def test_an_outcome_without_a_result_is_passed_on_at_once(autojump_clock: object
                                                                ) -> None:
    """Skipped, lost or unfinished tasks have nothing to deliver: reported straight away."""
    seen: list[str] = []
    d = BatchDelivery(Gate(), on_delivered=lambda o: seen.append(o.run_id))
    d.submit(outcome(1, result=False))  # before `serve` even runs
    assert seen == ["r1"] and d.pending == 0


async def test_a_failure_is_on_the_result_and_the_status_stays(autojump_clock: object
                                                               ) -> None:
    """As the kernel reports a port: `delivery.deliver: DeliveryError: ...`; the others
    are delivered; a result's status is never changed."""
    gate = Gate(failing=frozenset({"r1"}))
    seen: list[TaskOutcome] = []
    d = BatchDelivery(FanOutDelivery([gate]), on_delivered=seen.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.serve)
        for i in range(3):
            d.submit(outcome(i))
        d.close()
        await trio.sleep(1)
        gate.open.set()
    by_id = {o.run_id: o for o in seen}
    assert by_id["r0"].result is not None and by_id["r0"].result.port_failures == []
    result = by_id["r1"].result
    assert result is not None and result.status is Status.OK and by_id["r1"].status == "ok"
    assert [str(f) for f in result.port_failures] == [
        "delivery.deliver: DeliveryError: Gate: refused r1"]
    assert d.failed == 1 and sorted(gate.delivered) == ["r0", "r2"]


async def test_a_hanging_delivery_delays_only_the_ones_behind_it(autojump_clock: object
                                                                 ) -> None:
    """One delivery that never ends holds one of the `limit` places, nothing else."""

    class OneHangs:
        def __init__(self) -> None:
            self.delivered: list[str] = []

        async def deliver(self, result: Result) -> None:
            if result.run_id == "r0":
                await trio.sleep_forever()
            await trio.sleep(1)
            self.delivered.append(result.run_id)

    hangs = OneHangs()
    d = BatchDelivery(hangs, limit=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.serve)
        for i in range(5):
            d.submit(outcome(i))
        await trio.sleep(4.5)
        assert sorted(hangs.delivered) == ["r1", "r2", "r3", "r4"] and d.pending == 1
        d.scope.cancel()


async def test_stopping_reports_what_was_not_delivered(autojump_clock: object) -> None:
    """Cancelling the scope ends the deliveries in flight and the queued ones: each is
    reported once, with a failure saying it was not delivered; one that comes later
    too."""
    gate = Gate()
    seen: list[TaskOutcome] = []
    d = BatchDelivery(FanOutDelivery([gate]), limit=2, on_delivered=seen.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.serve)
        for i in range(5):
            d.submit(outcome(i))
        await trio.sleep(1)
        assert gate.waiting == 2
        d.scope.cancel()
    d.submit(outcome(5))
    assert sorted(o.run_id for o in seen) == [f"r{i}" for i in range(6)]
    for o in seen:
        assert o.result is not None
        [failure] = o.result.port_failures
        assert str(failure) == ("delivery.deliver: DeliveryError: not delivered: the batch "
                                "was stopped before its delivery ended")
    assert d.failed == 6 and d.pending == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit must be >= 1"):
        BatchDelivery(Gate(), limit=0)


async def test_a_runner_s_runs_end_while_their_deliveries_wait(tmp_path: Path) -> None:
    """With the runner: every run ends and the batch is finished while no delivery has
    ended; released, each run's folder is written (a real `DirectoryDelivery`)."""
    gate = Gate()
    out = tmp_path / "out"
    both = FanOutDelivery([gate, DirectoryDelivery(out, limiter=trio.CapacityLimiter(2))])
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        runner = BatchRunner(journal, KernelDispatch(ports, build), concurrency=1)
        ts = tasks(4)
        bid = await runner.create(ts)
        seen: list[TaskOutcome] = []
        d = BatchDelivery(both, on_delivered=seen.append)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d.serve)
            outs = await runner.run(bid, on_outcome=d.submit)
            assert runner.finished and {o.status for o in outs} == {Status.OK}
            assert seen == [] and d.pending == 4  # every run ended, none delivered yet
            gate.open.set()
            d.close()
        assert sorted(o.run_id for o in seen) == sorted(t.run_id for t in ts)
        for t in ts:
            doc = json.loads((out / t.run_id / "result.json").read_text())
            assert doc["status"] == "ok" and doc["output"] == f"done {t.spec['n']}"


def test_check_delivery_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags' check: the directory made absolute, URLs refused in one line naming the
    flag and without a password."""
    monkeypatch.chdir(tmp_path)
    assert check_delivery_options("out", ["http://127.0.0.1:1/x"]) == (
        str(tmp_path / "out"), ("http://127.0.0.1:1/x",))
    assert check_delivery_options(None) == (None, ())
    with pytest.raises(ConfigError, match=r"^--deliver-dir expects a directory, got ''$"):
        check_delivery_options(" ")
    with pytest.raises(ConfigError, match=r"^--webhook: webhook URL must be http") as bad:
        check_delivery_options(None, ["ftp://u:pw1234@host/x"])
    assert "pw1234" not in str(bad.value)


async def test_the_progress_line_counts_the_results_being_delivered(
        autojump_clock: object) -> None:
    """`kernel batch`'s live line says how many results are still being delivered (the
    runs may all have ended)."""
    from kernel_cli.batch_progress import BatchProgress

    class Runner:
        outcomes: list[TaskOutcome] = [outcome(0), outcome(1)]
        running: dict[str, object] = {}

    d = BatchDelivery(Gate())
    progress = BatchProgress(Runner(), 2, d)
    assert "delivering" not in progress.render()
    d.submit(outcome(0))
    d.submit(outcome(1))
    assert progress.render().startswith("2/2 done | 2 ok | 0 running | 2 delivering")
    assert "delivering" not in BatchProgress(Runner(), 2).render()
