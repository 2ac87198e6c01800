"""Loop files on the command line: `kernel validate` (and `build_loop`, warning on stderr).

Nothing heavy is imported at module import: the loop adapter (and PyYAML
behind it) loads inside the functions, so `kernel --help` stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from adapters.loop import VerdictSource
    from kernel import Agent, Limits, RunInfo

VALIDATE_HELP = """Check LOOP.yaml without running it: schema, references, variables.

\b
Reports every problem with its file:line and key path, for example
  loop.yaml:14: states.test.on_no: route target 'fxi' is not a state (did you mean 'fix'?)
Errors (exit 2): a path that is not a regular file or is over 1 MiB (checked
before reading), YAML whose aliases expand past 4 MiB or refer to themselves,
malformed YAML or keys, unknown route targets, a route key naming a verdict
no evaluator gives (on_sucess: "did you mean 'on_success'?"), a missing or
unknown initial state, evaluators missing parameters, bad ${...} templates
(${result.*} outside a route target), broken sub-loops, from:/import:/fragment:
that cannot be resolved, a dotted --context key into a plain value. Warnings
(exit 0): unknown keys, little-loops features left out (named), unreachable
states, a route the state's evaluator never takes, raw (unquoted) shell
insertion, values used in shell arithmetic, bash operators on a loop variable
(${x:0:19}, ${x%%.*}, ${x^^}: not applied, a run reaching one ends error),
context variables that must come from --context, a --context key the loop
never reads.
"""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


async def ask_on_terminal(state: str, action: str) -> str:
    """Ask on stderr/stdin what the simulated result of `state` is (default: pass).

    The loop adapter never touches the terminal; `build_loop` hands this to
    `LoopAgent(ask=...)` for a dry run without `--scenario` when stdin is one.
    """
    import trio

    prompt = (f"[dry run] state '{state}' would run: {action or '(nothing)'}\n"
              "  result? [p]ass / [f]ail / [e]rror (enter = pass): ")
    print(prompt, end="", file=sys.stderr, flush=True)
    line = await trio.to_thread.run_sync(sys.stdin.readline)
    choice = line.strip().lower()[:1]
    return {"f": "fail", "e": "error", "2": "fail", "3": "error"}.get(choice, "pass")


def build_loop(path: str, context: Mapping[str, str], *, scenario: str | None = None,
               judge: VerdictSource | None = None,
               on_line: Callable[[str, str], None] | None = None,
               warn: Callable[[str], None] | None = _stderr,
               prompt_command: Sequence[str] | None = None,
               mcp_command: Sequence[str] | None = None,
               on_output: Callable[[str, bytes], Awaitable[None] | None] | None = None,
               ) -> tuple[Agent, RunInfo, Limits]:
    """`adapters.specs.build_loop` with the CLI's terminal: warnings on stderr by default,
    and a dry run without a scenario asks on the terminal (`ask_on_terminal`) when
    stdin is one."""
    from adapters.specs import build_loop as build

    ask = ask_on_terminal if scenario is None and sys.stdin is not None and \
        sys.stdin.isatty() else None
    return build(path, context, scenario=scenario, judge=judge, on_line=on_line, warn=warn,
                 prompt_command=prompt_command, mcp_command=mcp_command, on_output=on_output,
                 ask=ask)


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    """Parse repeated `--context KEY=VALUE` options; a malformed one is a ConfigError."""
    from kernel import ConfigError

    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--context expects KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def validate(
    loop: Path = typer.Argument(..., metavar="LOOP.yaml", help="The loop file to check.",
                                show_default=False),
    context: list[str] | None = typer.Option(
        None, "--context", "-c", metavar="KEY=VALUE",
        help="A context variable the run will get (repeatable); a ${context.x} that "
             "neither the file nor --context defines is then an error, and a key the "
             "loop never reads a warning. A dotted KEY sets a field: cfg.depth=9."),
    json_out: bool = typer.Option(
        False, "--json", help='Print the report as one JSON document (one line): {"file", '
                              '"ok", "states", "problems": [...]}.'),
) -> None:
    """Check a loop file: exit 2 on errors, 0 when it can run (warnings allowed)."""
    from adapters.loop import check_loop
    from kernel import ConfigError

    try:
        given = parse_pairs(context or [])
    except ConfigError as exc:
        print(f"kernel validate: error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    report = check_loop(loop, context=given, context_required=context is not None)
    code = 0 if report.ok else 2
    if json_out:
        doc: dict[str, Any] = {
            "file": str(loop), "ok": report.ok,
            "states": len(report.spec.states) if report.spec else 0,
            "problems": [{"severity": p.severity, "line": p.line, "column": p.column,
                          "where": p.where, "message": p.message, "text": str(p)}
                         for p in report.problems]}
        from .output import print_doc

        print_doc(doc)
        raise typer.Exit(code)
    for p in report.problems:
        print(f"{p.severity}: {p}")
    errors, warnings = len(report.errors), len(report.warnings)
    if report.ok and report.spec is not None:
        n = len(report.spec.states)
        summary = f"{loop}: ok ({n} state{'s' if n != 1 else ''}, initial '{report.spec.initial}'"
        summary += f", {warnings} warning{'s' if warnings != 1 else ''})" if warnings else ")"
    else:
        summary = (f"{loop}: {errors} error{'s' if errors != 1 else ''}"
                   f", {warnings} warning{'s' if warnings != 1 else ''}")
    print(summary)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add `kernel validate` to the app."""
    app.command("validate", help=VALIDATE_HELP)(validate)
