"""`kernel run`: one supervised, audited run of a command, a loop file or an agent."""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import os
import select
import shlex
import signal
import stat
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .dbopt import DB_HELP, store_option

if TYPE_CHECKING:
    from typer._click.core import Context as ClickContext  # typer's own click

    from kernel import (
        Agent,
        AgentSpec,
        Audit,
        Checkpoint,
        CommandSpec,
        Limits,
        LoopSpec,
        Result,
        RunInfo,
        RunRecorder,
        RunSpec,
        RunStats,
        Step,
        ToolResult,
    )


from . import numbers, output
from .ids import short_id

RUN_HELP = """Run CMD (after --), a LOOP.yaml state machine, or an --agent, under supervision.

\b
  kernel run -- make test             a command; its exit code is kept
  kernel run --timeout 60 -- ./crawl  hard deadline: exit 124 when it passes
  kernel run --json -- echo hi        one JSON result object on stdout
  kernel run loop.yaml -c dir=src     a YAML state-machine loop

\b
Everything after -- is the command, even a name ending .yaml; one argument
ending .yaml or .yml (in any case) before it is a loop file.

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


#: `ctx.meta` key: the arguments that followed `--` (always a command, never a loop file).
_AFTER_DASHES = "kernel.run.after_dashes"


class _RunCommand(typer.core.TyperCommand):
    """`kernel run`: notes what followed `--`, which click consumes without a trace."""

    def parse_args(self, ctx: ClickContext, args: list[str]) -> list[str]:
        if "--" in args:
            ctx.meta[_AFTER_DASHES] = args[args.index("--") + 1:]
        return super().parse_args(ctx, args)


def register(app: typer.Typer) -> None:
    """Add `kernel run` to the app."""
    app.command("run", help=RUN_HELP, cls=_RunCommand)(run)


def _after_dashes(ctx: typer.Context, args: list[str]) -> bool:
    """True when `args` are exactly what followed `--` (so: a command, whatever its name)."""
    return bool(args) and ctx.meta.get(_AFTER_DASHES) == args


def run(
    ctx: typer.Context,
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
        help="Per tool call (an llm agent's tools): the call returns an error after it and "
             "the run goes on; the critic waits that long plus a grace (a tenth, 5-60 s) for "
             "a call in flight instead of --idle-timeout. 0 = no bound. [default: 300]",
        rich_help_panel=_CRITIC),
    no_critic: bool = typer.Option(
        False, "--no-critic", help="Run without the critic: only --timeout ends a stuck run.",
        rich_help_panel=_CRITIC),
    max_steps: int | None = typer.Option(
        None, "--max-steps", metavar="N", parser=numbers.count(), show_default=False,
        help="Step ceiling (the critic may raise it for a progressing run, but not a "
             "loop's: its max_iterations holds). Exit 4. "
             "[default: 100, or the loop file's max_iterations]",
        rich_help_panel=_LIMITS),
    context: list[str] | None = typer.Option(
        None, "--context", "-c", metavar="KEY=VALUE",
        help="A context variable (repeatable). Commands see it as $KERNEL_CTX_KEY; a loop "
             "reads ${context.KEY} (a dotted KEY sets a field: cfg.depth=9), and warns of "
             "a KEY it never reads.",
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
                              "stdout, and nothing else there: what the command (a loop's "
                              "actions) writes on stdout is not echoed (it is the result's "
                              "output, and audited); what it writes on stderr still passes "
                              "through to stderr. No summary line.",
        rich_help_panel=_OUTPUT),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print nothing on stdout: what the command (a loop's "
                                     "actions) writes on stdout is not echoed (it is still "
                                     "audited), nor is the final output printed; what it "
                                     "writes on stderr still passes through to stderr, and "
                                     "the summary line follows it there.",
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
    price_text: str | None = typer.Option(
        None, "--price", metavar="IN,OUT", show_default=False,
        help="What the model costs, in US dollars per million input,output tokens "
             "(--agent llm and a loop's llm_structured evaluations): the run's cost, "
             "which cost budgets bound. Without it a call costs what the server reports "
             "(usage.cost), else 0, and a caller with a cost budget is refused.",
        rich_help_panel=_AGENTS),
    redact: list[str] | None = typer.Option(
        None, "--redact", metavar="REGEX", help=REDACT_HELP,
        rich_help_panel=_STORAGE),
) -> None:
    """Run one thing, supervised and audited, and exit with its status's code."""
    from adapters.specs import spec_secrets
    from kernel import ConfigError, Limits, PortSpec, RunSpec

    # A scenario only decides simulated verdicts: it never runs a loop for real.
    dry_run = dry_run or scenario is not None
    try:  # parsed here: a `parser=` of a tuple would cost typer's pydantic at start-up
        price = None if price_text is None else numbers.parse_price(price_text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--price'") from None
    try:
        ctx_vars = parse_context(context or [])
        redactor = make_redactor(ctx_vars, redact or [])
        spec = agent_spec(args or [], ctx_vars, agent=agent, model=model, base_url=base_url,
                          prompt=prompt, cmd=cmd, api_key_env=api_key_env,
                          allow_shell=allow_shell, scenario=scenario, target=target,
                          max_turns=max_turns, price=price,
                          command=_after_dashes(ctx, list(args or [])))
        # The agent's API key, whatever its variable is called (`--api-key-env MY_CRED`
        # does not look secret to the redactor): never stored, even if a server echoes it.
        redactor = redactor.with_secrets(spec_secrets(spec))
        plan = plan_from_spec(spec, quiet=quiet or json_out, echo_stderr=True)
    except ConfigError as exc:
        _fail(str(exc))
    info = plan.info
    if name:
        info.name = name
    info.caller_id = caller or os.environ.get("KERNEL_CALLER") or os.environ.get("USER", "")
    if not info.caller_id.isprintable():
        _fail(f"the caller id {info.caller_id!r} holds a control character (a line break?): "
              "give a plain --caller ID")
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
    if webhook or deliver_dir is not None:
        from batteries.delivery import check_delivery_options

        try:  # a typo is bad input before anything runs; the directory is stored absolute
            deliver_dir, _ = check_delivery_options(deliver_dir, webhook or ())
        except ConfigError as exc:
            _fail(str(exc))
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
    code = _report(result, code, json_out=json_out,
                   echo_output=not quiet and (not plan.echoes or dry_run),
                   storage=_storage(journals), command=plan.is_command,
                   notes=journal_notes(journals))
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
    names: dict[str, str] = {}  # $KERNEL_CTX_... -> the key that makes it
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--context expects KEY=VALUE, got {pair!r}")
        if not (key.replace("_", "a").replace("-", "a").replace(".", "a").isalnum()):
            raise ConfigError(f"--context key {key!r} may hold only letters, digits, _ - .")
        # Commands see KEY as $KERNEL_CTX_KEY (adapters.specs): upper case, - and . as _.
        # Two keys that make one variable would leave one value unseen (the audit keeps
        # both), so they are refused; the same key again replaces its value.
        env = "KERNEL_CTX_" + key.upper().replace("-", "_").replace(".", "_")
        other = names.setdefault(env, key)
        if other != key:
            raise ConfigError(f"--context keys {other!r} and {key!r} are both ${env}: "
                              "use one of them")
        out[key] = value
    return out


def agent_spec(args: list[str], ctx_vars: dict[str, str], *, agent: str | None,
               model: str | None, base_url: str | None, prompt: str | None, cmd: str | None,
               api_key_env: str | None, allow_shell: bool, scenario: str | None,
               target: str | None = None, max_turns: int | None = None,
               price: tuple[float, float] | None = None, command: bool = False,
               ) -> CommandSpec | LoopSpec | AgentSpec:
    """What to run, from the options (kept in the run spec, for `kernel resume`).

    `command`: the arguments came after `--`, so they are a command even when the
    first names a `.yaml` file; otherwise one argument ending `.yaml`/`.yml` (in
    any case) is a loop file.
    """
    from kernel import AgentSpec, CommandSpec, ConfigError, LoopSpec

    if agent is not None:
        if args:
            raise ConfigError("--agent takes no command or loop file; use --prompt/--cmd")
        return AgentSpec(agent=agent, model=model, base_url=base_url, prompt=prompt, cmd=cmd,
                         api_key_env=api_key_env, allow_shell=allow_shell, context=ctx_vars,
                         target=target, max_turns=max_turns, price=price)
    if target is not None:
        raise ConfigError("--target is for --agent pane")
    if max_turns is not None:
        raise ConfigError("--max-turns is for --agent claude")
    if not args:
        raise ConfigError("nothing to run: give -- CMD [ARGS...], a LOOP.yaml, or --agent KIND")
    looks_like_loop = not command and args[0].lower().endswith((".yaml", ".yml"))
    if looks_like_loop and len(args) == 1:
        path = args[0]
        if not Path(path).exists():  # the loader refuses FIFOs, devices, directories
            raise ConfigError(f"loop file not found: {path}")
        return LoopSpec(path=str(Path(path).resolve()), context=ctx_vars, scenario=scenario,
                        model=model, base_url=base_url, api_key_env=api_key_env, price=price)
    if (looks_like_loop and Path(args[0]).is_file()
            and not os.access(args[0], os.X_OK)):
        raise ConfigError(f"a loop file runs alone: {args[0]} was given with "
                          f"{shlex.join(args[1:])!r} (context goes in -c KEY=VALUE)")
    if scenario is not None:
        raise ConfigError("--scenario applies to loop files only")
    if price is not None:
        raise ConfigError("--price is for --agent llm and loop files (what their model "
                          "calls cost); a command's cost is not known to the kernel")
    if not args[0]:
        raise ConfigError("the command is empty: give -- CMD [ARGS...]")
    for arg in args:
        if "\0" in arg:
            raise ConfigError(f"the command's arguments cannot hold a NUL byte: {arg!r}")
    return CommandSpec(argv=tuple(args), context=ctx_vars)


def plan_from_spec(spec: RunSpec | CommandSpec | LoopSpec | AgentSpec, *, quiet: bool,
                   echo_stderr: bool = False) -> Plan:
    """Build the agent a spec describes (`adapters.agent_from_spec`; ConfigError if wrong).

    The CLI's terminal I/O goes in here: output echoed byte-exact unless
    `quiet` (with `echo_stderr`, a quiet run still echoes its stderr: `kernel
    run -q/--json`), loop-file warnings on stderr, a command reading our stdin
    (as under `timeout(1)`), a loop's dry run asking on the terminal.
    """
    from adapters import agent_from_spec
    from kernel import CommandSpec, LoopSpec, RunSpec

    what = spec.agent if isinstance(spec, RunSpec) else spec
    # A dry run without --scenario asks on the terminal, when there is one.
    ask: Any = None
    if sys.stdin is not None and sys.stdin.isatty():
        from .loops import ask_on_terminal

        ask = ask_on_terminal
    echo: Callable[[str, bytes], Awaitable[None] | None] | None = _ECHO
    if quiet:
        echo = _ECHO.stderr_only if echo_stderr else None
    if isinstance(what, (CommandSpec, LoopSpec)) and echo is not None:
        # The echo is the command's (a loop action's) own stdout and stderr: a reader
        # that leaves is met by the process itself (`_CommandSink`), as in a shell
        # pipeline; a loop routes the action's status (141, SIGPIPE) as any other.
        echo = _CommandSink(_ECHO, ("stderr",) if quiet else ("stdout", "stderr"))
    built = agent_from_spec(spec, on_output=echo, warn=_say, inherit_stdin=True, ask=ask)
    return Plan(built.agent, built.info, is_command=isinstance(what, CommandSpec),
                limits=built.limits,
                echoes=not quiet and isinstance(what, (CommandSpec, LoopSpec)))


# ------------------------------------------------------------- terminal I/O

#: C0 controls but tab, DEL and C1 controls, as they are shown in a kernel message.
def _say(line: str) -> None:
    """Print one kernel message on stderr, control characters escaped; a stderr that is
    gone (closed, its reader away) loses the message and nothing else."""
    try:
        print(output.visible(line, layout=False), file=sys.stderr)
    except BrokenPipeError:
        _to_devnull("stderr")
    except (OSError, ValueError):
        pass


def _out(text: str) -> None:
    """Write `text` on stdout (the result: --json, a loop's output). A reader that went
    away loses it quietly; any other failed write is said, and counts as lost output
    (`_Echo.lost`: exit 1)."""
    if "stdout" in _ECHO.gone:
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError) as exc:
        _ECHO.failed("stdout", exc, what="the result")


