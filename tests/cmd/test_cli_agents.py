"""`kernel run --agent llm|agentcli`: building the agent from options, and end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from http_fakes import send_json, serving

from adapters.agentcli import CLIAgent, SessionCLIAgent
from adapters.llm import LLMAgent
from kernel import ConfigError
from kernel_cli.agents import build_agent

FAKE_CLI = str(Path(__file__).parents[1] / "adapters" / "fake_agent_cli.py")


def llm(**kw: Any) -> Any:
    opts: dict[str, Any] = {"model": "m", "base_url": "http://127.0.0.1:9/v1", "prompt": "hi",
                            "cmd": None, "api_key_env": None, "allow_shell": False,
                            "context": {}}
    opts.update(kw)
    return build_agent("llm", **opts)


def agentcli(**kw: Any) -> Any:
    opts: dict[str, Any] = {"model": None, "base_url": None, "prompt": None,
                            "cmd": f"{sys.executable} {FAKE_CLI} claude", "api_key_env": None,
                            "allow_shell": False, "context": {}}
    opts.update(kw)
    return build_agent("agentcli", **opts)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)


class TestBuildLLM:
    """--agent llm."""

    def test_builds_an_llm_agent(self) -> None:
        """Model, URL and prompt make an LLMAgent with read_file only, and a descriptive RunInfo."""
        agent, info = llm(prompt="Summarise ${context.file}", context={"file": "README.md"})
        assert isinstance(agent, LLMAgent)
        assert agent.prompt == "Summarise README.md"
        assert agent.client.url == "http://127.0.0.1:9/v1/chat/completions"
        assert list(agent.tools) == ["read_file"]
        assert (info.name, info.subject_id) == ("llm m", "llm:m")
        assert info.inputs["tools"] == ["read_file"] and info.inputs["prompt"] == agent.prompt

    def test_allow_shell_adds_the_shell_tool(self) -> None:
        """--allow-shell, and only it, gives the model a shell."""
        agent, _ = llm(allow_shell=True)
        assert list(agent.tools) == ["read_file", "shell"]

    def test_base_url_and_key_from_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without --base-url, $OPENAI_BASE_URL is used; the key comes from $OPENAI_API_KEY."""
        monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1/")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
        agent, info = llm(base_url=None)
        assert agent.client.url == "http://127.0.0.1:8000/v1/chat/completions"
        assert agent.client.has_key and "sk-x" not in json.dumps(info.inputs)

    def test_custom_key_variable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """--api-key-env names another variable, which must then be set."""
        monkeypatch.setenv("MY_LLM_KEY", "k")
        agent, _ = llm(api_key_env="MY_LLM_KEY")
        assert agent.client.has_key and agent.client.api_key_env == "MY_LLM_KEY"

    @pytest.mark.parametrize(("kw", "message"), [
        ({"model": None}, "--agent llm needs --model NAME"),
        ({"model": "  "}, "--agent llm needs --model NAME"),
        ({"prompt": None}, "--agent llm needs --prompt TASK"),
        ({"cmd": "claude -p"}, "--cmd is for --agent agentcli"),
        ({"base_url": "localhost:8000"}, "--base-url: base URL must be http(s)://HOST[/PATH]"),
        ({"api_key_env": "NOPE_NOT_SET"}, "--api-key-env NOPE_NOT_SET: the variable is not set"),
        ({"api_key_env": "bad name"}, "--api-key-env expects a variable name"),
        ({"base_url": None}, "OPENAI_API_KEY is not set (https://api.openai.com/v1 needs"),
        ({"prompt": "hi ${context.who}", "context": {"a": "1"}},
         "--prompt uses ${context.who} but there is no --context who=VALUE (known: a)"),
    ])
    def test_bad_options_are_one_line_config_errors(self, kw: dict[str, Any],
                                                    message: str) -> None:
        """Each missing or wrong option is a ConfigError whose one line says what to fix."""
        with pytest.raises(ConfigError) as err:
            llm(**kw)
        assert message in str(err.value) and "\n" not in str(err.value)

    def test_literal_dollar_brace(self) -> None:
        """$${ writes a literal ${, and other namespaces are left alone."""
        agent, _ = llm(prompt="echo $${HOME} ${env.X}")
        assert agent.prompt == "echo ${HOME} ${env.X}"


