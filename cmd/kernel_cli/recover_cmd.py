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

A run whose checkpoint row cannot be read (not JSON: a damaged disk, a hand
edit) is named with the reason in one line and left as it is (see
`batteries.recovery`); `kernel recover` resumes the others and exits 1,
`kernel resume` of that run is one line and exit 2.

The work is `batteries.recovery.Recovery`'s (a host uses it the same way):
this module reads the options, builds agents with the CLI's terminal I/O
(`run_cmd.plan_from_spec`) and says what happened.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import typer

from .dbopt import DB_HELP, STORE_OPTION

if TYPE_CHECKING:
    from batteries.recovery import Recovery, Resumed
    from batteries.store import SavedRun


from . import ids, output
from .dberrors import error_prefix, guard_database
from .run_cmd import (
    REDACT_HELP,
    _execute,
    _report,
    _storage,
    exit_code,
    journal_notes,
    make_redactor,
    parse_context,
    plan_from_spec,
)


def register(app: typer.Typer) -> None:
    """Add `kernel recover` and `kernel resume` to the app."""
    app.command("recover")(guard_database(recover))
    app.command("resume")(guard_database(resume))


def _recovery(db: str | None, *, json_out: bool, context: list[str] | None = None,
              webhooks: list[str] | None = None, base_url: str | None = None,
              redact: list[str] | None = None) -> Recovery:
    """The library's Recovery, building agents the way `kernel run` does.

    Raises:
        ConfigError: A malformed --context pair, --webhook URL or --redact pattern.
    """
    from adapters import stop_leftover_group
    from adapters.specs import spec_secrets
    from batteries.recovery import Recovery, Secrets

    if webhooks:
        from batteries.delivery import check_delivery_options

        check_delivery_options(None, webhooks)  # a typo is bad input before anything resumes
    secrets = Secrets(context=parse_context(context or []), webhooks=tuple(webhooks or ()),
                      base_url=base_url)
    make_redactor({}, redact or [])  # a bad pattern is refused before anything is touched
    return Recovery(db, build=lambda spec: plan_from_spec(spec, quiet=json_out).agent,
                    stop_group=stop_leftover_group, secrets=secrets, redact=redact or (),
                    key_values=spec_secrets)


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
    plain command) is closed with status `lost`. A run of a batch is left to
    its batch, which resumes it (`kernel batch --resume ID`, said on stderr;
    `--list` shows its batch). A run whose checkpoint is damaged (its spec or
    state is not JSON) is not resumed and is left as it is: one line on stderr
    names it and why (`--json`: a document with `"damaged": true`; `--list`
    marks it); the other runs are resumed. Exit status: 0 if every run this
    process resumed ended ok (or there was nothing to do), 1 otherwise, or if a
    checkpoint is damaged (with `--list` too).
    """
    from kernel import AuditError, ConfigError

    try:
        rec = _recovery(db, json_out=json_out, context=context, redact=redact)
        runs = _interrupted(rec)
        batch_of = {r.run_id: b for r in runs
                    if r.damaged is None and (b := rec.batch_of(r)) is not None}
    except (AuditError, ConfigError) as exc:
        _fail(str(exc))
    damaged = [r for r in runs if r.damaged is not None]
    if list_only or not runs:
        for saved in runs:
            agent, info = saved.spec.get("agent") or {}, saved.spec.get("info") or {}
            row = {"run_id": saved.run_id, "kind": agent.get("kind"),
                   "name": info.get("name"), "steps": saved.checkpoint.steps,
                   "host": saved.host, "pid": saved.pid,
                   "updated_at": str(saved.updated_at),
                   "batch_id": batch_of.get(saved.run_id)}
            if saved.damaged is not None:
                row["damaged"] = saved.damaged
            where = (f"  (batch {row['batch_id']}: kernel batch --resume {row['batch_id']})"
                     if row["batch_id"] else "")
            if saved.damaged is not None:
                where = ("  (checkpoint damaged, not resumable: "
                         f"{output.visible(saved.damaged, layout=False)})")
            print(output.dumps(row) if json_out else
                  f"{ids.short_id(saved.run_id)}  {row['kind'] or '?':8} "
                  f"steps={row['steps']:<4} "
                  f"{output.visible(str(row['name'] or ''), layout=False)}{where}")
        if not runs and not json_out:
            print("no interrupted runs", file=sys.stderr)
        raise typer.Exit(1 if damaged else 0)
    _leave_damaged(damaged, json_out=json_out)
    _leave_to_batches(runs, batch_of, json_out=json_out)
    worst = 1 if damaged else 0
    # A batch's runs: its batch resumes them; a damaged one: nothing to resume from.
    mine = [r for r in runs if r.run_id not in batch_of and r.damaged is None]
    for n, listed in enumerate(mine):
        try:
            claimed = rec.claim(listed.run_id)
        except AuditError as exc:
            print(f"kernel: run {ids.short_id(listed.run_id)}: {exc}", file=sys.stderr)
            worst = 1
            continue
        if claimed is None:
            continue  # another recoverer holds it (or finished it meanwhile)
        code, halted = _resume_one(rec, claimed, json_out=json_out)
        worst = worst or (1 if code else 0)
        if halted:
            # Ctrl-C (or a shutdown's SIGTERM) stopped the run being resumed: whoever sent
            # it did not mean the next interrupted run to start. The rest stay interrupted.
            left = len(mine) - n - 1
            if _still_interrupted(rec, listed.run_id):  # a shutdown's: it resumes too
                left += 1
            if left:
                print(f"kernel: recover stopped: run {ids.short_id(listed.run_id)} was "
                      f"cancelled; {left} interrupted run(s) left to resume "
                      "(`kernel recover` resumes them)", file=sys.stderr)
            break
    raise typer.Exit(worst)


def _still_interrupted(rec: Recovery, run_id: str) -> bool:
    """Whether `run_id` is resumable again (cancelled by a shutdown, not by Ctrl-C)."""
    try:
        saved = rec.checkpointer.load(run_id)
    except Exception:  # (only a count in a message depends on it)
        return False
    return saved is not None and saved.status == "running"


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
        rec = _recovery(db, json_out=json_out, context=context, webhooks=webhook,
                        base_url=base_url, redact=redact)
        waiting = _interrupted(rec)
        known: list[SavedRun] = []
        if want == ids.LAST:  # the newest interrupted run
            matches = waiting[-1:]
            if not matches:
                _fail("no interrupted run: 'last' names nothing")
        else:
            known = [r for r in rec.checkpointer.find("") if ids.matches(r.run_id, want)]
            # An id given whole names that run, even if it prefixes another's
            # (`job-1` is not the interrupted `job-10`).
            exact = [r for r in known if r.run_id in (run_id, run_id.strip())]
            if exact:
                known = exact[:1]
            named = {r.run_id for r in known}
            matches = [r for r in waiting if r.run_id in named]
        if not matches:
            if not known:
                _fail(f"no run {run_id!r} with a checkpoint")
            # Several runs: refused naming them, as `kernel show` does (never a guess).
            full = ids.pick(run_id, [r.run_id for r in known])
            saved = next(r for r in known if r.run_id == full)
            status = _run_status(rec, saved)
            if status != "running":
                _fail(f"run {ids.short_id(saved.run_id)} ended {status}; nothing to resume")
            else:
                _fail(f"run {ids.short_id(saved.run_id)} is still running (pid {saved.pid} on "
                      f"{saved.host})")
        if len(matches) > 1:  # one named exactly wins; else refused naming the candidates
            picked = ids.pick(run_id, [r.run_id for r in matches])
            matches = [r for r in matches if r.run_id == picked]
        if matches[0].damaged is not None:  # nothing to resume from: left as it is
            from batteries.checkpoint import damaged_text

            _fail(damaged_text(f"the checkpoint of run {ids.short_id(matches[0].run_id)}",
                               matches[0].damaged))
        owner = rec.batch_of(matches[0])
        if owner is not None:  # never claimed: its batch resumes it
            from batteries.recovery import batch_refusal

            _fail(f"run {ids.short_id(matches[0].run_id)} {batch_refusal(owner)}")
        claimed = rec.claim(matches[0].run_id)
        if claimed is None:
            _fail(f"run {ids.short_id(matches[0].run_id)} is being resumed by another process")
    except (AuditError, ConfigError) as exc:
        _fail(str(exc))
    assert claimed is not None  # _fail raised otherwise
    raise typer.Exit(_resume_one(rec, claimed, json_out=json_out)[0])


def _ended_status(rec: Recovery, run_id: str) -> str | None:
    """The status the run's last `run_end` event recorded, or None if it never ended."""
    ends = rec.checkpointer.store.payloads(run_id, "run_end")
    for text in reversed(ends):
        try:
            doc = json.loads(text)
        except (TypeError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("status"):
            return str(doc["status"])
    return None


def _interrupted(rec: Recovery) -> list[SavedRun]:
    """The runs to resume: `Recovery.interrupted`, less plain commands that ended.

    A loop or agent run cancelled by a shutdown (SIGTERM) ends `cancelled` and
    keeps its checkpoint, to be resumed. A plain command has nothing to
    resume: if it ended with a status (a SIGTERM'd `kernel run -- CMD`), it
    is not interrupted and is left as it ended, never marked `lost`.
    """
    return [r for r in rec.interrupted()
            if not ((r.spec.get("agent") or {}).get("kind") == "command"
                    and _ended_status(rec, r.run_id) is not None)]


def _leave_damaged(damaged: list[SavedRun], *, json_out: bool) -> None:
    """Name each interrupted run whose checkpoint cannot be read, in one line on stderr
    (with --json, also one not-resumed document per run); they are left as they are."""
    from batteries.recovery import damaged_refusal

    for saved in damaged:
        assert saved.damaged is not None
        why = damaged_refusal(saved.damaged)
        if json_out:
            output.print_doc({"run_id": saved.run_id, "short_id": ids.short_id(saved.run_id),
                              "resumed": False, "status": "running", "reason": why,
                              "steps": saved.checkpoint.steps, "damaged": True})
        print(f"kernel: run {ids.short_id(saved.run_id)}: {output.visible(why, layout=False)}",
              file=sys.stderr)


def _leave_to_batches(runs: list[SavedRun], batch_of: dict[str, str], *,
                      json_out: bool) -> None:
    """Say which interrupted runs are left to their batch (one line per batch on stderr;
    with --json, one not-resumed document per run, as for a run that was not resumed)."""
    from collections import Counter

    from batteries.recovery import batch_refusal

    for saved in runs:
        if json_out and saved.run_id in batch_of:
            output.print_doc({"run_id": saved.run_id, "short_id": ids.short_id(saved.run_id),
                              "resumed": False, "status": "running",
                              "reason": batch_refusal(batch_of[saved.run_id]),
                              "steps": saved.checkpoint.steps,
                              "batch_id": batch_of[saved.run_id]})
    for batch_id, n in Counter(batch_of.values()).items():
        print(f"kernel: batch {batch_id}: {n} interrupted run(s) left to the batch, which "
              f"resumes them: kernel batch --resume {batch_id}", file=sys.stderr)


def _run_status(rec: Recovery, saved: SavedRun) -> str:
    """The run's status in the words of `kernel runs` (not its checkpoint's)."""
    ended = _ended_status(rec, saved.run_id)
    if ended is not None:
        return ended
    return {"running": "running", "failed": "lost"}.get(saved.status, saved.status)


#: The option that gives back each field a stored spec lost to redaction.
_FLAGS = {"ports.webhooks": "--webhook URL", "agent.base_url": "--base-url URL"}


def give_back(missing: tuple[str, ...]) -> str:
    """The options that give back the fields a spec lost to redaction (`Resumed.missing`)."""
    return " ".join(f"--context {f.rsplit('.', 1)[1]}=..." if f.startswith("agent.context.")
                    else _FLAGS.get(f, f) for f in missing)


def stop_leftovers(run_id: str, *, db: str | None) -> None:
    """Stop what an interrupted run left running (`batteries.recovery.stop_leftovers`),
    saying so on stderr."""
    from adapters import stop_leftover_group
    from batteries.recovery import stop_leftovers as stop
    from kernel import AuditError

    short = ids.short_id(run_id)
    try:
        stopped = stop(db, run_id, stop_leftover_group)
    except AuditError as exc:
        print(f"kernel: warning: run {short}: {exc}", file=sys.stderr)
        return
    if stopped:
        print(f"kernel: run {short}: stopped {stopped} process(es) it left running",
              file=sys.stderr)


def _resume_one(rec: Recovery, saved: SavedRun, *, json_out: bool) -> tuple[int, bool]:
    """Stop what the run left running, rebuild it and resume it.

    Returns its exit code, and whether it was stopped from outside
    (`Recovery.halted`: Ctrl-C, SIGTERM), which ends a `kernel recover` there.
    """
    import trio

    from batteries.recovery import Resumed
    from kernel import LoopSpec

    short = ids.short_id(saved.run_id)
    stop_leftovers(saved.run_id, db=rec.db)
    got = rec.prepare(saved)
    if isinstance(got, Resumed):
        if json_out:  # one document per run, as a resumed run's result
            doc: dict[str, object] = {
                "run_id": saved.run_id, "short_id": short, "resumed": False,
                "status": "lost" if got.lost is not None else "running",
                "reason": got.why, "steps": saved.checkpoint.steps}
            if got.missing:
                doc["give"] = give_back(got.missing)
            output.print_doc(doc)
        return _not_resumed(got, short), False
    print(f"kernel: resuming run {short} from step {saved.checkpoint.steps}", file=sys.stderr)
    journals: list[Any] = []
    result = trio.run(partial(_execute, got.spec, got.agent, resume=saved.checkpoint,
                              redactor=got.redactor, journals=journals))
    code = exit_code(result, command=False)
    echoed = not json_out and isinstance(got.spec.agent, LoopSpec)
    code = _report(result, code, json_out=json_out, echo_output=not echoed,
                   storage=_storage(journals), notes=journal_notes(journals))
    return code, rec.halted(result)


def _not_resumed(got: Resumed, short: str) -> int:
    """Say why a run was not resumed: `lost`'s exit code (6) if it is lost for good, 2 if
    it stays resumable."""
    from kernel import Status

    for note in got.notes:
        print(f"kernel: warning: run {short}: {note}", file=sys.stderr)
    if got.lost is not None:
        print(f"kernel: run {short} cannot resume: {got.lost}; run it again with `kernel run`; "
              f"marked {Status.LOST}", file=sys.stderr)
        return Status.LOST.exit_code
    if got.missing:
        print(f"kernel: run {short} cannot resume: {got.refused}; give them again: "
              f"kernel resume {short} {give_back(got.missing)}", file=sys.stderr)
    else:
        print(f"kernel: run {short} {got.refused}", file=sys.stderr)
    return 2