def _to_devnull(name: str) -> None:
    """Point our stdout or stderr (its file descriptor) at /dev/null.

    Its reader is gone: what is still buffered, and anything written later
    (a message, the flush at exit), then goes nowhere instead of failing
    again (Python's advice for BrokenPipeError).
    """
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = getattr(sys, name).fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


class _Echo:
    """A run's output echoed on our stdout and stderr as it came: the bytes, untouched.

    Its reader going away (`| head -1`: EPIPE) sends the stream to /dev/null
    (`_to_devnull`: nothing written later fails again) and then:
    - for a command or a loop's actions (`_CommandSink`, `kernel run -- CMD`,
      `kernel run loop.yaml`), the sink raises BrokenPipeError and `ShellAgent`
      (a loop: `run_process`) closes the process's pipe: it meets the closed
      pipe itself at its next write (SIGPIPE), as in a shell pipeline, and its
      own exit status ends the step (a loop routes it). On a pipe, the reader's
      departure is seen as it happens (`wait_reader_gone`), not only at the
      next chunk;
    - for anything else echoed (`__call__`), `on_closed` is told which stream
      (`_execute` cancels the run).
    Any other failed write (a full disk, a terminal gone) ends the echo of that
    stream only, said in one line (`lost`: a lost stdout makes exit 0 exit 1).
    Either way the audit gets every line. Chunks that could not be echoed at
    once after the run stopped (the stop no longer waits on a slow reader) are
    counted in `unechoed`.
    """

    def __init__(self) -> None:
        self.reset()
        self.on_closed: Callable[[str], None] | None = None

    def reset(self) -> None:
        """Forget a previous run's streams (one process may run several: tests, recover)."""
        for stream, fd in getattr(self, "waits", {}).items():
            # A description of our own (`_nonblocking`), not the stream's own descriptor.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                out = sys.stdout if stream == "stdout" else sys.stderr
                if fd is not None and fd > 2 and fd != out.fileno():
                    os.close(fd)
        self.gone: set[str] = set()  # streams no longer written
        self.left: set[str] = set()  # of those, the ones whose reader went away
        self.lost: dict[str, str] = {}  # the others: why their write failed
        self.unechoed: dict[str, int] = {}  # bytes not echoed after the run stopped
        self.decoders: dict[str, codecs.IncrementalDecoder] = {}
        self.waits: dict[str, int | None] = {}  # stream -> fd a write may block on

    def __call__(self, stream: str, chunk: bytes) -> Awaitable[None] | None:
        return self.echo(stream, chunk, raising=False)

    def echo(self, stream: str, chunk: bytes, *, raising: bool) -> Awaitable[None] | None:
        """Echo `chunk` on `stream`; with `raising`, a reader gone raises BrokenPipeError."""
        if stream in self.gone:
            if raising and stream in self.left:
                raise BrokenPipeError(f"the reader of {stream} went away")
            return None
        fd = self.waits.get(stream, -1)
        if fd == -1:
            fd = self.waits[stream] = _blocking_fd(stream)
        if fd is not None:
            return self.write_waiting(stream, fd, chunk, raising=raising)
        try:
            self.write(stream, chunk)
        except (OSError, ValueError) as exc:
            self.failed(stream, exc, raising=raising)
        return None

    def failed(self, stream: str, exc: Exception, *, raising: bool = False,
               what: str = "the command's output") -> None:
        """A write to `stream` failed with `exc`: stop writing there (see the class)."""
        if stream not in self.gone:
            self.gone.add(stream)
            if isinstance(exc, BrokenPipeError):
                self.left.add(stream)
                _to_devnull(stream)
                if not raising and self.on_closed is not None:
                    self.on_closed(stream)
            else:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                self.lost[stream] = why
                _say(f"kernel: warning: cannot write {what} to {stream} ({why}): "
                     "it is no longer shown there")
        if raising and stream in self.left:
            raise BrokenPipeError(f"the reader of {stream} went away") from exc

    def stderr_only(self, stream: str, chunk: bytes) -> Awaitable[None] | None:
        """Echo the stderr chunks alone (a quiet run: stdout is kept clean)."""
        return self(stream, chunk) if stream == "stderr" else None

    async def wait_reader_gone(self, stream: str) -> None:
        """Return once the reader of `stream` has gone away, if that can be seen: `stream`
        is a pipe (never returns otherwise: a file, a terminal, a socket)."""
        import trio

        fd = _watch_fd(stream)
        if fd is None:
            await trio.sleep_forever()
        if fd is not None and fd >= 0:
            try:
                while not _reader_gone(fd):
                    # A pipe's write end is never readable: the wait ends with EPOLLERR,
                    # when its last reader has closed it.
                    await trio.lowlevel.wait_readable(fd)
                    if not _reader_gone(fd):
                        await trio.sleep(0.05)  # (not expected: never spin)
            finally:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        if stream not in self.gone:
            self.gone.add(stream)
            self.left.add(stream)
            _to_devnull(stream)

    async def write_waiting(self, stream: str, fd: int, chunk: bytes, *,
                            raising: bool = False) -> None:
        """Write `chunk` to a pipe, socket or terminal without blocking the trio thread.

        A reader that stops reading (`kernel run -- yes | sleep 60`, a pager left
        open, a terminal nobody drains) fills the pipe: a blocking write then froze
        the whole run, its deadline, Ctrl-C and the critic with it. `fd` is a
        non-blocking file description of our own on the same pipe or terminal
        (`_nonblocking`: the shared one stays as it is): a write takes what fits,
        the rest waits for room (`wait_writable`, cancellable), and reading the
        command's output waits meanwhile (backpressure), as it would for the
        command itself. A socket (no second description to open) is written
        `PIPE_BUF` bytes at a time once it has room. Cancelled (the run is
        stopping and no longer waits for a slow reader), what did not fit is
        counted in `unechoed`.
        """
        import trio

        out = sys.stdout if stream == "stdout" else sys.stderr
        view = memoryview(chunk)
        socket_like = fd == out.fileno()
        try:
            out.flush()  # whatever was written as text before goes first
            while view:
                if socket_like:
                    if not _writable_now(fd):
                        await trio.lowlevel.wait_writable(fd)
                    view = view[os.write(fd, view[:_PIPE_BUF]):]
                    continue
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(fd)
        except trio.Cancelled:
            self.unechoed[stream] = self.unechoed.get(stream, 0) + len(view)
            raise
        except (OSError, ValueError) as exc:
            self.failed(stream, exc, raising=raising)

    def write(self, stream: str, chunk: bytes) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        raw = None if hasattr(out, "rich_proxied_file") else getattr(out, "buffer", None)
        if raw is None:
            # The live progress display stands in for the terminal and takes text only.
            decoder = self.decoders.setdefault(
                stream, codecs.getincrementaldecoder("utf-8")("replace"))
            out.write(decoder.decode(chunk))
            return
        out.flush()  # whatever was written as text before goes first
        raw.write(chunk)
        # At once, as the command wrote it: a reader sees each chunk when the command
        # let it go, and one that went away is noticed at the next chunk, not at exit.
        raw.flush()


