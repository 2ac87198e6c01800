"""Agents from run specs: what `kernel run`, `kernel resume` and hosts build from a `RunSpec`.

    from adapters import agent_from_spec
    from kernel import Kernel, LoopSpec, RunSpec

    built = agent_from_spec(LoopSpec(path="/abs/loop.yaml", context={"dir": "src"}))
    result = await Kernel(ports).run(built.agent, built.info, built.limits)

`agent_from_spec` covers every kind the CLI runs: a `CommandSpec`
(`ShellAgent`), a `LoopSpec` (`LoopAgent`, its `llm_structured` evaluations
answered by `adapters.llm.llm_judge`), and an `AgentSpec` (llm, agentcli,
pane, claude, codex, gemini). Given a whole `RunSpec` (a stored one, to
resume it) the agent is built in the spec's `cwd` and the spec's own
`RunInfo` and `Limits` are handed back.

Adapters are imported inside the builders, so importing this module loads
neither them nor httpx. Every problem with a spec is a `ConfigError` with a
one-line message (the messages name the `kernel run` option that sets the
field). Terminal I/O stays with the caller: output echo (`on_output`),
warnings about a loop file (`warn`) and stdin (`inherit_stdin`) are options.

`${context.KEY}` in a prompt (and in each `cmd` argument) is replaced by
the context value; `$${` writes a literal `${`. Arguments of `cmd` are
split first and interpolated after, so a value never becomes more than the
one argument it lands in.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kernel import (
    Agent,
    AgentSpec,
    CommandSpec,
    ConfigError,
    Limits,
    LoopSpec,
    RunInfo,
    RunSpec,
)
from kernel._dataclass import dataclass

if TYPE_CHECKING:
    from adapters.llm import Price
    from adapters.loop import Asker, VerdictSource

__all__ = ["KINDS", "PRESETS", "BuiltAgent", "agent_from_spec", "build_agent", "build_loop",
           "interpolate", "spec_secrets", "stop_leftover_group"]

KINDS = AgentSpec.KINDS
PRESETS = ("claude", "codex", "gemini")

_CONTEXT_REF = re.compile(r"\$\$\{|\$\{context\.([A-Za-z0-9_.-]+)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_agent(kind: str, *, model: str | None, base_url: str | None, prompt: str | None,
                cmd: str | None, api_key_env: str | None, allow_shell: bool,
                context: Mapping[str, str], target: str | None = None,
                max_turns: int | None = None, cwd: str | None = None,
                price: tuple[float, ...] | None = None) -> tuple[Agent, RunInfo]:
    """The agent and its `RunInfo` for `kernel run --agent KIND ...`.

    Args:
        kind: "llm" (chat-completions API), "agentcli" (a CLI agent process),
            "pane" (an agent already running in a tmux pane), or a known CLI
            agent run non-interactively: "claude", "codex", "gemini".
        model: The model name (llm: required; claude/codex/gemini: optional).
        base_url: The API root (llm); default `$OPENAI_BASE_URL`, then OpenAI's.
        prompt: The task. llm: required, the first user message. agentcli:
            optional, appended to the command line as its last argument.
        cmd: The agent's command line (agentcli; required), split like a shell would.
        api_key_env: The variable holding the API key (llm); default OPENAI_API_KEY.
        allow_shell: Give the llm agent the `shell` tool.
        context: `--context` variables, for `${context.KEY}` and (agentcli) the
            environment as `KERNEL_CTX_KEY`.
        target: The tmux pane (pane; required), e.g. "dev" or "dev:0.1".
        max_turns: The agent's turn limit (claude only).
        cwd: The working directory the agent runs in (default: the current one).
        price: (input, output) US dollars per million tokens (llm only).

    Raises:
        ConfigError: An unknown kind, a missing or inapplicable option, a
            malformed URL or command line, an unset key variable, an unknown
            `${context.KEY}`, or an agent command that is not found.
    """
    name = kind.strip().lower()
    if name != "pane" and target is not None:
        raise ConfigError("--target is for --agent pane")
    if name != "llm" and price is not None:
        raise ConfigError("--price is for --agent llm (an agent CLI reports its own cost)")
    if name not in PRESETS and max_turns is not None:
        raise ConfigError("--max-turns is for --agent claude")
    if name in PRESETS:
        return _build_preset(name, model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                             api_key_env=api_key_env, allow_shell=allow_shell,
                             context=context, max_turns=max_turns, cwd=cwd)
    if name == "pane":
        return _build_pane(target=target, prompt=prompt, context=context,
                           others={"--model": model, "--base-url": base_url, "--cmd": cmd,
                                   "--api-key-env": api_key_env})
    if name == "llm":
        return _build_llm(model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                          api_key_env=api_key_env, allow_shell=allow_shell, context=context,
                          cwd=cwd, price=price)
    if name == "agentcli":
        return _build_agentcli(model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                               api_key_env=api_key_env, allow_shell=allow_shell,
                               context=context, cwd=cwd)
    raise ConfigError(f"unknown agent kind {kind!r} (choose one of: {', '.join(KINDS)})")


def _build_pane(*, target: str | None, prompt: str | None, context: Mapping[str, str],
                others: dict[str, str | None]) -> tuple[Agent, RunInfo]:
    from adapters.pane import PaneAgent, TmuxMultiplexer

    for flag, value in others.items():
        if value is not None:
            raise ConfigError(f"{flag} does not apply to --agent pane")
    if not target or not target.strip():
        raise ConfigError("--agent pane needs --target SESSION[:WINDOW[.PANE]]")
    if prompt is None or not prompt.strip():
        raise ConfigError("--agent pane needs --prompt TASK (what to type into the pane)")
    if shutil.which("tmux") is None:
        raise ConfigError("--agent pane needs tmux, which is not installed")
    text = interpolate(prompt, context, where="--prompt")
    try:
        mux = TmuxMultiplexer(socket=os.environ.get("KERNEL_TMUX_SOCKET") or None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    agent = PaneAgent(target.strip(), text, mux)
    info = RunInfo(name=f"pane {target.strip()}", subject_id=f"pane:{target.strip()}",
                   inputs={"agent": "pane", "target": target.strip(), "prompt": text,
                           "context": dict(context)})
    return agent, info


def interpolate(text: str, context: Mapping[str, str], *, where: str) -> str:
    """Replace `${context.KEY}` in `text`; an unknown KEY is a ConfigError naming `where`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        key = m.group(1)
        if key not in context:
            known = ", ".join(sorted(context)) or "none given"
            raise ConfigError(f"{where} uses ${{context.{key}}} but there is no "
                              f"--context {key}=VALUE (known: {known})")
        return context[key]

    return _CONTEXT_REF.sub(sub, text)


