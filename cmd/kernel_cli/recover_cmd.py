"""`kernel recover` and `kernel resume RUN_ID`: continue runs whose process died.

Every audited `kernel run` registers its run spec (what to run, the
context, the limits, the ports) with the checkpointer before it starts, and
the kernel saves the agent's resumable state after every step. A run whose
process is provably gone while its checkpoint still says `running` (SIGKILL,
a crash, SIGTERM at shutdown) is *interrupted*: these commands take its
lease (one journal transaction; refused while its holder may be alive, so
two recoverers never resume the same run), rebuild its agent from the spec
and resume it under the same run_id, from its last checkpoint.

Secrets are not stored (see `batteries.redact`), so a spec may say that some
of its values were redacted. Those must be given again: a secret context
value with `--context KEY=VALUE`, a webhook or base URL that held a password
with `--webhook` / `--base-url` (`kernel resume` only). A run missing one is
refused with one line naming what to give, and stays resumable; a run whose
command, prompt or loop path held a secret cannot be resumed at all.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import typer

from .dbopt import DB_HELP, STORE_OPTION

if TYPE_CHECKING:
    pass


from . import ids
from .dberrors import error_prefix, guard_database
from .run_cmd import (
    REDACT_HELP,
    _execute,
    _report,
    exit_code,
    make_redactor,
    parse_context,
    plan_from_spec,
)


def register(app: typer.Typer) -> None:
    """Add `kernel recover` and `kernel resume` to the app."""
    app.command("recover")(guard_database(recover))
    app.command("resume")(guard_database(resume))


def _checkpointer(db: str | None) -> Any:
    from batteries.audit import resolve_db_path
    from batteries.checkpoint import JournalCheckpointer

    return JournalCheckpointer(resolve_db_path(db))


def _fail(message: str) -> None:
    print(f"{error_prefix()} {message}", file=sys.stderr)
    raise typer.Exit(2)


_CONTEXT_HELP = ("A secret context value the run was started with (repeatable): secrets "
                 "are not stored, so a run that had one is resumed only when it is given again.")


def recover(
    list_only: bool = typer.Option(False, "--list", help="Only list interrupted runs."),
    json_out: bool = typer.Option(
        False, "--json", help="JSON lines: one object a line (each listed run, or each "
                              "resumed run's result)."),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
    context: list[str] | None = typer.Option(None, "--context", "-c", metavar="KEY=VALUE",
                                             help=_CONTEXT_HELP),
    redact: list[str] | None = typer.Option(None, "--redact", metavar="REGEX",
                                            help=REDACT_HELP),
) -> None:
    """Resume every interrupted run (its process died while it was running).

    Several `kernel recover` may run at once: each run is resumed by exactly
    one of them (whoever takes its lease first). Any process the run started
    that is still alive is stopped first; a run that cannot be resumed (a
    plain command) is closed with status `lost`. Exit status: 0 if every
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
                  f"{ids.short_id(saved.run_id)}  {row['kind']:8} steps={row['steps']:<4} "
                  f"{row['name']}")
        if not runs and not json_out:
            print("no interrupted runs", file=sys.stderr)
        raise typer.Exit(0)
    given = _Given(context or [], [], None, redact or [])
    worst = 0
    for listed in runs:
        try:
            saved = _claim(cp, listed.run_id)
        except AuditError as exc:
            print(f"kernel: run {ids.short_id(listed.run_id)}: {exc}", file=sys.stderr)
            worst = 1
            continue
        if saved is None:
            continue  # another recoverer holds it (or finished it meanwhile)
        code = _resume_one(saved, db=db, json_out=json_out, given=given)
        worst = worst or (1 if code else 0)
    raise typer.Exit(worst)


def _claim(cp: Any, run_id: str) -> Any:
    """Take the run's lease; its checkpoint as of now (None if someone else holds it)."""
    if not cp.claim(run_id):
        return None
    # Reload: a recoverer that held it before may have moved it on before dying.
    return cp.load(run_id)