class _CommandSink:
    """`kernel run -- CMD`'s echo of `streams` (a `adapters.shell.WatchedSink`): the
    command's own stdout and stderr, whose reader going away the command meets itself."""

    def __init__(self, echo: _Echo, streams: tuple[str, ...]) -> None:
        self.echo = echo
        self.streams = streams

    def __call__(self, stream: str, chunk: bytes) -> Awaitable[None] | None:
        if stream not in self.streams:
            return None
        return self.echo.echo(stream, chunk, raising=True)

    async def reader_gone(self, stream: str) -> None:
        if stream not in self.streams:
            import trio

            await trio.sleep_forever()
        await self.echo.wait_reader_gone(stream)


def _watch_fd(stream: str) -> int | None:
    """A descriptor of our own to watch our `stream` for its reader leaving: a
    non-blocking write end of the same pipe; -1 if the pipe has no reader already;
    None if `stream` is not a pipe (or cannot be watched)."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    if out is None or hasattr(out, "rich_proxied_file"):
        return None
    try:
        fd = out.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return -1 if exc.errno == errno.ENXIO else None  # (ENXIO: a pipe nobody reads)
    except (ValueError, AttributeError):
        return None


def _reader_gone(fd: int) -> bool:
    """Whether the pipe whose write end `fd` is has no reader left (POLLERR)."""
    poller = select.poll()
    poller.register(fd, 0)  # (errors are always reported)
    return any(events & select.POLLERR for _, events in poller.poll(0))


#: What a pipe with room takes whole without blocking (POSIX: at least 512; Linux 4096).
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)


def _blocking_fd(stream: str) -> int | None:
    """The fd of our `stream` if a write to it can block for as long as a reader wants
    (a pipe, a FIFO, a socket, a terminal), else None (a file, /dev/null, the live
    display, which take writes at once)."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    if hasattr(out, "rich_proxied_file") or getattr(out, "buffer", None) is None:
        return None
    try:
        fd = out.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return fd
    if stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and os.isatty(fd)):
        return _nonblocking(fd)
    return None


