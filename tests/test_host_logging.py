"""The library prints nothing in a host's process unless the host configures logging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A host whose delivery and audit both fail. The run still ends ok; the failures
# are on the result and logged under `kernel.*`, which prints only when the host
# has configured logging (argv[1] == "configure").
HOST = textwrap.dedent('''
    import logging
    import sys

    import trio

    from batteries.audit import DuckDBAudit
    from batteries.delivery import WebhookDelivery
    from batteries.store import journal_path
    from kernel import Kernel, Limits, Ports, RunInfo, Status, Step


    class Done:
        async def step(self, ctx):
            return Step(output="done", final=True)


    async def main(db, port):
        delivery = WebhookDelivery(f"http://127.0.0.1:{port}/hook", attempts=2,
                                   wait_initial=0.01, wait_max=0.01, timeout=10)
        async with DuckDBAudit.open(db) as audit:
            # Every write of the audit fails: its journal becomes a directory (made
            # before the open, it is refused there, as a path that cannot be one).
            journal_path(db).mkdir()
            result = await Kernel(Ports(audit=audit, delivery=delivery)).run(
                Done(), RunInfo(name="host"), Limits(max_steps=3, timeout=30))
        return result


    if __name__ == "__main__":
        if sys.argv[1] == "configure":
            logging.basicConfig(level=logging.WARNING)
        from pathlib import Path

        result = trio.run(main, Path(sys.argv[2]), int(sys.argv[3]))
        assert result.status is Status.OK, result
        failed = sorted({f"{f.port}.{f.method}" for f in result.port_failures})
        assert failed == ["audit.close", "delivery.deliver"], result.port_failures
''')


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_host(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    host = tmp_path / "host.py"
    host.write_text(HOST)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "KERNEL_LOG_LEVEL")}
    return subprocess.run([sys.executable, str(host), mode, str(tmp_path / "k.duckdb"),
                           str(_dead_port())], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.realtime
class TestHostLogging:
    def test_failing_ports_print_nothing_by_default(self, tmp_path: Path) -> None:
        """A failing webhook delivery and audit write nothing to the host's stdout or stderr."""
        proc = _run_host(tmp_path, "quiet")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""
        assert proc.stderr == ""

    def test_a_host_that_configures_logging_sees_the_failures(self, tmp_path: Path) -> None:
        """The same failures reach stderr under `kernel.*` once the host configures logging."""
        proc = _run_host(tmp_path, "configure")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""
        assert "WARNING:kernel:port failed: delivery.deliver" in proc.stderr
        assert "WARNING:kernel:port failed: audit.close" in proc.stderr
        assert "ERROR:kernel.journal:" in proc.stderr  # the store battery's own log lines
