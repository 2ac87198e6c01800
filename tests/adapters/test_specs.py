"""adapters.agent_from_spec: every kind the CLI runs, built from a spec, in the spec's cwd."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import trio

from adapters import agent_from_spec
from adapters.agentcli import CLIAgent
from adapters.llm import LLMAgent
from adapters.loop import LoopAgent
from adapters.shell import ShellAgent
from kernel import (
    AgentSpec,
    CommandSpec,
    ConfigError,
    Kernel,
    Limits,
    LoopSpec,
    Ports,
    RunInfo,
    RunSpec,
    Status,
)

FAKE_CLI = str(Path(__file__).parent / "fake_agent_cli.py")

LOOP = """\
name: where
initial: here
timeout: 30
max_iterations: 3
states:
  here:
    action: pwd
    next: done
  done:
    terminal: true
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)


def test_command_runs_in_the_spec_cwd(tmp_path: Path) -> None:
    """A stored command spec runs in its cwd (this process's directory never changes)."""
    here = os.getcwd()
    spec = RunSpec(CommandSpec(("pwd",), {"who": "me"}), RunInfo(name="pwd"),
                   Limits(timeout=30), cwd=str(tmp_path))
    built = agent_from_spec(spec)
    assert isinstance(built.agent, ShellAgent)
    assert built.info is spec.info and built.limits == spec.limits
    result = trio.run(Kernel(Ports()).run, built.agent, built.info, built.limits)
    assert result.status is Status.OK
    assert str(result.output).strip() == str(tmp_path.resolve())
    assert os.getcwd() == here


def test_command_alone_gets_a_fresh_info() -> None:
    """What-to-run alone: a RunInfo naming the command, no limits (the caller's choice)."""
    built = agent_from_spec(CommandSpec(("echo", "hi there"), {"k": "v"}))
    assert built.info.name == "echo 'hi there'" and built.info.subject_id == "echo"
    assert built.info.inputs == {"argv": ["echo", "hi there"], "context": {"k": "v"}}
    assert built.limits is None


def test_loop_with_its_limits_and_output(tmp_path: Path) -> None:
    """A loop spec gives a LoopAgent, the file's bounds, and echoes through on_output."""
    loop = tmp_path / "where.yaml"
    loop.write_text(LOOP)
    work = tmp_path / "work"
    work.mkdir()
    chunks: list[bytes] = []
    built = agent_from_spec(LoopSpec(str(loop)), cwd=str(work),
                            on_output=lambda _stream, chunk: chunks.append(chunk))
    assert isinstance(built.agent, LoopAgent)
    assert built.limits is not None and built.limits.timeout == 30
    assert built.limits.max_steps == 3
    result = trio.run(Kernel(Ports()).run, built.agent, built.info, built.limits)
    assert result.status is Status.OK
    assert b"".join(chunks).decode().strip() == str(work.resolve())


def test_llm_and_agentcli() -> None:
    """The agent kinds build their adapters; their options are checked the CLI's way."""
    llm = agent_from_spec(AgentSpec("llm", model="m", base_url="http://127.0.0.1:9/v1",
                                    prompt="say ${context.word}", context={"word": "hi"}))
    assert isinstance(llm.agent, LLMAgent)
    assert llm.info.inputs["prompt"] == "say hi"
    cli = agent_from_spec(AgentSpec("agentcli", cmd=f"{sys.executable} {FAKE_CLI} claude",
                                    prompt="p"))
    assert isinstance(cli.agent, CLIAgent)
    with pytest.raises(ConfigError, match="--agent llm needs --model NAME"):
        agent_from_spec(AgentSpec("llm", prompt="x"))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_pane() -> None:
    """A pane agent is built from its target and prompt."""
    built = agent_from_spec(AgentSpec("pane", target="dev:0.1", prompt="make test"))
    assert built.info.subject_id == "pane:dev:0.1"


@pytest.mark.parametrize(("spec", "message"), [
    (LoopSpec("/nowhere/loop.yaml"), "loop file not found: /nowhere/loop.yaml"),
    (RunSpec(CommandSpec(("true",)), cwd="/nowhere/at/all"),
     "the run's working directory is gone: /nowhere/at/all"),
])
def test_one_line_errors(spec: RunSpec | LoopSpec, message: str) -> None:
    """A spec that cannot be built is one ConfigError line."""
    with pytest.raises(ConfigError) as err:
        agent_from_spec(spec)
    assert str(err.value) == message
