"""`kernel run --agent KIND`: build the agent adapter the options describe.

Adapters are imported inside `build_agent`, so `kernel --help` never loads
them (nor httpx behind the LLM adapter). Every problem with the options is
a `ConfigError` with a one-line message, which the CLI prints and exits 2.

`${context.KEY}` in `--prompt` (and in each `--cmd` argument) is replaced by
the `--context KEY=VALUE` value; `$${` writes a literal `${`. Arguments of
`--cmd` are split first and interpolated after, so a value never becomes
more than the one argument it lands in.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from urllib.parse import urlsplit

from kernel import Agent, ConfigError, RunInfo

KINDS = ("llm", "agentcli", "pane", "claude", "codex", "gemini")
PRESETS = ("claude", "codex", "gemini")

_CONTEXT_REF = re.compile(r"\$\$\{|\$\{context\.([A-Za-z0-9_.-]+)\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_agent(kind: str, *, model: str | None, base_url: str | None, prompt: str | None,
                cmd: str | None, api_key_env: str | None, allow_shell: bool,
                context: dict[str, str], target: str | None = None,
                max_turns: int | None = None) -> tuple[Agent, RunInfo]:
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

    Raises:
        ConfigError: An unknown kind, a missing or inapplicable option, a
            malformed URL or command line, an unset key variable, an unknown
            `${context.KEY}`, or an agent command that is not found.
    """
    name = kind.strip().lower()
    if name != "pane" and target is not None:
        raise ConfigError("--target is for --agent pane")
    if name not in PRESETS and max_turns is not None:
        raise ConfigError("--max-turns is for --agent claude")
    if name in PRESETS:
        return _build_preset(name, model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                             api_key_env=api_key_env, allow_shell=allow_shell,
                             context=context, max_turns=max_turns)
    if name == "pane":
        return _build_pane(target=target, prompt=prompt, context=context,
                           others={"--model": model, "--base-url": base_url, "--cmd": cmd,
                                   "--api-key-env": api_key_env})
    if name == "llm":
        return _build_llm(model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                          api_key_env=api_key_env, allow_shell=allow_shell, context=context)
    if name == "agentcli":
        return _build_agentcli(model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                               api_key_env=api_key_env, allow_shell=allow_shell,
                               context=context)
    raise ConfigError(f"unknown agent kind {kind!r} (choose one of: {', '.join(KINDS)})")


def _build_pane(*, target: str | None, prompt: str | None, context: dict[str, str],
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


def interpolate(text: str, context: dict[str, str], *, where: str) -> str:
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
               context: dict[str, str]) -> tuple[Agent, RunInfo]:
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
    if not has_key and (urlsplit(url).hostname or "").endswith("api.openai.com"):
        raise ConfigError(f"{key_var} is not set ({redact_url(url)} needs an API key; "
                          "for a local server give --base-url)")
    try:
        client = ChatClient(url, api_key_env=key_var)
    except ValueError as exc:
        source = "--base-url" if base_url else "$OPENAI_BASE_URL"
        raise ConfigError(f"{source}: {exc}") from None
    agent = LLMAgent(model.strip(), text, client=client, allow_shell=allow_shell)
    info = RunInfo(
        name=f"llm {model.strip()}", subject_id=f"llm:{model.strip()}",
        inputs={"agent": "llm", "model": model.strip(), "base_url": redact_url(url),
                "prompt": text, "tools": list(agent.tools), "context": dict(context)})
    return agent, info


def _build_agentcli(*, model: str | None, base_url: str | None, prompt: str | None,
                    cmd: str | None, api_key_env: str | None, allow_shell: bool,
                    context: dict[str, str]) -> tuple[Agent, RunInfo]:
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
    found = (os.access(exe, os.X_OK) and not os.path.isdir(exe)) if os.sep in exe \
        else shutil.which(exe) is not None
    if not found:
        raise ConfigError(f"--cmd: command not found or not executable: {exe}")
    env = {f"KERNEL_CTX_{k.upper().replace('-', '_').replace('.', '_')}": v
           for k, v in context.items()}
    agent = CLIAgent(argv, env=env or None)
    info = RunInfo(
        name=shlex.join(argv)[:200], subject_id=f"agentcli:{os.path.basename(exe)}",
        inputs={"agent": "agentcli", "argv": argv, "prompt": prompt, "context": dict(context)})
    return agent, info


def _build_preset(client: str, *, model: str | None, base_url: str | None,
                  prompt: str | None, cmd: str | None, api_key_env: str | None,
                  allow_shell: bool, context: dict[str, str],
                  max_turns: int | None) -> tuple[Agent, RunInfo]:
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
    cwd = os.getcwd()
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
