"""The `kernel` typer app and its entry point.

Errors become exit codes here, at the edge, and nowhere else: bad input is
one line on stderr and exit 2; a run's status maps to the DESIGN.md table.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer

from . import run_cmd

HELP = """Run agent runs under supervision, and read their audit trail.

A run ends in exactly one status: ok, error, timeout (124), killed (137),
cancelled (130), budget_exceeded (3), max_steps (4), handoff (5), dry_run.
Every run is recorded to an embedded DuckDB file ($KERNEL_DB, else the user
data directory); analysts query it with `kernel query` or straight from DuckDB.
"""

app = typer.Typer(
    name="kernel",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)



def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"kernel {version('run-kernel')}")
        except PackageNotFoundError:  # pragma: no cover - only when run from a bare checkout
            print("kernel (version unknown: run-kernel is not installed)")
        raise typer.Exit(0)


@app.callback()
def _root(
    _version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_print_version,
        help="Print the version and exit."),
) -> None:
    """Keep `kernel` a command group even while it has a single command."""


run_cmd.register(app)

# Commands contributed by other parts of the CLI; each module has `register(app)`.
for _name in ("analyst", "loops", "actions", "budget_cmd", "recover_cmd"):
    try:
        _mod = import_module(f"{__package__}.{_name}")
    except ModuleNotFoundError as _exc:  # pragma: no cover - only while a part is absent
        if _exc.name != f"{__package__}.{_name}":
            raise
    else:
        _mod.register(app)


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logger = logging.getLogger("kernel")
    logger.addHandler(handler)
    logger.setLevel(level)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turn usage errors into one line + exit 2."""
    _configure_logging()
    try:
        code = typer.main.get_command(app).main(
            args=argv, prog_name="kernel", standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
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