class TestBuildAgentCLI:
    """--agent agentcli."""

    def test_builds_a_cli_agent(self) -> None:
        """The command is split like a shell would, the prompt appended as the last argument."""
        agent, info = agentcli(cmd=f"{sys.executable} -p --output-format stream-json",
                               prompt="fix ${context.what}",
            context={"what": "the tests; rm -rf /", "dir.name": "src"})
        assert isinstance(agent, CLIAgent)
        assert agent.argv == [sys.executable, "-p", "--output-format", "stream-json",
                              "fix the tests; rm -rf /"]
        assert agent.env == {"KERNEL_CTX_WHAT": "the tests; rm -rf /",
                             "KERNEL_CTX_DIR_NAME": "src"}
        assert info.subject_id == f"agentcli:{os.path.basename(sys.executable)}"
        assert info.inputs["argv"] == agent.argv

    def test_values_never_split_arguments(self) -> None:
        """A context value with spaces and quotes stays inside the one argument it lands in."""
        agent, _ = agentcli(cmd=f"{sys.executable} --task=${{context.t}}",
                            context={"t": "a 'b' c"})
        assert agent.argv[1:] == ["--task=a 'b' c"]

    @pytest.mark.parametrize(("kw", "message"), [
        ({"cmd": None}, '--agent agentcli needs --cmd "COMMAND LINE"'),
        ({"cmd": "claude 'unterminated"}, "--cmd is not a valid command line"),
        ({"cmd": "no-such-agent-cli-xyz -p"},
         "--cmd: command not found or not executable: no-such-agent-cli-xyz"),
        ({"cmd": "/etc"}, "--cmd: command not found or not executable: /etc"),
        ({"model": "gpt"}, "--model is for --agent llm"),
        ({"base_url": "http://x"}, "--base-url is for --agent llm"),
        ({"allow_shell": True}, "--allow-shell is for --agent llm"),
        ({"cmd": "claude ${context.x}"}, "--cmd uses ${context.x} but there is no --context"),
    ])
    def test_bad_options_are_one_line_config_errors(self, kw: dict[str, Any],
                                                    message: str) -> None:
        """Each missing or wrong option is a ConfigError whose one line says what to fix."""
        with pytest.raises(ConfigError) as err:
            agentcli(**kw)
        assert message in str(err.value) and "\n" not in str(err.value)

    def test_unknown_kind(self) -> None:
        """An agent kind we do not have is named in the error with the choices."""
        with pytest.raises(ConfigError, match=r"unknown agent kind 'robot' \(choose one of: "
                                              r"llm, agentcli, pane, claude, codex, gemini\)"):
            build_agent("robot", model=None, base_url=None, prompt=None, cmd=None,
                        api_key_env=None, allow_shell=False, context={})

    @pytest.mark.realtime
    def test_cli_import_stays_light(self) -> None:
        """Importing the agents module loads neither the adapters nor httpx."""
        code = ("import sys, kernel_cli.agents; "
                "heavy = {'httpx', 'adapters.llm', 'adapters.agentcli'} & set(sys.modules); "
                "print(sorted(heavy))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == "[]"


# ------------------------------------------------------------ end to end


class _Echo(BaseHTTPRequestHandler):
    """Answers every chat completion with the last user message, reversed."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][-1]["content"][::-1]
        send_json(self, {"choices": [{"message": {"role": "assistant", "content": text},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    """A chat-completions server on 127.0.0.1 that echoes the prompt reversed."""
    with serving(_Echo) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def kernel(kernel_exe: str, cli_env: dict[str, str]) -> Any:
    """Run `kernel run --no-audit ARGS...` and return the finished process."""
    env = {k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kernel_exe, "run", "--no-audit", *args], capture_output=True,
                              text=True, timeout=60, env=env)

    return run


@pytest.mark.realtime
class TestKernelRunAgents:
    """The installed `kernel` executable running both agent kinds."""

    def test_llm_agent_end_to_end(self, kernel: Any, echo_server: str) -> None:
        """`kernel run --agent llm` talks to the server and prints the answer as JSON."""
        proc = kernel("--json", "--agent", "llm", "--model", "m", "--base-url", echo_server,
                      "--prompt", "olleh ${context.x}", "--context", "x=dlrow")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert (result["status"], result["output"]) == ("ok", "world hello")
        assert result["usage"]["input_tokens"] == 3

    def test_agentcli_end_to_end(self, kernel: Any) -> None:
        """`kernel run --agent agentcli` runs the CLI and reports its result."""
        proc = kernel("--json", "--agent", "agentcli", "--cmd",
                      f"{sys.executable} {FAKE_CLI} claude")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["output"] == "There are two files: a.txt and b.txt."

    def test_agentcli_crash_exits_1(self, kernel: Any) -> None:
        """A crashing CLI agent ends `error`, exit code 1, with the reason."""
        proc = kernel("--json", "--agent", "agentcli", "--cmd",
                      f"{sys.executable} {FAKE_CLI} crash")
        assert proc.returncode == 1
        assert "mid-turn (state running_tool" in json.loads(proc.stdout)["error"]

    def test_bad_agent_options_exit_2(self, kernel: Any) -> None:
        """A missing option exits 2 with one line on stderr and no traceback."""
        proc = kernel("--agent", "llm", "--prompt", "x")
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert line.endswith("--agent llm needs --model NAME")


def build_preset(kind: str, **kw: Any) -> Any:
    opts: dict[str, Any] = {"model": None, "base_url": None, "prompt": "fix it", "cmd": None,
                            "api_key_env": None, "allow_shell": False, "context": {}}
    opts.update(kw)
    return build_agent(kind, **opts)


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding stand-in `claude`, `codex` and `gemini` executables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex", "gemini"):
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


class TestBuildPresets:
    """--agent claude|codex|gemini: each client's non-interactive command line."""

    def test_claude(self, on_path: Path) -> None:
        """Claude Code: print mode, stream-json both ways, the task on stdin, resumable."""
        agent, info = build_preset("claude", model="sonnet", max_turns=7,
                                   prompt="fix ${context.x}", context={"x": "the bug"})
        assert isinstance(agent, SessionCLIAgent)
        assert agent.argv == [str(on_path / "claude"), "-p", "--output-format", "stream-json",
                              "--verbose", "--include-partial-messages", "--input-format",
                              "stream-json", "--model", "sonnet", "--max-turns", "7"]
        assert (agent.stdin_prompt, agent.stdin_steer) == ("fix the bug", True)
        assert agent.cwd == os.getcwd() and agent.env == {"KERNEL_CTX_X": "the bug"}
        assert agent.resume_argv is not None
        assert list(agent.resume_argv("S1"))[-2:] == ["--resume", "S1"]
        assert (info.subject_id, info.inputs["agent"]) == ("agentcli:claude", "claude")

    def test_codex(self, on_path: Path) -> None:
        """Codex: exec --json with the task last, after `--` (a task starting with `-` is
        not an option); resume is `codex exec resume ... -- ID PROMPT`."""
        agent, _ = build_preset("codex", model="gpt-5")
        assert agent.argv == [str(on_path / "codex"), "exec", "--json",
                              "--skip-git-repo-check", "--model", "gpt-5", "--", "fix it"]
        assert agent.stdin_prompt is None and not agent.stdin_steer
        assert agent.resume_argv is not None
        assert list(agent.resume_argv("T1"))[:6] == [
            str(on_path / "codex"), "exec", "resume", "--json", "--skip-git-repo-check",
            "--model"]
        assert list(agent.resume_argv("T1"))[-2] == "T1"

    def test_gemini(self, on_path: Path) -> None:
        """Gemini CLI: stream-json output, the task as --prompt=TASK (one argument: a task
        starting with `-` is not an option); resume by session id."""
        agent, _ = build_preset("gemini")
        assert agent.argv == [str(on_path / "gemini"), "--output-format", "stream-json",
                              "--prompt=fix it"]
        assert agent.resume_argv is not None
        assert list(agent.resume_argv("G1"))[3:5] == ["--resume", "G1"]

    @pytest.mark.parametrize(("kind", "kw", "message"), [
        ("claude", {"prompt": None}, "--agent claude needs --prompt TASK"),
        ("codex", {"cmd": "codex exec"}, "--cmd does not apply to --agent codex"),
        ("gemini", {"base_url": "http://x"}, "--base-url does not apply to --agent gemini"),
        ("claude", {"api_key_env": "K"}, "--api-key-env does not apply to --agent claude"),
        ("codex", {"max_turns": 3}, "--max-turns: codex has no turn limit option"),
        ("gemini", {"max_turns": 3}, "--max-turns: gemini has no turn limit option"),
        ("claude", {"allow_shell": True}, "--allow-shell is for --agent llm"),
        ("llm", {"max_turns": 3, "model": "m"}, "--max-turns is for --agent claude"),
    ])
    def test_bad_options(self, on_path: Path, kind: str, kw: dict[str, Any],
                         message: str) -> None:
        """Options a client cannot take are one-line ConfigErrors."""
        with pytest.raises(ConfigError) as err:
            build_preset(kind, **kw)
        assert message in str(err.value) and "\n" not in str(err.value)

    def test_client_not_installed(self, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
        """A client missing from PATH is named, with the package to install."""
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(ConfigError, match=r"`codex` is not on PATH \(npm install -g "
                                              r"@openai/codex\)"):
            build_preset("codex")


class TestBuildPaneAgent:
    def test_pane_needs_target_and_prompt(self) -> None:
        """--agent pane without --target or --prompt is a one-line ConfigError."""
        with pytest.raises(ConfigError, match="needs --target"):
            build_agent("pane", model=None, base_url=None, prompt="hi", cmd=None,
                        api_key_env=None, allow_shell=False, context={})
        with pytest.raises(ConfigError, match="needs --prompt"):
            build_agent("pane", model=None, base_url=None, prompt=None, cmd=None,
                        api_key_env=None, allow_shell=False, context={}, target="dev")

    def test_options_that_do_not_apply(self) -> None:
        """LLM options with --agent pane, or --target with another kind, are refused."""
        with pytest.raises(ConfigError, match="--model does not apply to --agent pane"):
            build_agent("pane", model="m", base_url=None, prompt="hi", cmd=None,
                        api_key_env=None, allow_shell=False, context={}, target="dev")
        with pytest.raises(ConfigError, match="--target is for --agent pane"):
            build_agent("llm", model="m", base_url=None, prompt="hi", cmd=None,
                        api_key_env=None, allow_shell=False, context={}, target="dev")

    def test_prompt_context(self) -> None:
        """${context.KEY} in the prompt is filled in; the pane is named in the run info."""
        agent, info = build_agent("pane", model=None, base_url=None,
                                  prompt="fix ${context.bug}", cmd=None, api_key_env=None,
                                  allow_shell=False, context={"bug": "#12"}, target="dev:0")
        assert agent.prompt == "fix #12"  # type: ignore[attr-defined]
        assert info.subject_id == "pane:dev:0"