def _nonblocking(fd: int) -> int:
    """A non-blocking file description of our own on the pipe or terminal `fd` is; `fd`
    itself if none can be opened (then written `PIPE_BUF` at a time, as a socket).

    O_NONBLOCK on `fd` itself would be set on a description shared with the shell
    and the other programs on the terminal (they would then get EAGAIN). A second
    open of the same pipe (`/proc/self/fd/N`) or terminal (its device) has its own.
    """
    try:
        path = os.ttyname(fd) if os.isatty(fd) else f"/proc/self/fd/{fd}"
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return fd


def _writable_now(fd: int) -> bool:
    """Whether `fd` has room for a write now (no trip through trio's scheduler)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))


_ECHO = _Echo()


# ---------------------------------------------------------------- execution


def _storage(journals: list[Any]) -> dict[str, Any] | None:
    """What the run's journal transactions cost (wait for the write lock, longest one), how
    many of them the flush timer started (a run outliving `flush_interval`), and what the
    journal could not write at exit: `spilled` events kept in the spill file `spill_path`
    (safe: the next writer commits them) and `unwritten` events lost."""
    if not journals:
        return None
    journal = journals[0]
    path = journal.spill_path
    return {**journal.store.stats.as_dict(), "timed_flushes": journal.timed_flushes,
            "spilled": journal.spilled, "spill_path": None if path is None else str(path),
            "unwritten": journal.unwritten, "unwritten_ops": journal.unwritten_ops}


def journal_notes(journals: Sequence[Any]) -> list[str]:
    """A warning line for each journal that kept rows in a spill file as it closed (the
    store locked or unreachable past the lock timeout): where they are and who commits
    them. Said by every command that opens a journal (`run`, `resume`, `recover`,
    `batch`); the journal's own warning goes to the `kernel.journal` logger, which the
    CLI shows only from `KERNEL_LOG_LEVEL=warning` on."""
    lines = []
    for journal in journals:
        path = journal.spill_path
        if path is None:
            continue
        n = journal.spilled
        who = ("the next kernel command on this machine that writes to the store"
               if hasattr(journal.store, "spill_home") else  # PostgreSQL: per machine
               "the next kernel command that writes to the journal")
        # Operations alone (a batch's end, where its deliveries stand) hold no event:
        # "(0 events)" said that nothing was kept.
        what = (f"audit rows not yet written ({n} event{'' if n == 1 else 's'})" if n else
                "journal writes not yet made (no audit event)")
        lines.append(f"kernel: warning: {what} are kept in {path}; {who} commits them")
    return lines


def _cancelling(sig: signal.Signals) -> None:
    _say(f"kernel: {sig.name}: cancelling the run")


async def _execute(spec: RunSpec, agent: Agent, *, resume: Checkpoint | None = None,
                   redactor: Any = None, journals: list[Any] | None = None) -> Result:
    """`batteries.runner.run_spec` under the CLI's signal policy, with live progress.

    The run is cancelled as for Ctrl-C (final: `recover` leaves it alone) when
    a reader of its echoed output goes away (`_Echo`), recorded with that reason.
    """
    import trio

    from batteries.runner import RunControl, SignalPolicy, run_spec
    from kernel import Status

    from . import progress

    # No live line for dry runs: a loop simulation may ask questions on the terminal.
    live = (progress.Progress(spec.info.name, spec.limits.timeout)
            if progress.wanted() and not spec.limits.dry_run else None)
    control = RunControl()
    why = _Reason()

    def output_closed(stream: str) -> None:
        reason = f"output pipe closed ({stream})"
        if not control.cancelled:  # the first cancel says why (a signal may have come first)
            why.reason = reason
        control.cancel(final=True, reason=reason)

    def wrap(audit: Audit | None) -> Audit | None:
        audit = None if audit is None else _ReasonAudit(audit, why)
        return audit if live is None else progress.ProgressAudit(audit, progress=live)

    _ECHO.reset()
    _ECHO.on_closed = output_closed
    try:
        async with trio.open_nursery() as nursery:
            if live is not None:
                nursery.start_soon(progress.show, live)
            result = await run_spec(
                spec, agent, resume=resume, control=control,
                signals=SignalPolicy(on_signal=_cancelling), redactor=redactor,
                journals=journals, wrap_audit=wrap)
            nursery.cancel_scope.cancel()
    finally:
        _ECHO.on_closed = None
    if why.reason is not None and result.status is Status.CANCELLED:
        result.reason = why.reason
    return result


class _Reason:
    """Why `kernel run` itself cancelled a run (None: it did not)."""

    reason: str | None = None


class _ReasonAudit:
    """The audit, with `kernel run`'s own reason for a run it cancelled.

    The kernel records a run cancelled from outside as "cancelled by the
    caller"; when `kernel run` cancelled it (its output pipe closed), the
    run's row and `run_end` say why instead.
    """

    def __init__(self, inner: Audit, why: _Reason) -> None:
        self.inner = inner
        self.why = why

    async def start_run(self, info: RunInfo, *,
                        resumed: bool | None = None) -> RunRecorder | None:
        from kernel import takes_resumed  # kernel.SupportsResumedStart, passed on

        inner: Any = self.inner
        rec = (await inner.start_run(info, resumed=resumed)
               if resumed is not None and takes_resumed(inner) else await inner.start_run(info))
        return None if rec is None else _ReasonRecorder(rec, self.why)


class _ReasonRecorder:
    """A recorder whose `close` carries `_Reason`; every other call is the inner one's own
    (bound here once, so the hot path costs no extra call)."""

    def __init__(self, inner: RunRecorder, why: _Reason) -> None:
        self.inner = inner
        self.why = why
        self.on_step: Callable[[int, Step, float], None] = inner.on_step
        self.on_tool: Callable[[ToolResult, int], None] = inner.on_tool
        self.log_event: Callable[..., None] = inner.log_event
        self.log_error: Callable[..., None] = inner.log_error

    async def close(self, stats: RunStats) -> None:
        from dataclasses import replace

        from kernel import Status

        if self.why.reason is not None and stats.status is Status.CANCELLED:
            stats = replace(stats, reason=self.why.reason)
        await self.inner.close(stats)


def exit_code(result: Result, *, command: bool) -> int:
    """The process exit code for a result (DESIGN.md "The run")."""
    from kernel import Status

    if (command and result.status in (Status.OK, Status.ERROR)
            and result.exit_code is not None):
        return result.exit_code
    return result.status.exit_code


def _lost_output(code: int) -> int:
    """`code`, or 1 if it was 0 and what was meant for our stdout could not be written
    there (a full disk: like any failed write; a reader that went away is no failure)."""
    return 1 if code == 0 and "stdout" in _ECHO.lost else code


def _report(result: Result, code: int, *, json_out: bool, echo_output: bool,
            storage: dict[str, Any] | None = None, command: bool = False,
            notes: Sequence[str] = ()) -> int:
    """Print the result (--json) or the summary line; the exit code, as finally decided.

    `notes` (`journal_notes`) go on stderr after the port failures. Audit events the
    journal lost (`storage["unwritten"]`: not written, nor kept in a spill file) make
    an exit 0 exit 1, as output that could not be written does (the run's status is
    its own); events kept in a spill file change nothing: they are safe.
    """
    from kernel import Status

    for failure in result.port_failures:
        _say(f"kernel: warning: {failure}")
    for note in notes:
        _say(note)
    unwritten = int(storage.get("unwritten") or 0) if storage else 0
    lost_ops = int(storage.get("unwritten_ops") or 0) if storage else 0
    for stream, count in _ECHO.unechoed.items():
        if stream not in _ECHO.gone:
            _say(f"kernel: warning: {count} bytes of output were not echoed to {stream}: "
                 "the run stopped while its reader was not keeping up")
    if json_out:
        code = _lost_output(code)
        if code == 0 and (unwritten or lost_ops):
            code = 1
        doc = result.to_dict()
        doc["short_id"] = short_id(result.run_id)
        doc["command_exit_code"] = result.exit_code
        doc["exit_code"] = code
        if storage is not None:
            doc["storage"] = storage
        _out(json.dumps(doc, default=str) + "\n")
        return _lost_output(code)
    if echo_output and result.output is not None and result.status is not Status.ERROR:
        text = result.output if isinstance(result.output, str) else json.dumps(
            result.output, default=str)
        if text:
            _out(text.rstrip("\n") + "\n")
    lost = _lost_output(code) != code
    code = _lost_output(code)
    why_exit = ": its output could not all be written" if lost else ""
    if code == 0 and (unwritten or lost_ops):
        code = 1
        why_exit = ": " + " and ".join(
            ([f"{unwritten} audit event(s)"] if unwritten else [])
            + ([f"{lost_ops} journal operation(s)"] if lost_ops else [])) + " were lost"
    # Always, terminal or not: the short id is how a person finds the run again.
    why = result.error or result.reason
    steps = f"{result.steps} step(s)"
    stopped = result.status in (Status.TIMEOUT, Status.KILLED, Status.CANCELLED) or (
        # A usage cap cut it (not a budget that refused it before it started).
        result.status is Status.BUDGET_EXCEEDED and result.reason is not None
        and result.reason.startswith("max_"))
    if command and result.steps == 0 and stopped:
        # A command is one step: it ran and was stopped, so none completed (as the
        # audit's `steps` and --json say).
        steps = "0 steps (the command was stopped)"
    # Control characters a recorded error or reason holds are shown escaped (`_say`).
    _say(f"kernel: run {short_id(result.run_id)} {result.status} after "
         f"{result.runtime_seconds:.1f}s, {steps}"
         + (f": {why}" if why and why != str(result.status) else "")
         + f" (exit {code}{why_exit})")
    return code


def _fail(message: str) -> None:
    _say(f"kernel run: error: {message}")
    raise typer.Exit(2)
