"""`kernel recover` and `kernel resume RUN_ID`: continue runs whose process died.

Every audited `kernel run` registers its run spec (what to run, the
context, the limits, the ports) with the checkpointer before it starts, and
the kernel saves the agent's resumable state after every step. A run whose
process is provably gone while its checkpoint still says `running` (SIGKILL,
a crash, SIGTERM at shutdown) is *interrupted*: these commands take its
lease (one journal transaction; refused while its holder may be alive, so
two recoverers never resume the same run), rebuild its agent from the spec
and resume it under the same run_id, from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from typing import Any

import typer

from kernel import ConfigError, Limits, RunInfo

from .dberrors import guard_database
from .run_cmd import _execute, _report, exit_code, plan_from_spec
from .wiring import PortOptions


def register(app: typer.Typer) -> None:
    """Add `kernel recover` and `kernel resume` to the app."""
    app.command("recover")(guard_database(recover))
    app.command("resume")(guard_database(resume))


def _checkpointer(db: str | None) -> Any:
    from batteries.audit import resolve_db_path
    from batteries.checkpoint import JournalCheckpointer

    return JournalCheckpointer(resolve_db_path(db))


def _fail(message: str) -> None:
    print(f"kernel: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def recover(
    list_only: bool = typer.Option(False, "--list", help="Only list interrupted runs."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    db: str | None = typer.Option(None, "--db", metavar="PATH",
                                  help="Audit database (default: $KERNEL_DB or the user "
                                       "data dir)."),
) -> None:
    """Resume every interrupted run (its process died while it was running).

    Several `kernel recover` may run at once: each run is resumed by exactly
    one of them (whoever takes its lease first). Exit status: 0 if every
    run this process resumed ended ok (or there was nothing to do), 1 otherwise.
    """
    from kernel import AuditError

    try:
        cp = _checkpointer(db)
        runs = cp.interrupted()
    except AuditError as exc:
        _fail(str(exc))
    if list_only or not runs:
        for saved in runs:
            row = {"run_id": saved.run_id, "kind": saved.spec["agent"].get("kind"),
                   "name": saved.spec["info"].get("name"), "steps": saved.checkpoint.steps,
                   "host": saved.host, "pid": saved.pid,
                   "updated_at": str(saved.updated_at)}
            print(json.dumps(row) if json_out else
                  f"{saved.run_id[:12]}  {row['kind']:8} steps={row['steps']:<4} {row['name']}")
        if not runs and not json_out:
            print("no interrupted runs", file=sys.stderr)
        raise typer.Exit(0)
    worst = 0
    for listed in runs:
        try:
            saved = _claim(cp, listed.run_id)
        except AuditError as exc:
            print(f"kernel: run {listed.run_id[:12]}: {exc}", file=sys.stderr)
            worst = 1
            continue
        if saved is None:
            continue  # another recoverer holds it (or finished it meanwhile)
        code = _resume_one(saved, db=db, json_out=json_out)
        worst = worst or (1 if code else 0)
    raise typer.Exit(worst)


def _claim(cp: Any, run_id: str) -> Any:
    """Take the run's lease; its checkpoint as of now (None if someone else holds it)."""
    if not cp.claim(run_id):
        return None
    # Reload: a recoverer that held it before may have moved it on before dying.
    return cp.load(run_id)


def resume(
    run_id: str = typer.Argument(..., help="The run id (a unique prefix is enough)."),
    json_out: bool = typer.Option(False, "--json", help="The final result as JSON."),
    db: str | None = typer.Option(None, "--db", metavar="PATH",
                                  help="Audit database (default: $KERNEL_DB or the user "
                                       "data dir)."),
) -> None:
    """Resume one interrupted run from its last checkpoint; exit with its status's code."""
    from kernel import AuditError

    try:
        cp = _checkpointer(db)
        matches = [r for r in cp.interrupted() if r.run_id.startswith(run_id)]
        if not matches:
            saved = next(iter(cp.find(run_id)), None)
            if saved is None:
                _fail(f"no run {run_id!r} with a checkpoint")
            elif saved.status != "running":
                _fail(f"run {saved.run_id[:12]} is {saved.status}; nothing to resume")
            else:
                _fail(f"run {saved.run_id[:12]} is still running (pid {saved.pid} on "
                      f"{saved.host})")
        if len(matches) > 1:
            _fail(f"run id prefix {run_id!r} is ambiguous ({len(matches)} runs)")
        saved = _claim(cp, matches[0].run_id)
        if saved is None:
            _fail(f"run {matches[0].run_id[:12]} is being resumed by another process")
    except AuditError as exc:
        _fail(str(exc))
    raise typer.Exit(_resume_one(saved, db=db, json_out=json_out))


def _resume_one(saved: Any, *, db: str | None, json_out: bool) -> int:
    """Rebuild and resume one run; returns its exit code."""
    import trio

    spec = saved.spec
    agent_spec = spec["agent"]
    short = saved.run_id[:12]
    if agent_spec.get("kind") == "command":
        why = "a plain command has no resumable state; run it again with `kernel run`"
        _checkpointer(db).mark_failed(saved.run_id, f"not resumable: {why}")
        print(f"kernel: run {short} cannot resume: {why}", file=sys.stderr)
        return 1
    cwd = spec.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    try:
        plan = plan_from_spec(agent_spec, quiet=json_out)
    except ConfigError as exc:
        print(f"kernel: run {short} cannot be rebuilt: {exc}", file=sys.stderr)
        return 2
    if not callable(getattr(plan.agent, "snapshot", None)):
        why = f"a {type(plan.agent).__name__} keeps no resumable state"
        _checkpointer(db).mark_failed(saved.run_id, f"not resumable: {why}")
        print(f"kernel: run {short} cannot resume: {why}", file=sys.stderr)
        return 1
    info = RunInfo(**spec["info"])
    limits = Limits(**spec["limits"])
    ports = dict(spec.get("ports") or {})
    ports["webhooks"] = tuple(ports.get("webhooks") or ())
    opts = PortOptions(**ports)
    if db is not None:
        opts.db = db
    print(f"kernel: resuming run {short} from step {saved.checkpoint.steps}", file=sys.stderr)
    result = trio.run(partial(_execute, plan.agent, info, limits, opts, spec=spec,
                              resume=saved.checkpoint))
    code = exit_code(result, command=False)
    _report(result, code, json_out=json_out, echo_output=not plan.echoes)
    return code