def _build_llm(*, model: str | None, base_url: str | None, prompt: str | None,
               cmd: str | None, api_key_env: str | None, allow_shell: bool,
               context: Mapping[str, str], cwd: str | None = None,
               price: tuple[float, ...] | None = None) -> tuple[Agent, RunInfo]:
    from adapters.llm import DEFAULT_BASE_URL, ChatClient, LLMAgent, redact_url

    if cmd is not None:
        raise ConfigError("--cmd is for --agent agentcli; --agent llm takes --model and --prompt")
    if not model or not model.strip():
        raise ConfigError("--agent llm needs --model NAME")
    if prompt is None or not prompt.strip():
        raise ConfigError("--agent llm needs --prompt TASK")
    text = interpolate(prompt, context, where="--prompt")
    url = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    key_var = api_key_env if api_key_env is not None else "OPENAI_API_KEY"
    if not _ENV_NAME.match(key_var):
        raise ConfigError(f"--api-key-env expects a variable name, got {key_var!r}")
    has_key = bool(os.environ.get(key_var))
    if api_key_env is not None and not has_key:
        raise ConfigError(f"--api-key-env {key_var}: the variable is not set")
    try:
        # First: it checks the URL whole (a port out of range, a bad IPv6 literal),
        # which every use of `url` below relies on.
        client = ChatClient(url, api_key_env=key_var)
    except ValueError as exc:
        source = "--base-url" if base_url else "$OPENAI_BASE_URL"
        raise ConfigError(f"{source}: {exc}") from None
    if not has_key and (urlsplit(url).hostname or "").endswith("api.openai.com"):
        raise ConfigError(f"{key_var} is not set ({redact_url(url)} needs an API key; "
                          "for a local server give --base-url)")
    prices = {model.strip(): _price(price)} if price is not None else None
    agent = LLMAgent(model.strip(), text, client=client, allow_shell=allow_shell, cwd=cwd,
                     prices=prices)
    info = RunInfo(
        name=f"llm {model.strip()}", subject_id=f"llm:{model.strip()}",
        inputs={"agent": "llm", "model": model.strip(), "base_url": redact_url(url),
                "prompt": text, "tools": list(agent.tools), "context": dict(context),
                **({"price_per_mtok": list(price)} if price is not None else {})})
    return agent, info