def resume(
    run_id: str = typer.Argument(..., metavar="RUN_ID",
                                 help="The run's short id, a full id (or any unique prefix), "
                                      "or 'last' for the newest interrupted run."),
    json_out: bool = typer.Option(
        False, "--json", help="Print the final result as one JSON document (one line) on "
                              "stdout."),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
    context: list[str] | None = typer.Option(None, "--context", "-c", metavar="KEY=VALUE",
                                             help=_CONTEXT_HELP),
    webhook: list[str] | None = typer.Option(
        None, "--webhook", metavar="URL",
        help="Deliver to these URLs instead of the stored ones (needed when a stored "
             "webhook held a password, which is not stored)."),
    base_url: str | None = typer.Option(
        None, "--base-url", metavar="URL",
        help="The API base URL, when the stored one held a password."),
    redact: list[str] | None = typer.Option(None, "--redact", metavar="REGEX",
                                            help=REDACT_HELP),
) -> None:
    """Resume one interrupted run from its last checkpoint; exit with its status's code."""
    from kernel import AuditError, ConfigError

    try:
        want = run_id if run_id.strip().lower() == ids.LAST else ids.normalise(run_id)
        cp = _checkpointer(db)
        waiting = cp.interrupted()
        if want == ids.LAST:  # the newest interrupted run
            matches = waiting[-1:]
            if not matches:
                _fail("no interrupted run: 'last' names nothing")
        else:
            matches = [r for r in waiting if ids.matches(r.run_id, want)]
        if not matches:
            known = [r for r in cp.find("") if ids.matches(r.run_id, want)]
            if not known:
                _fail(f"no run {run_id!r} with a checkpoint")
            saved = known[-1]
            if saved.status != "running":
                _fail(f"run {ids.short_id(saved.run_id)} is {saved.status}; nothing to resume")
            else:
                _fail(f"run {ids.short_id(saved.run_id)} is still running (pid {saved.pid} on "
                      f"{saved.host})")
        if len(matches) > 1:
            ids.pick(run_id, [r.run_id for r in matches])  # raises, naming the candidates
        saved = _claim(cp, matches[0].run_id)
        if saved is None:
            _fail(f"run {ids.short_id(matches[0].run_id)} is being resumed by another process")
    except (AuditError, ConfigError) as exc:
        _fail(str(exc))
    given = _Given(context or [], webhook or [], base_url, redact or [])
    raise typer.Exit(_resume_one(saved, db=db, json_out=json_out, given=given))


@dataclass
class _Given:
    """What `kernel resume` / `kernel recover` were given to put back in place of secrets."""

    context: list[str]
    webhooks: list[str]
    base_url: str | None
    redact: list[str]


def restore_secrets(spec: dict[str, Any], given: _Given, short: str
                    ) -> tuple[dict[str, Any] | None, str | None, bool]:
    """The spec with its redacted values given back: (spec, None, _) or (None, why, final).

    `final` is True when no option can give the value back (the run can
    never be resumed); otherwise `why` names the options to add.

    Raises:
        ConfigError: A --context pair is malformed.
    """
    spec = copy.deepcopy(spec)
    agent = spec["agent"]
    ports = spec.setdefault("ports", {})
    ctx = parse_context(given.context)
    if ctx and isinstance(agent.get("context"), dict):
        agent["context"].update(ctx)
    if given.webhooks:
        ports["webhooks"] = list(given.webhooks)
    if given.base_url is not None:
        agent["base_url"] = given.base_url
    missing: list[str] = []
    for path in spec.get("redacted") or []:
        where = list(path)
        if where[:2] == ["agent", "context"] and len(where) == 3:
            if where[2] not in ctx:
                missing.append(f"--context {where[2]}=...")
        elif where[:2] == ["ports", "webhooks"]:
            if not given.webhooks and "--webhook URL" not in missing:
                missing.append("--webhook URL")
        elif where == ["agent", "base_url"]:
            if given.base_url is None:
                missing.append("--base-url URL")
        else:
            name = ".".join(str(p) for p in where)
            return None, f"its {name} held a secret, which is not stored; run it again " \
                         "with `kernel run`", True
    if missing:
        return None, ("its secrets are not stored; give them again: kernel resume "
                      f"{short} {' '.join(missing)}"), False
    return spec, None, False


