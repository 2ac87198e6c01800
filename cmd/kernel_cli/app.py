"""The `kernel` typer app and its entry point.

Errors become exit codes in this package, at the edge, never in the library:
each command turns the library's errors and a run's status into its exit code
(the DESIGN.md table), and `main` turns usage errors into one line on stderr
and exit 2.
"""

from __future__ import annotations

import sys
from functools import partial
from importlib import import_module
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    app: typer.Typer  # made on first use, by the module __getattr__ below

HELP = """Run agent runs under supervision, and read their audit trail.

A run ends in exactly one status: ok, error, timeout (124), killed (137),
cancelled (130), budget_exceeded (3), max_steps (4), handoff (5), dry_run, or
lost (6: its supervisor died and it could not be resumed). Every run is
recorded to a journal beside an embedded DuckDB file ($KERNEL_DB, else the
user data directory); analysts query it with `kernel query`, or straight from
DuckDB after `kernel sync`.
"""

class _KernelGroup(typer.core.TyperGroup):
    """The root command group: tidies every command under it once it is built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _tidy(self)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"kernel {version('run-kernel')}")
        except PackageNotFoundError:  # pragma: no cover - only when run from a bare checkout
            print("kernel (version unknown: run-kernel is not installed)")
        raise typer.Exit(0)


def _root(
    _version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_print_version,
        help="Print the version and exit."),
) -> None:
    """Keep `kernel` a command group even while it has a single command."""


#: The modules that add the commands, in the order `kernel --help` lists them; each
#: has `register(app)`.
PARTS = ("run_cmd", "analyst", "loops", "actions", "budget_cmd", "recover_cmd", "batch_cmd")
#: Which part adds each top-level command (tested against what they register): `kernel
#: CMD` imports that module alone.
COMMANDS = {
    "run": "run_cmd",
    **dict.fromkeys(("runs", "show", "report", "stats", "query", "purge", "export", "sync"),
                    "analyst"),
    "validate": "loops", "actions": "actions", "budget": "budget_cmd",
    "recover": "recover_cmd", "resume": "recover_cmd", "batch": "batch_cmd",
}


def _typer(parts: tuple[str, ...]) -> typer.Typer:
    """The `kernel` app with the commands `parts` add."""
    made = typer.Typer(
        name="kernel",
        cls=_KernelGroup,
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    made.callback()(_root)
    for part in parts:
        import_module(f"{__package__}.{part}").register(made)
    return made


def __getattr__(name: str) -> Any:
    """`app`, the whole typer app (every command), made on first use: `kernel CMD`
    imports only the module that adds CMD (`_command`)."""
    if name == "app":
        made = globals()["app"] = _typer(PARTS)
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _configure_logging() -> None:
    """Send the library's logs (the `kernel.*` loggers) to stderr, errors only.

    stderr, never stdout, which carries --json. The CLI prints port failures
    itself as one-line warnings; set KERNEL_LOG_LEVEL=warning (or info/debug)
    to see the library's log lines too.
    """
    import logging
    import os

    name = os.environ.get("KERNEL_LOG_LEVEL", "error").upper()
    level = logging.getLevelNamesMapping().get(name, logging.ERROR)
    logger = logging.getLogger("kernel")
    # Once per process: `main` called again in process (tests) replaces its handler
    # rather than stacking one more on a stderr that may since have been closed.
    for old in [h for h in logger.handlers if getattr(h, "kernel_cli", False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.kernel_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def _tidy(command: Any) -> None:
    """Help that shows real metavars, and fast option parsing, for every command.

    typer prints an argument's Python type beside its name (`RUN_ID <str>`)
    and braces round required ones in the usage line (`{RUN_ID}`): arguments
    here all have a metavar, which is shown alone. Then `_plain_coercion`.
    """
    def walk(cmd: Any) -> None:
        for param in getattr(cmd, "params", ()):
            if type(param).__name__ == "TyperArgument":
                param.display_type_rich = _no_type
                param.display_type = _no_type
                param._usage_display_name = partial(_usage_name, param)
        if any(getattr(p, "rich_help_panel", None) for p in getattr(cmd, "params", ())):
            cmd.format_options = partial(_format_panels, cmd)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(command)
    _plain_coercion(command)


def _format_panels(cmd: Any, ctx: Any, formatter: Any) -> None:
    """Options grouped under their `rich_help_panel` titles, in order of first use.

    typer draws those panels only with rich help (slow to import, so off
    here); this prints the same groups as plain sections, one per panel,
    options without a panel (--help) under "Options" at the end.
    """
    args: list[tuple[str, str]] = []
    panels: dict[str, list[tuple[str, str]]] = {}
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":
            args.append(record)
        else:
            panels.setdefault(getattr(param, "rich_help_panel", None) or "Options",
                              []).append(record)
    if "Options" in panels:  # the ungrouped ones last
        panels["Options"] = panels.pop("Options")
    for title, rows in (("Arguments", args), *panels.items()):
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


def _no_type(*_args: Any, **_kwargs: Any) -> None:
    return None


def _usage_name(param: Any) -> str:
    name = str(param.display_name_raw)
    if not param.required:
        name = f"[{name}]"
    return name + ("..." if param.nargs != 1 else "")


def _plain_coercion(command: Any) -> None:
    """Skip typer's per-parameter pydantic adapters where the value needs no conversion.

    typer 0.2x coerces every parameter of the invoked command, default or
    not, through a pydantic TypeAdapter built on first use: importing
    pydantic and building ~30 adapters is most of `kernel run`'s start-up.
    For parameters annotated str, int, float, bool, timedelta (optional or
    not) or list[str], a value click has already made of that type is passed
    through as is, and an option with a `parser=` (our `numbers` parsers) gets
    the parser called on it, as typer's adapter would; any other value
    (and any other annotation, and any bounded number) still goes through
    typer's own coercion, so behaviour is unchanged. Uses typer internals:
    if they change, this does nothing.
    """
    try:
        from typer._coercion import RuntimeParam, build_runtime_param
    except ImportError:  # pragma: no cover - a typer without the adapter layer
        return
    from datetime import timedelta
    from typing import Union, get_args, get_origin

    scalars: tuple[type, ...] = (str, int, float, bool, timedelta)

    def plain_type(annotation: Any) -> Any:
        if annotation in scalars:
            return annotation
        args = [a for a in get_args(annotation) if a is not type(None)]
        origin = get_origin(annotation)
        if origin is list and args == [str]:
            return list
        if (origin is Union or type(annotation).__name__ == "UnionType") and len(args) == 1:
            return plain_type(args[0])
        return None

    class Plain(RuntimeParam):
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            parse = self.parameter_info.parser
            if parse is not None:  # what typer's adapter would do: call it on each value
                if isinstance(value, (list, tuple)):
                    return [parse(v) for v in value]
                return parse(value)
            want = plain_type(self.annotation)
            if want is list and isinstance(value, (list, tuple)) and all(
                    isinstance(v, str) for v in value):
                return list(value)
            if (want not in (None, list) and isinstance(value, want)
                    and (want is bool or not isinstance(value, bool))):
                return value
            real = build_runtime_param(param.type_descriptor)
            return real._coerce_value(value, param=param, ctx=ctx)

    def walk(cmd: Any) -> None:
        params = list(getattr(cmd, "params", ()))
        try:  # the help option is made (and cached) on first use: make it now
            ctx = cmd.context_class(cmd, help_option_names=["-h", "--help"])
            params.append(cmd.get_help_option(ctx))
        except Exception:  # pragma: no cover - typer internals changed: skip it
            pass
        for param in params:
            desc = getattr(param, "type_descriptor", None)
            info = getattr(desc, "parameter_info", None)
            if (desc is None or getattr(param, "_runtime_param", 0) is not None
                    or plain_type(desc.annotation) is None
                    or getattr(info, "min", None) is not None
                    or getattr(info, "max", None) is not None):
                continue
            param._runtime_param = Plain(parameter_info=info,  # type: ignore[arg-type]
                                         annotation=desc.annotation)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(command)


def _command(args: list[str]) -> Any:
    """The click group for `kernel ARGS`: only the command ARGS name is built, when it names one.

    typer builds every command's parameters (signatures, help, defaults) to
    make the group, and every command's module is imported to add it: ~20
    commands in seven modules for a `kernel run` that uses one. When the
    first argument is a command's name, the group is built with that
    command alone, from its module alone, and parses and prints (`kernel run
    --help`, errors) exactly as the whole group would; anything else
    (`kernel`, `kernel --help`, a typo that gets "No such command") builds
    them all.
    """
    first = args[0] if args else ""
    part = COMMANDS.get(first)
    if part is None:
        return typer.main.get_command(__getattr__("app"))  # a _KernelGroup: tidied as built
    made = _typer((part,))

    def name(info: Any) -> Any:
        return info.name if isinstance(info.name, str) else info.typer_instance.info.name

    made.registered_commands = [c for c in made.registered_commands if c.name == first]
    made.registered_groups = [g for g in made.registered_groups if name(g) == first]
    return typer.main.get_command(made)


def _open_closed_stdio() -> None:
    """Give a stdin, stdout or stderr that was closed (`kernel run -- CMD >&-`) /dev/null.

    Python leaves `sys.stdout` None when file descriptor 1 was closed, and
    the next file opened (the journal, a pipe to a command) would take the
    free descriptor, to be written as stdout or read as a command's stdin.
    /dev/null takes it instead, and every command runs as usual: what it
    would have printed goes nowhere (a run's output is still audited), and
    so do messages to a closed stderr.
    """
    import os

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # pragma: no cover - the lowest free descriptor is this one
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # the command gets it, as it would get the original
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # noqa: SIM115


def _default_sigchld() -> None:
    """Set SIGCHLD back to its default if whatever started us left it ignored.

    SIG_IGN survives exec (some daemons and job runners start their children so):
    every command's exit status would then be reaped away by the system, and the
    library refuses to start commands rather than change a host's disposition
    (`adapters._proc`). The CLI owns its process: it takes the default.
    """
    import signal

    sig = getattr(signal, "SIGCHLD", None)
    if sig is not None and signal.getsignal(sig) == signal.SIG_IGN:
        signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turn usage errors into one line + exit 2."""
    _open_closed_stdio()
    _default_sigchld()
    _configure_logging()
    try:
        command = _command(sys.argv[1:] if argv is None else argv)
        code = command.main(args=argv, prog_name="kernel", standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        bad = _config_error(exc)
        if bad is not None:  # bad input found deep inside a command (a setting, a URL)
            print(f"{_command_path(sys.argv[1:] if argv is None else argv)}: error: {bad}",
                  file=sys.stderr)
            sys.exit(2)
        # Usage errors (typer vendors click in some versions, so match by shape).
        fmt = getattr(exc, "format_message", None)
        if fmt is None:
            if type(exc).__name__ == "Abort":
                print("kernel: aborted", file=sys.stderr)
                sys.exit(130)
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(fmt(), file=sys.stderr)
            sys.exit(2)
        ctx = getattr(exc, "ctx", None)
        cmd = ctx.command_path if ctx is not None else "kernel"
        code = getattr(exc, "exit_code", 2)
        hint = f" (see '{cmd} --help')" if code == 2 else ""
        if cmd == "kernel run" and type(exc).__name__ == "NoSuchOption":
            # `kernel run ls -l`: -l was meant for the command, not for us.
            hint = " (put the command after --, as in: kernel run [OPTIONS] -- CMD ARGS...)"
        print(f"{cmd}: error: {fmt()}{hint}", file=sys.stderr)
        sys.exit(code)
    sys.exit(code if isinstance(code, int) else 0)


def _config_error(exc: BaseException) -> str | None:
    """The message of a `ConfigError`, also one wrapped in exception groups (raised in a
    nursery); None if `exc` is anything else, or a group holding anything else."""
    from kernel import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, BaseExceptionGroup):
        found = [_config_error(e) for e in exc.exceptions]
        if found and all(m is not None for m in found):
            return found[0]
    return None


def _command_path(args: list[str]) -> str:
    """`kernel COMMAND` from the command line (`kernel` when there is none)."""
    for arg in args:
        if not arg.startswith("-"):
            return f"kernel {arg}" if arg.isidentifier() else "kernel"
    return "kernel"


def entry() -> None:
    """The `kernel` executable: `main`, then exit without the interpreter's teardown.

    Everything a command writes is closed inside it (the audit, checkpoints
    and deliveries are finished before its trio run returns), so once stdout
    and stderr are flushed there is nothing left to do but free memory and
    unload modules, which costs a loaded interpreter (duckdb, pyarrow, trio)
    ~0.1 s. In-process callers (tests) use `main`, which exits normally.
    """
    import contextlib
    import os

    try:
        main()
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a closed pipe: like any failed write, exit 1 if clean
        code = code or 1
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    proc = sys.modules.get("adapters._proc")  # only if this command started processes
    if proc is not None:
        proc.lifeline_flush()
    os._exit(code or 0)

