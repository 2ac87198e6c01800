"""The shell adapter against real subprocesses (real time, kept short)."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest
import trio
from procs import group_gone

from adapters.shell import ShellAgent
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, ScriptedCritic

pytestmark = pytest.mark.realtime




def started_pid(audit: MemoryAudit, run_id: str) -> int:
    [event] = [e for e in audit.events(run_id) if e.kind == "process_start"]
    return int(event.payload["pid"])


class TestExitStatus:
    async def test_success(self) -> None:
        """Exit 0 is ok, with stdout as the output and each line an audit event."""
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(
            ShellAgent(["sh", "-c", "echo one; echo two >&2; echo three"]), RunInfo())
        assert result.status is Status.OK and result.exit_code == 0
        assert result.output == "one\nthree"
        lines = [(e.name, e.payload["line"]) for e in audit.events(result.run_id)
                 if e.kind == "output"]
        assert sorted(lines) == [("stderr", "two"), ("stdout", "one"), ("stdout", "three")]

    async def test_failure_keeps_the_code(self) -> None:
        """A non-zero exit is error, with the command's code and its last stderr line."""
        result = await Kernel().run(ShellAgent(["sh", "-c", "echo oops >&2; exit 7"]))
        assert result.status is Status.ERROR and result.exit_code == 7
        assert result.error == "command exited with code 7: oops"

    async def test_missing_command(self) -> None:
        """A command that does not exist is error 127 with a clear message, not a crash."""
        result = await Kernel().run(ShellAgent(["no-such-command-xyz"]))
        assert result.status is Status.ERROR and result.exit_code == 127
        assert "cannot start 'no-such-command-xyz'" in (result.error or "")

    @pytest.mark.parametrize(("argv0", "code", "says"), [
        (".", 126, "it is a directory"),
        ("./sub", 126, "it is a directory"),
        ("job.sh", 127, "not found on PATH (a file of that name is here: ./job.sh runs it)"),
        ("./job.sh", 126, "Permission denied (the file is not executable)"),
        ("loop.yaml", 127, "a loop file runs as `kernel run loop.yaml`, without `--`"),
        ("./Loop.YML", 126, "a loop file runs as `kernel run ./Loop.YML`, without `--`"),
    ])
    async def test_cannot_start_says_which_slip(self, tmp_path: Path, argv0: str, code: int,
                                                says: str) -> None:
        """A directory, a script not on PATH or not executable, a loop file given as a
        command: the shell's 126/127, and the error says which and what to do."""
        (tmp_path / "sub").mkdir()
        for name in ("job.sh", "loop.yaml", "Loop.YML"):
            (tmp_path / name).write_text("echo hi\n")
        result = await Kernel().run(ShellAgent([argv0], cwd=str(tmp_path)))
        assert result.status is Status.ERROR and result.exit_code == code
        assert (result.error or "").startswith(f"cannot start {argv0!r}: ")
        assert says in (result.error or "")

    async def test_undecodable_output(self) -> None:
        """Bytes that are not UTF-8 are replaced, never a crash."""
        result = await Kernel().run(ShellAgent(["printf", "\\377\\376ok\\n"]))
        assert result.status is Status.OK
        assert result.output == "\ufffd\ufffdok"


class TestBoundedMemory:
    async def test_huge_output_is_not_held(self) -> None:
        """A command printing 100 MB keeps only the capped tail in memory."""
        agent = ShellAgent(["sh", "-c", "head -c 100000000 /dev/zero | tr '\\0' 'x'; echo; "
                            "echo last"], max_output_bytes=1 << 20)
        tracemalloc.start()
        try:
            result = await Kernel().run(agent, RunInfo(), Limits(timeout=60))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert result.status is Status.OK
        assert result.output.endswith("last")
        assert len(result.output) <= 1 << 20
        assert peak < 20_000_000, f"peak traced memory {peak} bytes"

    async def test_line_events_are_capped(self) -> None:
        """Past max_line_events, lines still count as activity but are not audited one by one."""
        audit, critic = MemoryAudit(), ScriptedCritic()
        agent = ShellAgent(["seq", "1", "500"], max_line_events=100)
        result = await Kernel(Ports(audit=audit, critic=critic)).run(agent)
        outputs = [e for e in audit.events(result.run_id) if e.kind == "output"]
        assert len(outputs) == 100
        assert critic.handles[0].activities.count("output") == 500
        [step] = [e for e in audit.events(result.run_id) if e.kind == "step"]
        assert step.payload["lines"] == 500


    async def test_uncounted_lines_get_one_marker_event(self) -> None:
        """Past the cap, one `output_not_audited` event says how many lines were left out."""
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(
            ShellAgent(["seq", "1", "500"], max_line_events=100))
        [marker] = [e for e in audit.events(result.run_id) if e.kind == "output_not_audited"]
        assert marker.payload == {"lines": 400, "cap": 100}
        none = MemoryAudit()
        result = await Kernel(Ports(audit=none)).run(ShellAgent(["seq", "1", "5"]))
        assert not [e for e in none.events(result.run_id) if e.kind == "output_not_audited"]

    async def test_a_long_line_is_one_line_cut_and_marked(self) -> None:
        """A 1.49 MB line is one audited line, cut and `truncated`; the echo gets every byte."""
        line = b"{" + b"x" * 1_490_000 + b"}"
        echoed: list[bytes] = []
        audit = MemoryAudit()
        agent = ShellAgent([sys.executable, "-c",
                            "import sys; sys.stdout.buffer.write(b'{' + b'x' * 1_490_000"
                            " + b'}\\n\\xff tail')"],
                           on_output=lambda stream, chunk: echoed.append(chunk))
        result = await Kernel(Ports(audit=audit)).run(agent)
        assert result.status is Status.OK
        assert b"".join(echoed) == line + b"\n\xff tail"
        outputs = [e.payload for e in audit.events(result.run_id) if e.kind == "output"]
        assert len(outputs) == 2
        assert outputs[0]["truncated"] is True and outputs[0]["line"] == "{" + "x" * 4095
        assert outputs[1] == {"line": "\ufffd tail"}
        [step] = [e for e in audit.events(result.run_id) if e.kind == "step"]
        assert step.payload["lines"] == 2