def _resume_one(saved: Any, *, db: str | None, json_out: bool, given: _Given) -> int:
    """Rebuild and resume one run; returns its exit code."""
    import trio

    from kernel import ConfigError, RunSpec

    short = ids.short_id(saved.run_id)
    _stop_leftovers(saved.run_id, db=db)
    if saved.spec["agent"].get("kind") != "command":
        try:
            restored, why, final = restore_secrets(saved.spec, given, short)
        except ConfigError as exc:
            print(f"{error_prefix()} {exc}", file=sys.stderr)
            return 2
        if restored is None:
            if final:
                return _lose(saved, why or "its secrets are gone", db=db)
            print(f"kernel: run {short} cannot resume: {why}", file=sys.stderr)
            return 2
        saved = dataclasses.replace(saved, spec=restored)
    if saved.spec["agent"].get("kind") == "command":
        why = "a plain command has no resumable state; run it again with `kernel run`"
        return _lose(saved, why, db=db)
    try:
        spec = RunSpec.from_dict(saved.spec)
        if db is not None:
            spec = dataclasses.replace(spec, ports=dataclasses.replace(spec.ports, db=db))
        plan = plan_from_spec(spec, quiet=json_out)
    except ConfigError as exc:
        print(f"kernel: run {short} cannot be rebuilt: {exc}", file=sys.stderr)
        return 2
    if not callable(getattr(plan.agent, "snapshot", None)):
        why = f"a {type(plan.agent).__name__} keeps no resumable state"
        return _lose(saved, why, db=db)
    try:
        redactor = make_redactor(dict(spec.agent.context), given.redact)
    except ConfigError as exc:
        print(f"{error_prefix()} {exc}", file=sys.stderr)
        return 2
    print(f"kernel: resuming run {short} from step {saved.checkpoint.steps}", file=sys.stderr)
    result = trio.run(partial(_execute, spec, plan.agent, resume=saved.checkpoint,
                              redactor=redactor))
    code = exit_code(result, command=False)
    _report(result, code, json_out=json_out, echo_output=not plan.echoes)
    return code


def _lose(saved: Any, why: str, *, db: str | None) -> int:
    """Close a run that cannot resume: checkpoint failed, run row `lost` (one journal
    transaction; the analysts' file follows at its next sync); returns 1."""
    from kernel import AuditError, Status

    run_id = saved.run_id
    try:
        _checkpointer(db).mark_lost(saved, why)
    except AuditError as exc:
        print(f"kernel: warning: run {ids.short_id(run_id)}: cannot mark it lost: {exc}",
              file=sys.stderr)
    print(f"kernel: run {ids.short_id(run_id)} cannot resume: {why}; marked {Status.LOST}",
          file=sys.stderr)
    return 1


def _stop_leftovers(run_id: str, *, db: str | None, wait: float = 10.0) -> None:
    """Stop every recorded process group of the run that outlived its supervisor.

    Normally there is none (the lifeline watcher killed them when the
    supervisor died); this covers a watcher that was killed too. A group
    counts only if it is provably the recorded one (same host, boot and
    leader start time), so a reused pid is never signalled. Waits until
    the groups are gone, so a resumed state never runs beside its orphan.
    """
    import time

    from adapters._proc import live_group, stop_recorded
    from batteries.audit import queries, resolve_db_path
    from batteries.store import open_store
    from kernel import KernelError

    # Read the store, where runs write (the journal in WAL mode, or PostgreSQL):
    # never in a writer's way.
    try:
        store = open_store(resolve_db_path(db))
        try:
            groups = queries.process_groups_from(store.payloads(run_id, "process_start"))
        finally:
            store.close()
    except KernelError as exc:
        print(f"kernel: warning: run {ids.short_id(run_id)}: cannot read its processes: {exc}",
              file=sys.stderr)
        return
    stopped = sum(stop_recorded(g) for g in groups)
    if not stopped:
        return
    deadline = time.monotonic() + wait
    while any(live_group(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"kernel: run {ids.short_id(run_id)}: stopped {stopped} process(es) it left running",
          file=sys.stderr)
