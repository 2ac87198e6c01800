"""`kernel validate` and `build_loop` (what `kernel run LOOP.yaml` uses), on the real app."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adapters.loop import LoopAgent
from kernel import ConfigError, Kernel, Limits, Ports
from kernel.testing import MemoryAudit
from kernel_cli.app import app
from kernel_cli.loops import build_loop

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "loop.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


BAD = """
    initial: a
    states:
      a: {action: ls, on_yes: bb, colour: red}
      b: {terminal: true}
"""
NEEDS_CONTEXT = """
    initial: a
    states:
      a: {action: "echo ${context.who}", next: done}
      done: {terminal: true}
"""


class TestValidate:
    def test_a_good_loop_passes(self) -> None:
        """A valid loop: exit 0 and a one-line summary."""
        result = CliRunner().invoke(app, ["validate", str(EXAMPLES / "ci-gate.yaml")])
        assert result.exit_code == 0, result.output
        assert result.output.strip().endswith("ok (5 states, initial 'toolchain')")

    def test_one_state_and_an_empty_mapping_read_right(self, tmp_path: Path) -> None:
        """`1 state`, not `1 states`; `states: {}` is "an empty mapping", not "a mapping"."""
        one = tmp_path / "one.yaml"
        one.write_text("name: x\ninitial: a\nstates:\n  a: {terminal: true}\n")
        result = CliRunner().invoke(app, ["validate", str(one)])
        assert result.output.strip().endswith("ok (1 state, initial 'a')"), result.output
        empty = tmp_path / "empty.yaml"
        empty.write_text("name: x\ninitial: a\nstates: {}\n")
        result = CliRunner().invoke(app, ["validate", str(empty)])
        assert result.exit_code == 2
        assert "states: expected a non-empty mapping of state name -> state, got an empty " \
               "mapping" in result.output

    def test_every_problem_is_listed_with_its_location(self, tmp_path: Path) -> None:
        """Errors and warnings each get a line with file:line and key path; exit 2."""
        path = write(tmp_path, BAD)
        result = CliRunner().invoke(app, ["validate", str(path)])
        assert result.exit_code == 2
        lines = result.output.splitlines()
        assert f"error: {path}:3: states.a.on_yes: route target 'bb' is not a state " \
               "(did you mean 'b'?)" in lines
        assert f"warning: {path}:3: states.a.colour: unknown state key 'colour' (ignored)" \
            in lines
        assert lines[-1] == f"{path}: 1 error, 2 warnings"

    def test_warnings_alone_exit_zero(self, tmp_path: Path) -> None:
        """A loop with only warnings still validates (exit 0) and shows them."""
        path = write(tmp_path, NEEDS_CONTEXT)
        result = CliRunner().invoke(app, ["validate", str(path)])
        assert result.exit_code == 0
        assert "pass --context who=VALUE" in result.output
        assert result.output.splitlines()[-1].endswith("1 warning)")

    def test_context_makes_a_missing_variable_an_error_or_satisfies_it(self,
                                                                       tmp_path: Path) -> None:
        """With --context given, an undefined ${context.x} is an error; defining it fixes it."""
        path = write(tmp_path, NEEDS_CONTEXT)
        runner = CliRunner()
        assert runner.invoke(app, ["validate", str(path), "-c", "other=1"]).exit_code == 2
        ok = runner.invoke(app, ["validate", str(path), "--context", "who=me"])
        assert ok.exit_code == 0 and "warning" not in ok.output

    def test_json_output(self, tmp_path: Path) -> None:
        """--json prints the problems as one JSON document."""
        path = write(tmp_path, BAD)
        result = CliRunner().invoke(app, ["validate", "--json", str(path)])
        doc = json.loads(result.output)
        assert (result.exit_code, doc["ok"], doc["states"]) == (2, False, 2)
        assert {(p["severity"], p["line"], p["where"]) for p in doc["problems"]} >= {
            ("error", 3, "states.a.on_yes"), ("warning", 3, "states.a.colour")}

    def test_a_missing_file_and_a_bad_option_exit_two(self, tmp_path: Path) -> None:
        """No such file, or a --context without '=', is bad input: exit 2, one line."""
        runner = CliRunner()
        missing = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
        assert missing.exit_code == 2
        assert "no such loop file" in missing.output
        bad = runner.invoke(app, ["validate", str(EXAMPLES / "ci-gate.yaml"), "-c", "novalue"])
        assert bad.exit_code == 2

    @pytest.mark.realtime
    def test_the_installed_command_never_shows_a_traceback(self, tmp_path: Path,
                                                          kernel_exe: str,
                                                          cli_env: dict[str, str]) -> None:
        """`kernel validate` and `kernel run` on a malformed file: exit 2, no traceback."""
        path = write(tmp_path, "initial: a\nstates:\n  a: {next: [x]}\n")
        for args in (["validate", str(path)], ["run", "--no-audit", str(path)]):
            proc = subprocess.run([kernel_exe, *args], capture_output=True, text=True,
                                  env=cli_env, timeout=60)
            assert proc.returncode == 2, proc
            assert "Traceback" not in proc.stdout + proc.stderr
            assert f"{path}:3: states.a.next: expected a state name" in proc.stdout + proc.stderr


def _bounded() -> None:
    """In the child: 1 GiB of address space, so a loader that reads without limit fails fast."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


BOMB = "initial: a\ncontext:\n  l0: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  l{i}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9)}]\n" for i in range(1, 10)
) + "states:\n  a: {action: 'echo ${context.l9}', next: b}\n  b: {terminal: true}\n"