def spec_secrets(spec: RunSpec | CommandSpec | LoopSpec | AgentSpec,
                 environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret values the agent a spec describes will hold, for the run's redactor.

    An llm agent's (and a loop's `llm_structured` judge's) API key, read from its
    `--api-key-env` variable (default OPENAI_API_KEY), whatever that variable is
    named: `batteries.redact` knows the values of variables whose *names* look
    secret, and `MYLLM_CRED` does not. Give them to the redactor
    (`Redactor.with_secrets`) so nothing stored holds the key even if a server or
    a tool echoes it. Empty for other kinds, or when the variable is unset.
    """
    env = os.environ if environ is None else environ
    what = spec.agent if isinstance(spec, RunSpec) else spec
    if isinstance(what, AgentSpec):
        if what.agent.strip().lower() != "llm":
            return []
        var = what.api_key_env
    elif isinstance(what, LoopSpec):
        var = what.api_key_env
    else:
        return []
    value = env.get(var or "OPENAI_API_KEY") or ""
    return [value] if value.strip() else []


def _price(price: tuple[float, ...]) -> Price:
    """`(input, output)` US dollars per million tokens as a `Price` (ConfigError if not)."""
    from adapters.llm import Price

    if len(price) != 2:
        raise ConfigError(f"a price is two amounts (input, output) in US dollars per "
                          f"million tokens, got {list(price)!r}")
    return Price(*price)


def _build_agentcli(*, model: str | None, base_url: str | None, prompt: str | None,
                    cmd: str | None, api_key_env: str | None, allow_shell: bool,
                    context: Mapping[str, str], cwd: str | None = None
                    ) -> tuple[Agent, RunInfo]:
    from adapters.agentcli import CLIAgent

    for flag, value in (("--model", model), ("--base-url", base_url),
                        ("--api-key-env", api_key_env)):
        if value is not None:
            raise ConfigError(f"{flag} is for --agent llm; with --agent agentcli put the "
                              "agent's own options in --cmd")
    if allow_shell:
        raise ConfigError("--allow-shell is for --agent llm; a CLI agent has its own tools")
    if cmd is None or not cmd.strip():
        raise ConfigError('--agent agentcli needs --cmd "COMMAND LINE"')
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise ConfigError(f"--cmd is not a valid command line: {exc}") from None
    argv = [interpolate(w, context, where="--cmd") for w in words]
    if prompt is not None:
        argv.append(interpolate(prompt, context, where="--prompt"))
    exe = argv[0]
    where = os.path.join(cwd, exe) if cwd else exe
    found = (os.access(where, os.X_OK) and not os.path.isdir(where)) if os.sep in exe \
        else shutil.which(exe) is not None
    if not found:
        raise ConfigError(f"--cmd: command not found or not executable: {exe}")
    env = {f"KERNEL_CTX_{k.upper().replace('-', '_').replace('.', '_')}": v
           for k, v in context.items()}
    agent = CLIAgent(argv, env=env or None, cwd=cwd)
    info = RunInfo(
        name=shlex.join(argv)[:200], subject_id=f"agentcli:{os.path.basename(exe)}",
        inputs={"agent": "agentcli", "argv": argv, "prompt": prompt, "context": dict(context)})
    return agent, info


def _build_preset(client: str, *, model: str | None, base_url: str | None,
                  prompt: str | None, cmd: str | None, api_key_env: str | None,
                  allow_shell: bool, context: Mapping[str, str],
                  max_turns: int | None, cwd: str | None = None) -> tuple[Agent, RunInfo]:
    from adapters.agentcli import CLIENTS, preset

    for flag, value in (("--cmd", cmd), ("--base-url", base_url),
                        ("--api-key-env", api_key_env)):
        if value is not None:
            raise ConfigError(
                f"{flag} does not apply to --agent {client}: the client reads its endpoint "
                "and key from its own environment and config"
                + ("; for another command line use --agent agentcli --cmd"
                   if flag == "--cmd" else ""))
    if allow_shell:
        raise ConfigError(f"--allow-shell is for --agent llm; {client} has its own tools")
    if prompt is None or not prompt.strip():
        raise ConfigError(f"--agent {client} needs --prompt TASK")
    text = interpolate(prompt, context, where="--prompt")
    exe = shutil.which(client)
    if exe is None:
        raise ConfigError(f"--agent {client}: `{client}` is not on PATH "
                          f"(npm install -g {CLIENTS[client]})")
    env = {f"KERNEL_CTX_{k.upper().replace('-', '_').replace('.', '_')}": v
           for k, v in context.items()}
    cwd = cwd or os.getcwd()
    try:
        agent = preset(client, text, model=model.strip() if model else None,
                       max_turns=max_turns, cwd=cwd, env=env or None, executable=exe)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    info = RunInfo(
        name=f"{client}: {text}"[:200], subject_id=f"agentcli:{client}",
        inputs={"agent": client, "argv": list(agent.argv), "prompt": text, "model": model,
                "max_turns": max_turns, "cwd": cwd, "context": dict(context)})
    return agent, info


# ------------------------------------------------------------------ loops


def build_loop(path: str, context: Mapping[str, str], *, scenario: str | None = None,
               judge: VerdictSource | None = None,
               on_line: Callable[[str, str], None] | None = None,
               warn: Callable[[str], None] | None = None,
               prompt_command: Sequence[str] | None = None,
               mcp_command: Sequence[str] | None = None,
               on_output: Callable[[str, bytes], Awaitable[None] | None] | None = None,
               cwd: str | None = None, ask: Asker | None = None,
               ) -> tuple[Agent, RunInfo, Limits]:
    """The agent, run description and bounds for `kernel run LOOP.yaml`.

    Args:
        path: The loop file.
        context: `--context KEY=VALUE` pairs; they override the file's `context`.
        scenario: Dry-run results (all-pass | all-fail | all-error | first-fail |
            alternating); None asks `ask` (all-pass without one). A dry run fills
            context the loop lacks (and empty `required_inputs`) with `<name>`
            placeholders.
        judge: Where `llm_structured` verdicts come from (the LLM adapter);
            None makes those evaluations `error` verdicts saying so.
        on_line: Called with ("stdout" | "stderr", line) for every action output line.
        warn: Called with each one-line warning about the file (None: not told).
            The warnings are also written to the run's audit at its first step.
        prompt_command: The command prompt actions run, prompt appended
            (default: `claude -p`).
        mcp_command: The command mcp_tool actions run, tool and JSON params
            appended (default: `mcp-call`).
        on_output: Called with ("stdout" | "stderr", bytes) for every chunk an
            action prints, untouched (the CLI's byte-exact echo).
        cwd: The working directory actions run in (default: the current one).
        ask: How a dry run without a scenario asks for each state's result (the
            CLI asks on the terminal).

    Raises:
        ConfigError: one line naming the file, line and key of the first error
            (a malformed file, a missing context variable, an unknown scenario).
    """
    from adapters.loop import SCENARIOS, LoopAgent, check_loop
    from adapters.loop import LoopFileError as _LoopFileError

    if scenario is not None and scenario not in SCENARIOS:
        raise ConfigError(f"unknown --scenario {scenario!r} (choose from {', '.join(SCENARIOS)})")
    dry = scenario is not None
    context = dict(context)
    # A dry run executes nothing: context it lacks is a placeholder, not an error.
    report = check_loop(path, context=context, context_required=not dry)
    if not report.ok or report.spec is None:
        raise _LoopFileError(report.problems)
    spec = report.spec
    if dry and report.missing_context:
        for name in sorted(report.missing_context):
            context[name] = f"<{name}>"
    missing = [k for k in spec.required_inputs if not str(context.get(k, spec.context.get(
        k, "")) or "")]
    if missing and dry:
        context.update({k: f"<{k}>" for k in missing})
    elif missing:
        raise ConfigError(f"{path}: loop '{spec.name}' requires input '{missing[0]}' "
                          f"(required_inputs): pass --context {missing[0]}=VALUE")
    warnings = [f"warning: {p}" for p in report.warnings if not (
        dry and "is not defined (pass --context" in p.message)]
    if warn is not None:
        for line in warnings:
            warn(line)
    commands: dict[str, Any] = {}
    if prompt_command is not None:
        commands["prompt_command"] = tuple(prompt_command)
    if mcp_command is not None:
        commands["mcp_command"] = tuple(mcp_command)
    agent = LoopAgent(spec, context=dict(context), judge=judge, scenario=scenario, ask=ask,
                      on_line=on_line, on_output=on_output, warnings=warnings, cwd=cwd,
                      **commands)
    info = RunInfo(name=spec.name, subject_id=f"loop:{spec.name}",
                   inputs={"loop": str(path), "context": dict(context)})
    limits = spec.limits()
    if limits.timeout is None:
        # The file set no timeout: the kernel's default backstop applies.
        limits = Limits(max_steps=limits.max_steps, tool_timeout=None)
    return agent, info, limits


# ------------------------------------------------------------------ specs


@dataclass(frozen=True, slots=True)
class BuiltAgent:
    """An agent built from a spec, with the run description and bounds to run it under.

    Attributes:
        agent: The agent (give it to `Kernel.run`).
        info: The run's `RunInfo`: the spec's own for a `RunSpec` (its run id
            kept), otherwise a new one naming what runs.
        limits: The spec's `Limits` for a `RunSpec`; a loop file's own bounds
            for a `LoopSpec`; None otherwise (the caller's choice).
    """

    agent: Agent
    info: RunInfo
    limits: Limits | None = None


def agent_from_spec(spec: RunSpec | CommandSpec | LoopSpec | AgentSpec, *,
                    on_output: Callable[[str, bytes], Awaitable[None] | None] | None = None,
                    warn: Callable[[str], None] | None = None,
                    judge: VerdictSource | None = None,
                    inherit_stdin: bool = False,
                    cwd: str | None = None, ask: Asker | None = None) -> BuiltAgent:
    """Build the agent a spec describes.

    Args:
        spec: A whole `RunSpec` (a stored one, to resume it), or what to run.
        on_output: Called with ("stdout" | "stderr", bytes) for every chunk a
            command or a loop action prints, untouched (a terminal echo).
        warn: Called with each one-line warning about a loop file.
        judge: Where a loop's `llm_structured` verdicts come from (default:
            `adapters.llm.llm_judge` with the spec's model, base URL and key
            variable).
        inherit_stdin: A command reads this process's stdin (as under `timeout(1)`).
        cwd: The working directory processes run in (default: the spec's
            `cwd` for a `RunSpec`, else the current one). The current
            directory of this process is never changed.
        ask: How a loop's dry run without a scenario asks for each result.

    Raises:
        ConfigError: One line naming what is wrong (a missing loop file, an
            option a kind does not take, an unset key variable, ...).
    """
    if isinstance(spec, RunSpec):
        built = agent_from_spec(spec.agent, on_output=on_output, warn=warn, judge=judge,
                                inherit_stdin=inherit_stdin, cwd=cwd or spec.cwd, ask=ask)
        return BuiltAgent(built.agent, spec.info, spec.limits)
    if cwd is not None and not os.path.isdir(cwd):
        raise ConfigError(f"the run's working directory is gone: {cwd}")
    if isinstance(spec, AgentSpec):
        agent, info = build_agent(
            spec.agent, model=spec.model, base_url=spec.base_url, prompt=spec.prompt,
            cmd=spec.cmd, api_key_env=spec.api_key_env, allow_shell=spec.allow_shell,
            context=dict(spec.context), target=spec.target, max_turns=spec.max_turns,
            cwd=cwd, price=spec.price)
        return BuiltAgent(agent, info)
    if isinstance(spec, LoopSpec):
        path = spec.path
        if not Path(path).exists():  # the loader refuses FIFOs, devices, directories
            raise ConfigError(f"loop file not found: {path}")
        if judge is None:
            from adapters.llm import llm_judge

            judge = llm_judge(model=spec.model, base_url=spec.base_url,
                              api_key_env=spec.api_key_env,
                              price=_price(spec.price) if spec.price is not None else None)
        agent, info, limits = build_loop(path, spec.context, scenario=spec.scenario,
                                         judge=judge, warn=warn, on_output=on_output, cwd=cwd,
                                         ask=ask)
        return BuiltAgent(agent, info, limits)
    from adapters.shell import ShellAgent

    argv = list(spec.argv)
    ctx = dict(spec.context)
    env = {f"KERNEL_CTX_{k.upper().replace('-', '_').replace('.', '_')}": v
           for k, v in ctx.items()}
    shell = ShellAgent(argv, env=env or None, on_output=on_output, cwd=cwd,
                       inherit_stdin=inherit_stdin)
    info = RunInfo(name=shlex.join(argv)[:200], subject_id=os.path.basename(argv[0]),
                   inputs={"argv": argv, "context": ctx})
    return BuiltAgent(shell, info)


def stop_leftover_group(record: Mapping[str, Any], *, wait: float = 10.0) -> int:
    """Stop what is left of a process group a run recorded starting; returns how many pids.

    `record` is a `process_start` event's payload (what an interrupted run's
    audit holds). The group counts only if it is provably the recorded one
    (same host, boot and leader start time), so a reused pid is never
    signalled. Waits up to `wait` seconds for the group to be gone, so a
    resumed state never runs beside its orphan. `batteries.runner.Recovery`
    takes this as its `stop_group`.
    """
    from adapters._proc import live_group, stop_recorded

    stopped = stop_recorded(record)
    if stopped:
        deadline = time.monotonic() + wait
        while live_group(record) and time.monotonic() < deadline:
            time.sleep(0.02)
    return stopped
