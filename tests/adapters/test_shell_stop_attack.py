"""A stop once the command exited, while a daemon it started (`setsid`) holds its pipes.

`ShellAgent._settle` hurries what follows a command's exit when the run is stopped
then (Ctrl-C, a host cancel): SIGTERM at once, SIGKILL within the grace. Before,
that held only for the command's own process group: a daemon in a session of its
own, out of reach of the group's signals, kept the pipes while the hurried settle
waited the whole grace for them to drain, and only then did the sweep SIGTERM it
(and SIGKILL it a second grace later): a stop took up to twice the grace, and a
daemon that dies on SIGTERM at once still held the run for a whole grace. Now the
sweep runs alongside the hurried settle, within the same bound.

Real processes; every wait on another process polls a condition (a file, a pid),
with a generous bound; the window the stop must land in is held open by the daemon
itself (it waits until the command is reaped), never by a sleep.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from adapters.shell import ShellAgent
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, RecordingDelivery

pytestmark = pytest.mark.realtime

#: How long a test waits for another process to get somewhere (never a measure of speed).
BOUND = 120.0
#: The agent's grace: the stop must not wait it out for a daemon that dies on SIGTERM.
GRACE = 100.0


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = trio.current_time() + BOUND
    while not cond():
        if trio.current_time() > deadline:
            pytest.fail(f"{what}: not within {BOUND:.0f}s")
        await trio.sleep(0.01)


def alive(pid: int) -> bool:
    """Whether `pid` is alive (a zombie, dead but not reaped by its new parent, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize(("code", "status"), [(0, Status.OK), (5, Status.ERROR)])
async def test_a_stop_sigterms_a_setsid_daemon_at_once(tmp_path: Path, code: int,
                                                      status: Status) -> None:
    """`sh -c 'setsid sh -c DAEMON & exit N'`: sh is reaped, its daemon (a session of its
    own, SIGTERM ends it) holds the pipes, the host cancels. The daemon gets SIGTERM at
    once and the run ends with the command's own status, well within the grace (before:
    only after the whole grace of 100 s had been waited out)."""
    ready, pidfile = tmp_path / "ready", tmp_path / "daemon.pid"
    # The daemon: waits until sh is gone (reaped: the settle is under way), says so,
    # then holds the pipes until it is signalled.
    daemon = (f'echo $$ > {shlex.quote(str(pidfile))}; '
              f'while kill -0 "$1" 2>/dev/null; do sleep 0.01; done; '
              f'touch {shlex.quote(str(ready))}; '
              f'while :; do sleep 0.05; done')
    command = f"setsid sh -c {shlex.quote(daemon)} daemon $$ & echo hi; exit {code}"
    agent = ShellAgent(["sh", "-c", command], grace=GRACE)
    audit, delivery, info = MemoryAudit(), RecordingDelivery(), RunInfo(name="daemon")
    stopped_at: list[float] = []
    try:
        with trio.fail_after(BOUND + GRACE), trio.CancelScope() as host:
            async with trio.open_nursery() as nursery:
                async def stop() -> None:
                    await until(ready.exists, "the daemon's readiness")
                    stopped_at.append(trio.current_time())
                    host.cancel()

                nursery.start_soon(stop)
                await Kernel(Ports(audit=audit, delivery=delivery)).run(
                    agent, info, Limits(timeout=BOUND + 2 * GRACE))
                nursery.cancel_scope.cancel()
        assert stopped_at, "the run ended before the stop"
        took = trio.current_time() - stopped_at[0]
        [result] = delivery.delivered
        assert (result.status, result.exit_code) == (status, code), result
        kinds = [e.kind for e in audit.events(info.run_id)]
        assert "stop_after_exit" in kinds, kinds
        # SIGTERM at once: the run is not held for the grace (100 s) by a daemon that
        # dies on it (it ends in milliseconds; the bound is for a loaded machine).
        assert took < GRACE / 2, f"the stop took {took:.1f}s (grace {GRACE:g}s)"
        pid = int(pidfile.read_text())
        assert not alive(pid), "the daemon outlived the run"
    finally:
        if pidfile.exists() and pidfile.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), 9)