@pytest.mark.realtime
class TestHostileFiles:
    """Issue 13.9: the loader used to read a file whole before checking it."""

    @pytest.mark.parametrize("kind", ["fifo", "device", "huge", "bomb", "self-alias"])
    def test_refused_at_once_with_one_line(self, tmp_path: Path, kernel_exe: str,
                                          cli_env: dict[str, str], kind: str) -> None:
        """A FIFO, a device, a file past 1 MiB, an alias bomb, a recursive alias: exit 2,
        one line saying why, from both `kernel validate` and `kernel run`."""
        path = tmp_path / "loop.yaml"
        if kind == "fifo":
            os.mkfifo(path)
            why = "not a regular file (a FIFO)"
        elif kind == "device":
            path.symlink_to("/dev/zero")
            why = "not a regular file (a character device)"
        elif kind == "huge":
            with path.open("wb") as f:
                f.truncate(8 << 30)  # sparse: 8 GiB without using the disk
            why = "too large for a loop file"
        elif kind == "bomb":
            path.write_text(BOMB)
            why = f"{path}:8:7: the document's aliases expand it past"
        else:
            path.write_text("initial: a\nstates: &s\n  a: {terminal: true}\n  x: *s\n")
            why = "an alias refers to the node that contains it"
        for args in (["validate", str(path)], ["run", "--no-audit", str(path)]):
            proc = subprocess.run([kernel_exe, *args], capture_output=True, text=True,
                                  env=cli_env, timeout=120, preexec_fn=_bounded)
            assert proc.returncode == 2, proc
            assert why in proc.stdout + proc.stderr
            assert "Traceback" not in proc.stdout + proc.stderr


class TestBuildLoop:
    def test_agent_info_and_limits_come_from_the_file(self, tmp_path: Path) -> None:
        """build_loop gives a LoopAgent, a RunInfo naming the loop, and its bounds."""
        agent, info, limits = build_loop(str(EXAMPLES / "poll-until-done.yaml"),
                                         {"job_seconds": "2"}, warn=None)
        assert isinstance(agent, LoopAgent)
        assert agent.context["job_seconds"] == "2"
        assert (info.name, info.subject_id) == ("poll-until-done", "loop:poll-until-done")
        assert info.inputs["context"] == {"job_seconds": "2"}
        assert (limits.max_steps, limits.timeout, limits.tool_timeout) == (40, 60, None)

    def test_action_commands_can_be_chosen(self) -> None:
        """The prompt and MCP commands are passed through to the agent."""
        agent, _, _ = build_loop(str(EXAMPLES / "ci-gate.yaml"), {}, warn=None,
                                 prompt_command=["my-agent", "--print"],
                                 mcp_command=["my-mcp"])
        assert isinstance(agent, LoopAgent)
        assert (agent.prompt_command, agent.mcp_command) == (("my-agent", "--print"),
                                                             ("my-mcp",))

    def test_a_file_without_timeout_gets_the_default_backstop(self, tmp_path: Path) -> None:
        """No `timeout:` in the file: the kernel's default hard deadline applies."""
        path = write(tmp_path, "initial: a\nstates: {a: {terminal: true}}\n")
        _, _, limits = build_loop(str(path), {}, warn=None)
        assert limits.timeout == Limits().timeout

    def test_a_missing_context_variable_is_a_config_error(self, tmp_path: Path) -> None:
        """A ${context.x} neither the file nor --context defines fails before running."""
        path = write(tmp_path, NEEDS_CONTEXT)
        with pytest.raises(ConfigError) as info:
            build_loop(str(path), {}, warn=None)
        message = str(info.value)
        assert message.startswith(f"{path}:3: states.a.action: context variable 'who'")
        assert "--context who=VALUE" in message
        build_loop(str(path), {"who": "me"}, warn=None)

    def test_an_unknown_scenario_is_a_config_error(self) -> None:
        """--scenario must be one of the five."""
        with pytest.raises(ConfigError, match="unknown --scenario 'sometimes'"):
            build_loop(str(EXAMPLES / "ci-gate.yaml"), {}, scenario="sometimes", warn=None)

    def test_warnings_are_reported_and_kept_for_the_audit(self, tmp_path: Path) -> None:
        """Warnings go to the warn callback and onto the agent (audited at its first step)."""
        path = write(tmp_path, "initial: a\nflavour: x\nstates: {a: {terminal: true}}\n")
        seen: list[str] = []
        agent, _, _ = build_loop(str(path), {}, warn=seen.append)
        assert seen == [f"warning: {path}:2: flavour: unknown loop key 'flavour' (ignored)"]
        assert isinstance(agent, LoopAgent) and agent.warnings == seen


class FakeStdin(io.StringIO):
    """A stdin that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class TestAskingOnTheTerminal:
    async def test_a_dry_run_asks_each_result_on_a_terminal(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> None:
        """Without --scenario and with stdin a TTY, each result is read from it (empty = pass).

        The loop adapter never reads the terminal: the CLI's `build_loop`
        injects `ask_on_terminal` as the agent's `ask`.
        """
        monkeypatch.setattr(sys, "stdin", FakeStdin("f\n\n"))
        path = write(tmp_path, """
            initial: test
            max_iterations: 6
            states:
              test: {action: "make test", on_yes: done, on_no: fix}
              fix: {action: "make fix", on_yes: test, on_no: done}
              done: {terminal: true}
        """)
        agent, info, limits = build_loop(str(path), {})
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(
            agent, info, Limits(max_steps=limits.max_steps, dry_run=True))
        entered = [e.name for e in audit.events(result.run_id) if e.kind == "state_enter"]
        assert entered == ["test", "fix", "test"]
        assert "[p]ass / [f]ail / [e]rror" in capsys.readouterr().err