class TestProcessHygiene:
    async def test_timeout_kills_the_group(self) -> None:
        """On timeout the whole process group is stopped; no sleep survives."""
        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(audit=audit)).run(
            ShellAgent(["sh", "-c", "sleep 30 & sleep 30 & wait"]), RunInfo(), Limits(timeout=1))
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start < 20  # not the 30 s sleeps (margin for load)
        assert group_gone(started_pid(audit, result.run_id))
        # The audit says how the command ended although its step never finished.
        [ended] = [e for e in audit.events(result.run_id) if e.kind == "process_exit"]
        assert ended.payload == {"exit_code": 143, "signal": 15, "stopped": True}

    async def test_sigterm_ignored_gets_sigkill(self) -> None:
        """A command ignoring SIGTERM is SIGKILLed after the grace period."""
        code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(30)")
        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(audit=audit)).run(
            ShellAgent([sys.executable, "-c", code], grace=0.5), RunInfo(), Limits(timeout=1))
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start < 20  # not the 30 s sleep (margin for load)
        assert group_gone(started_pid(audit, result.run_id))
        [ended] = [e for e in audit.events(result.run_id) if e.kind == "process_exit"]
        assert ended.payload == {"exit_code": 137, "signal": 9, "stopped": True}

    async def test_leftover_children_are_reaped(self) -> None:
        """A command that exits leaving a background child ends promptly; the child is stopped."""
        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(audit=audit)).run(
            ShellAgent(["sh", "-c", "sleep 30 & echo done"]), RunInfo(), Limits(timeout=20))
        assert result.status is Status.OK and result.output == "done"
        assert trio.current_time() - start < 15  # not the 30 s sleep (margin for load)
        assert group_gone(started_pid(audit, result.run_id))
        [ended] = [e for e in audit.events(result.run_id) if e.kind == "process_exit"]
        assert ended.payload == {"exit_code": 0, "signal": None}  # it ended by itself

    async def test_outer_cancel_stops_the_command(self) -> None:
        """Cancelling the caller stops the command's group, and the run is cancelled."""
        audit = MemoryAudit()
        with trio.move_on_after(0.5):
            await Kernel(Ports(audit=audit)).run(ShellAgent(["sleep", "30"]))
        [row] = audit.runs.values()
        assert row.status is Status.CANCELLED
        assert group_gone(started_pid(audit, row.info.run_id))
        [ended] = [e for e in audit.events(row.info.run_id) if e.kind == "process_exit"]
        assert ended.payload == {"exit_code": 143, "signal": 15, "stopped": True}


class TestSteer:
    async def test_nudge_is_undeliverable_without_stdin(self) -> None:
        """A nudge to a plain command is audited as undeliverable."""
        audit = MemoryAudit()
        critic = ScriptedCritic(steer_after={0.2: "are you stuck?"})
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            ShellAgent(["sleep", "1"]), RunInfo(), Limits(poll_interval=0.1))
        assert result.status is Status.OK
        [ev] = [e for e in audit.events(result.run_id) if e.kind == "steer_undeliverable"]
        assert ev.payload["messages"] == ["are you stuck?"]

    async def test_nudge_to_stdin(self) -> None:
        """With steer_stdin, a nudge is written to the command's stdin."""
        critic = ScriptedCritic(steer_after={0.2: "hello there"})
        result = await Kernel(Ports(critic=critic)).run(
            ShellAgent(["sh", "-c", "read line; echo got: $line"], steer_stdin=True),
            RunInfo(), Limits(poll_interval=0.1, timeout=10))
        assert result.status is Status.OK and result.output == "got: hello there"
