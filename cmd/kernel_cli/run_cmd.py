"""`kernel run`: one supervised, audited run of a command, a loop file or an agent."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .dbopt import DB_HELP, store_option

if TYPE_CHECKING:
    from kernel import (
        Agent,
        AgentSpec,
        Checkpoint,
        CommandSpec,
        Limits,
        LoopSpec,
        Result,
        RunInfo,
        RunSpec,
    )


from . import numbers
from .ids import short_id

RUN_HELP = """Run CMD (after --), a LOOP.yaml state machine, or an --agent, under supervision.

\b
  kernel run -- make test             a command; its exit code is kept
  kernel run --timeout 60 -- ./crawl  hard deadline: exit 124 when it passes
  kernel run --json -- echo hi        one JSON result object on stdout
  kernel run loop.yaml -c dir=src     a YAML state-machine loop

\b
Exit codes: the command's own code when it ended by itself (ok/error);
124 timeout, 137 killed by the critic, 130 cancelled (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT),
3 budget_exceeded, 4 max_steps, 5 handoff, 1 error, 2 bad input.
A command that itself exits 3, 4 or 5 looks the same: scripts that must tell
them apart read "status" from --json (error for the command's own code).
Durations are seconds or a number with a unit: 90, 90s, 5m, 2h, 7d, 2w.
The run, its output lines and the critic's decisions are recorded in the
audit database (see `kernel runs`, `kernel show RUN_ID`).
"""


REDACT_HELP = ("Also redact what this regular expression matches from everything stored "
               "(repeatable; $KERNEL_REDACT adds one per line). Token shapes and secret-named "
               "--context keys and env vars are redacted anyway.")


#: `kernel run --help` groups its options under these titles (`app._format_panels`).
_LIMITS = "Limits"
_CRITIC = "Critic (supervision)"
_CONTEXT = "Context and input"
_AGENTS = "Agents (--agent)"
_DRY = "Dry run"
_OUTPUT = "Output and delivery"
_STORAGE = "Audit and storage"


def register(app: typer.Typer) -> None:
    """Add `kernel run` to the app."""
    app.command("run", help=RUN_HELP)(run)


def run(
    args: list[str] | None = typer.Argument(
        None, metavar="[-- CMD [ARGS...] | LOOP.yaml]", show_default=False,
        help="The command to run (after --), or a loop file."),
    timeout: float | None = typer.Option(
        None, "--timeout", metavar="DURATION", parser=numbers.duration(), show_default=False,
        help="Hard deadline (the backstop): 90, 90s, 5m, 2h, 7d; 0 = none. Expiry exits 124. "
             "[default: 3600, or the loop file's timeout]",
        rich_help_panel=_LIMITS),
    soft_timeout: float | None = typer.Option(
        None, "--soft-timeout", metavar="DURATION", parser=numbers.duration(),
        show_default=False,
        help="When the critic judges progress; a progressing run's deadline is extended "
             "by as much again (up to 24 times, never past --timeout). 0 = never. "
             "[default: 600]",
        rich_help_panel=_CRITIC),
    idle_timeout: float | None = typer.Option(
        None, "--idle-timeout", metavar="DURATION", parser=numbers.duration(),
        show_default=False,
        help="Time without progress before the critic nudges, then kills the run as "
             "stalled (exit 137) after a grace of a quarter of this, at most 60 s. Progress: "
             "a step, a tool call, an output line not seen recently (a spinner or the same "
             "line again is not), or a process tree using CPU or doing I/O (a busy but "
             "silent build is working). A flat tree blocked reading its terminal is killed "
             "as waiting_input. 0 = off. [default: 300]",
        rich_help_panel=_CRITIC),
    model_timeout: float | None = typer.Option(
        None, "--model-timeout", metavar="DURATION", parser=numbers.duration(),
        show_default=False,
        help="How long a model request in flight (no reply, no streamed token) keeps a run "
             "alive instead of --idle-timeout; past it the run is killed as model_timeout. "
             "0 = no bound of its own. [default: 300, like the coding CLIs' stream idle "
             "timeouts]",
        rich_help_panel=_CRITIC),
    tool_timeout: float | None = typer.Option(
        None, "--tool-timeout", metavar="DURATION", parser=numbers.duration(),
        show_default=False,
        help="Per tool call (an llm agent's tools): the call returns an error after it; the "
             "critic waits that long for a call in flight instead of --idle-timeout. "
             "0 = no bound. [default: 300]",
        rich_help_panel=_CRITIC),
    no_critic: bool = typer.Option(
        False, "--no-critic", help="Run without the critic: only --timeout ends a stuck run.",
        rich_help_panel=_CRITIC),
    max_steps: int | None = typer.Option(
        None, "--max-steps", metavar="N", parser=numbers.count(), show_default=False,
        help="Step ceiling (the critic may raise it for a progressing run). Exit 4. "
             "[default: 100, or the loop file's max_iterations]",
        rich_help_panel=_LIMITS),
    context: list[str] | None = typer.Option(
        None, "--context", "-c", metavar="KEY=VALUE",
        help="A context variable (repeatable). Commands see it as $KERNEL_CTX_KEY.",
        rich_help_panel=_CONTEXT),
    caller: str | None = typer.Option(
        None, "--caller", metavar="ID",
        help="Who is running this (budgets are per caller). Default: $KERNEL_CALLER or $USER.",
        rich_help_panel=_CONTEXT),
    name: str | None = typer.Option(None, "--name", metavar="LABEL", help="A label for the run.",
        rich_help_panel=_CONTEXT),
    db: str | None = typer.Option(
        None, "--db", metavar="PATH", help=DB_HELP,
        rich_help_panel=_STORAGE),
    shared_store: str | None = store_option(_STORAGE),
    no_audit: bool = typer.Option(False, "--no-audit", help="Record nothing.",
        rich_help_panel=_STORAGE),
    checkpoint_interval: float = typer.Option(
        0.0, "--checkpoint-interval", metavar="DURATION", parser=numbers.duration(),
        help="Save a loop's or agent's resumable state at most this often, for `kernel "
             "recover` (default 0: after every loop state and every LLM turn, so a crash "
             "re-runs at most the state in flight).",
        rich_help_panel=_STORAGE),
    deliver_dir: str | None = typer.Option(
        None, "--deliver-dir", metavar="DIR",
        help="Also write the result to DIR/RUN_ID/ (result.json, output.txt, artifacts/).",
        rich_help_panel=_OUTPUT),
    webhook: list[str] | None = typer.Option(
        None, "--webhook", metavar="URL",
        help="Also POST the result as JSON to URL (retried; repeatable). A failed "
             "delivery is a warning and never changes the exit code.",
        rich_help_panel=_OUTPUT),
    otlp: str | None = typer.Option(
        None, "--otlp", metavar="URL",
        help="Also send the run as OpenTelemetry spans (GenAI conventions) to the "
             "OTLP/HTTP collector at URL (default: $OTEL_EXPORTER_OTLP_ENDPOINT; needs the "
             "otel extra).",
        rich_help_panel=_OUTPUT),
    json_out: bool = typer.Option(
        False, "--json", help="Print the final result as one JSON document (one line) on "
                              "stdout (the command's output is not echoed).",
        rich_help_panel=_OUTPUT),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print nothing on stdout (the output is still audited; "
                                     "the summary line still goes to stderr).",
        rich_help_panel=_OUTPUT),
    dry_run: bool = typer.Option(False, "--dry-run", help="Simulate: execute nothing.",
        rich_help_panel=_DRY),
    scenario: str | None = typer.Option(
        None, "--scenario", metavar="NAME",
        help="Dry-run results for a loop: all-pass|all-fail|all-error|"
             "first-fail|alternating. Implies --dry-run.",
        rich_help_panel=_DRY),
    agent: str | None = typer.Option(
        None, "--agent", metavar="KIND",
        help="Run an agent instead: llm | agentcli | pane, or a coding-agent CLI run "
             "non-interactively with its stream format: claude | codex | gemini.",
        rich_help_panel=_AGENTS),
    target: str | None = typer.Option(
        None, "--target", metavar="PANE",
        help="The tmux pane an --agent pane lives in (session[:window[.pane]]); "
             "$KERNEL_TMUX_SOCKET picks the tmux server.",
        rich_help_panel=_AGENTS),
    model: str | None = typer.Option(
        None, "--model", metavar="NAME",
        help="Model name (--agent llm, claude, codex, gemini; for a loop, the "
             "model its llm_structured evaluations ask unless the file sets "
             "llm.model).",
        rich_help_panel=_AGENTS),
    max_turns: int | None = typer.Option(
        None, "--max-turns", metavar="N", parser=numbers.count(minimum=1), show_default=False,
        help="The agent's own turn limit (--agent claude).",
        rich_help_panel=_AGENTS),
    base_url: str | None = typer.Option(
        None, "--base-url", metavar="URL",
        help="OpenAI-compatible API base URL (--agent llm and loop "
             "llm_structured evaluations; default $OPENAI_BASE_URL).",
        rich_help_panel=_AGENTS),
    prompt: str | None = typer.Option(
        None, "--prompt", metavar="TASK",
        help="The task (--agent llm|agentcli|pane|claude|codex|gemini; a "
             "pane gets it typed).",
        rich_help_panel=_AGENTS),
    cmd: str | None = typer.Option(
        None, "--cmd", metavar="COMMAND", help="The agent's command line (--agent agentcli).",
        rich_help_panel=_AGENTS),
    api_key_env: str | None = typer.Option(
        None, "--api-key-env", metavar="VAR", help="Env var holding the API key "
                                                    "(default OPENAI_API_KEY).",
        rich_help_panel=_AGENTS),
    allow_shell: bool = typer.Option(
        False, "--allow-shell", help="Give an llm agent the shell tool (off by default).",
        rich_help_panel=_AGENTS),
    redact: list[str] | None = typer.Option(
        None, "--redact", metavar="REGEX", help=REDACT_HELP,
        rich_help_panel=_STORAGE),
) -> None:
    """Run one thing, supervised and audited, and exit with its status's code."""
    from kernel import ConfigError, Limits, PortSpec, RunSpec

    # A scenario only decides simulated verdicts: it never runs a loop for real.
    dry_run = dry_run or scenario is not None
    try:
        ctx_vars = parse_context(context or [])
        redactor = make_redactor(ctx_vars, redact or [])
        spec = agent_spec(args or [], ctx_vars, agent=agent, model=model, base_url=base_url,
                          prompt=prompt, cmd=cmd, api_key_env=api_key_env,
                          allow_shell=allow_shell, scenario=scenario, target=target,
                          max_turns=max_turns)
        plan = plan_from_spec(spec, quiet=quiet or json_out)
    except ConfigError as exc:
        _fail(str(exc))
    info = plan.info
    if name:
        info.name = name
    info.caller_id = caller or os.environ.get("KERNEL_CALLER") or os.environ.get("USER", "")
    base = plan.limits or Limits()
    try:
        limits = Limits(
            max_steps=base.max_steps if max_steps is None else max_steps,
            timeout=base.timeout if timeout is None else (timeout or None),
            soft_timeout=(soft_timeout or None) if soft_timeout is not None
            else base.soft_timeout,
            tool_timeout=base.tool_timeout if tool_timeout is None else (tool_timeout or None),
            dry_run=dry_run,
            # A save is one small journal transaction (well under a millisecond).
            checkpoint_every_seconds=max(base.checkpoint_every_seconds, checkpoint_interval),
            # A terminal user waits on kills: look at the critic four times a second.
            poll_interval=min(base.poll_interval, 0.25))
    except ConfigError as exc:
        _fail(str(exc).replace("Limits.", "--").replace("_", "-").replace(" or None", ""))
    for url in webhook or []:
        if not url.startswith(("http://", "https://")):
            _fail(f"--webhook expects an http(s):// URL, got {url!r}")
    if otlp:
        from batteries.otel import traces_url

        try:
            traces_url(otlp)
        except ConfigError as exc:
            _fail(f"--otlp: {exc}")
    opts = PortSpec(db=db, no_audit=no_audit, no_critic=no_critic,
                    soft_timeout=soft_timeout, idle_timeout=idle_timeout,
                    model_timeout=model_timeout, tool_timeout=tool_timeout,
                    deliver_dir=deliver_dir, webhooks=tuple(webhook or ()), otlp=otlp)
    import trio

    run_spec = RunSpec(agent=spec, info=info, limits=limits, ports=opts, cwd=os.getcwd())
    journals: list[Any] = []
    try:
        result = trio.run(partial(_execute, run_spec, plan.agent, redactor=redactor,
                                  journals=journals))
    except ConfigError as exc:
        _fail(str(exc))
    code = exit_code(result, command=plan.is_command)
    # A dry run echoes nothing as it goes: its output (the path it would take) is the answer.
    _report(result, code, json_out=json_out,
            echo_output=not quiet and (not plan.echoes or dry_run), storage=_storage(journals),
            command=plan.is_command)
    raise typer.Exit(code)


# ----------------------------------------------------------------- secrets


def make_redactor(context: dict[str, str], patterns: list[str]) -> Any:
    """The run's redactor: shapes, secret env vars and context keys, --redact, $KERNEL_REDACT.

    Raises:
        ConfigError: A pattern is not a valid regular expression.
    """
    from batteries.redact import Redactor

    return Redactor.from_env(context=context, patterns=patterns)


# ----------------------------------------------------------------- planning


@dataclass
class Plan:
    """What `kernel run` will run."""

    agent: Any
    info: RunInfo
    is_command: bool = False
    limits: Limits | None = None
    echoes: bool = False  # output lines are echoed live, so the final output is not repeated
    extra: dict[str, Any] = field(default_factory=dict)


def parse_context(pairs: list[str]) -> dict[str, str]:
    """Parse repeated KEY=VALUE options; a malformed one is a ConfigError."""
    from kernel import ConfigError

    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--context expects KEY=VALUE, got {pair!r}")
        if not (key.replace("_", "a").replace("-", "a").replace(".", "a").isalnum()):
            raise ConfigError(f"--context key {key!r} may hold only letters, digits, _ - .")
        out[key] = value
    return out


def agent_spec(args: list[str], ctx_vars: dict[str, str], *, agent: str | None,
               model: str | None, base_url: str | None, prompt: str | None, cmd: str | None,
               api_key_env: str | None, allow_shell: bool, scenario: str | None,
               target: str | None = None, max_turns: int | None = None,
               ) -> CommandSpec | LoopSpec | AgentSpec:
    """What to run, from the options (kept in the run spec, for `kernel resume`)."""
    from kernel import AgentSpec, CommandSpec, ConfigError, LoopSpec

    if agent is not None:
        if args:
            raise ConfigError("--agent takes no command or loop file; use --prompt/--cmd")
        return AgentSpec(agent=agent, model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                         api_key_env=api_key_env, allow_shell=allow_shell, context=ctx_vars,
                         target=target, max_turns=max_turns)
    if target is not None:
        raise ConfigError("--target is for --agent pane")
    if max_turns is not None:
        raise ConfigError("--max-turns is for --agent claude")
    if not args:
        raise ConfigError("nothing to run: give -- CMD [ARGS...], a LOOP.yaml, or --agent KIND")
    if len(args) == 1 and args[0].endswith((".yaml", ".yml")):
        path = args[0]
        if not Path(path).exists():  # the loader refuses FIFOs, devices, directories
            raise ConfigError(f"loop file not found: {path}")
        return LoopSpec(path=str(Path(path).resolve()), context=ctx_vars, scenario=scenario,
                        model=model, base_url=base_url, api_key_env=api_key_env)
    if scenario is not None:
        raise ConfigError("--scenario applies to loop files only")
    return CommandSpec(argv=tuple(args), context=ctx_vars)


def plan_from_spec(spec: RunSpec | CommandSpec | LoopSpec | AgentSpec, *, quiet: bool) -> Plan:
    """Build the agent a spec describes (`adapters.agent_from_spec`; ConfigError if wrong).

    The CLI's terminal I/O goes in here: output echoed byte-exact unless
    `quiet`, loop-file warnings on stderr, a command reading our stdin (as
    under `timeout(1)`), a loop's dry run asking on the terminal.
    """
    from adapters import agent_from_spec
    from kernel import CommandSpec, LoopSpec, RunSpec

    what = spec.agent if isinstance(spec, RunSpec) else spec
    # A dry run without --scenario asks on the terminal, when there is one.
    ask: Any = None
    if sys.stdin is not None and sys.stdin.isatty():
        from .loops import ask_on_terminal

        ask = ask_on_terminal
    built = agent_from_spec(spec, on_output=None if quiet else _echo, warn=_stderr,
                            inherit_stdin=True, ask=ask)
    return Plan(built.agent, built.info, is_command=isinstance(what, CommandSpec),
                limits=built.limits,
                echoes=not quiet and isinstance(what, (CommandSpec, LoopSpec)))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


_DECODERS: dict[str, codecs.IncrementalDecoder] = {}
_ECHO_GONE: set[str] = set()


def _echo(stream: str, chunk: bytes) -> None:
    """Echo a command's output as it came: the bytes, untouched, whatever the line length.

    A reader that went away (a closed terminal, `| head`) ends the echo of that
    stream, not the run: the audit still gets every line.
    """
    if stream in _ECHO_GONE:
        return
    try:
        _write(stream, chunk)
    except (OSError, ValueError):
        _ECHO_GONE.add(stream)


def _write(stream: str, chunk: bytes) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    raw = None if hasattr(out, "rich_proxied_file") else getattr(out, "buffer", None)
    if raw is None:
        # The live progress display stands in for the terminal and takes text only.
        decoder = _DECODERS.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        out.write(decoder.decode(chunk))
        return
    out.flush()  # whatever was written as text before goes first
    raw.write(chunk)
    if out.isatty():
        raw.flush()


# ---------------------------------------------------------------- execution


def _storage(journals: list[Any]) -> dict[str, Any] | None:
    """What the run's journal transactions cost (wait for the write lock, longest one), and
    how many of them the flush timer started (a run outliving `flush_interval`)."""
    if not journals:
        return None
    return {**journals[0].store.stats.as_dict(), "timed_flushes": journals[0].timed_flushes}


def _cancelling(sig: signal.Signals) -> None:
    with contextlib.suppress(OSError, ValueError):  # the terminal may be gone
        print(f"kernel: {sig.name}: cancelling the run", file=sys.stderr)


async def _execute(spec: RunSpec, agent: Agent, *, resume: Checkpoint | None = None,
                   redactor: Any = None, journals: list[Any] | None = None) -> Result:
    """`batteries.runner.run_spec` under the CLI's signal policy, with live progress."""
    import trio

    from batteries.runner import SignalPolicy, run_spec

    from . import progress

    # No live line for dry runs: a loop simulation may ask questions on the terminal.
    live = (progress.Progress(spec.info.name, spec.limits.timeout)
            if progress.wanted() and not spec.limits.dry_run else None)
    async with trio.open_nursery() as nursery:
        if live is not None:
            nursery.start_soon(progress.show, live)
        result = await run_spec(
            spec, agent, resume=resume, signals=SignalPolicy(on_signal=_cancelling),
            redactor=redactor, journals=journals,
            wrap_audit=None if live is None else partial(progress.ProgressAudit, progress=live))
        nursery.cancel_scope.cancel()
    return result


def exit_code(result: Result, *, command: bool) -> int:
    """The process exit code for a result (DESIGN.md "The run")."""
    from kernel import Status

    if (command and result.status in (Status.OK, Status.ERROR)
            and result.exit_code is not None):
        return result.exit_code
    return result.status.exit_code


def _report(result: Result, code: int, *, json_out: bool, echo_output: bool,
            storage: dict[str, Any] | None = None, command: bool = False) -> None:
    from kernel import Status

    for failure in result.port_failures:
        print(f"kernel: warning: {failure}", file=sys.stderr)
    if json_out:
        doc = result.to_dict()
        doc["short_id"] = short_id(result.run_id)
        doc["command_exit_code"] = result.exit_code
        doc["exit_code"] = code
        if storage is not None:
            doc["storage"] = storage
        sys.stdout.write(json.dumps(doc, default=str) + "\n")
        return
    if echo_output and result.output is not None and result.status is not Status.ERROR:
        text = result.output if isinstance(result.output, str) else json.dumps(
            result.output, default=str)
        if text:
            sys.stdout.write(text.rstrip("\n") + "\n")
    # Always, terminal or not: the short id is how a person finds the run again.
    why = result.error or result.reason
    steps = f"{result.steps} step(s)"
    if command and result.steps == 0 and result.status in (
            Status.TIMEOUT, Status.KILLED, Status.CANCELLED):
        steps = "1 step (stopped)"  # a command is one step: it ran, and was stopped
    print(f"kernel: run {short_id(result.run_id)} {result.status} after "
          f"{result.runtime_seconds:.1f}s, {steps}"
          + (f": {why}" if why and why != str(result.status) else "")
          + f" (exit {code})", file=sys.stderr)


def _fail(message: str) -> None:
    print(f"kernel run: error: {message}", file=sys.stderr)
    raise typer.Exit(2)
