"""Recover interrupted runs: what `kernel recover` and `kernel resume` do, for any host.

    from adapters import agent_from_spec, stop_leftover_group
    from batteries.recovery import Recovery
    from batteries.runner import SignalPolicy

    recovery = Recovery("k.duckdb", build=lambda spec: agent_from_spec(spec).agent,
                        stop_group=stop_leftover_group)
    for outcome in await recovery.recover(signals=SignalPolicy()):
        print(outcome.run_id, outcome.result.status if outcome.result else outcome.why)

Step by step (what `kernel resume` does, printing as it goes): `claim`,
`stop_leftovers`, `prepare` (a `Prepared` run, or a `Resumed` saying why
not), then `run_spec(prepared.spec, prepared.agent, resume=...)`.

Every run `run_spec` starts registers its spec; the kernel saves the
agent's resumable state after every step. A run whose process is provably
gone while its checkpoint still says `running` (SIGKILL, a crash, SIGTERM
at shutdown) is *interrupted*. Resuming one takes its lease (one journal
transaction; refused while its holder may be alive, so two recoverers
never resume the same run), stops any process group it left running,
gives its secrets back (`Secrets`), rebuilds its agent from the spec with
the host's `build`, and resumes it under the same run id from its last
checkpoint. A run that can never resume (a plain command, an agent that
keeps no state, a secret in its command or prompt) is closed `lost`.

A run whose checkpoint row cannot be read (its spec or state is not JSON: a
damaged disk, a hand edit) is never resumed and never blocks the others: it
is reported by its id (a `Resumed` refused, `damaged`) and left exactly as it
is, unclaimed, its row untouched: a row a person can repair (a hand edit
undone) resumes then, and marking it `failed`/`lost` would drop the state
that a repair needs. It stays interrupted, so every recovery names it again.

A run of a stored batch (`kernel batch`: its spec names the batch, which
the store still keeps) is its batch's: the batch resumes it (`kernel batch
--resume ID`; a plain command runs again from the start there), so recovery
neither resumes it nor closes it `lost`, in whatever order the two come
(`batch_of`; `prepare` refuses it, giving its lease back).

Batteries never import adapters, so the two things only adapters know
come in as parameters: `build` (a spec -> its agent, e.g.
`adapters.agent_from_spec(spec).agent`) and `stop_group` (a recorded
process group -> how many processes were stopped, e.g.
`adapters.stop_leftover_group`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from kernel import (
    Agent,
    AgentSpec,
    AuditError,
    Checkpoint,
    ConfigError,
    KernelError,
    LoopSpec,
    Result,
    RunSpec,
    Status,
)

from .checkpoint import JournalCheckpointer
from .redact import Redactor
from .runner import RunControl, SignalPolicy, run_spec
from .store import RunStore, SavedRun

__all__ = ["NotResumable", "Prepared", "Recovery", "Resumed", "Secrets", "SpecRunner",
           "batch_refusal", "damaged_refusal", "restore_secrets", "stop_leftovers"]


@dataclass(frozen=True, slots=True)
class Secrets:
    """Values a stored spec lost to redaction, given back to resume it.

    Attributes:
        context: Secret context values (by key).
        webhooks: Webhook URLs to deliver to instead of the stored ones.
        base_url: The API base URL, when the stored one held a password.
    """

    context: Mapping[str, str] = field(default_factory=dict)
    webhooks: tuple[str, ...] = ()
    base_url: str | None = None


@dataclass(frozen=True, slots=True)
class Resumed:
    """What became of one interrupted run.

    Exactly one of `result` (it was resumed and ended with this result),
    `lost` (it can never resume and was closed `lost`: why) and `refused`
    (not resumed now, still resumable: why) is set.

    Attributes:
        run_id: The run.
        spec: Its spec with the secrets given back (None if it could not be read).
        steps: The steps its checkpoint had when it was picked up.
        stopped: Processes it had left running that were stopped first.
        missing: With `refused`: the spec fields whose secrets must be given
            back (`agent.context.KEY`, `ports.webhooks`, `agent.base_url`).
        notes: Warnings along the way (a `lost` mark that could not be written).
        damaged: With `refused`: its checkpoint row cannot be read (`damaged_refusal`);
            it was not claimed and is left as it is.
    """

    run_id: str
    steps: int = 0
    spec: RunSpec | None = None
    result: Result | None = None
    lost: str | None = None
    refused: str | None = None
    stopped: int = 0
    missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    damaged: bool = False

    @property
    def why(self) -> str | None:
        """Why it was not resumed (`lost` or `refused`), or None."""
        return self.lost or self.refused


def batch_refusal(batch_id: str) -> str:
    """Why a run of a stored batch is not recovered on its own (`Resumed.refused`)."""
    return (f"belongs to batch {batch_id}, which resumes it: "
            f"kernel batch --resume {batch_id}")


def damaged_refusal(why: str) -> str:
    """Why a run whose checkpoint row cannot be read is not resumed (`Resumed.refused`);
    `why` is `SavedRun.damaged`."""
    return (f"its checkpoint is damaged and cannot be read ({why}); not resumed, "
            "left as it is")


class SpecRunner(Protocol):
    """How a resumed run is run (default: `run_spec`)."""

    def __call__(self, spec: RunSpec, agent: Agent, *, resume: Checkpoint | None,
                 redactor: Redactor | None) -> Awaitable[Result]:
        """Run `agent` for `spec` from `resume`; its result."""


class NotResumable(KernelError):
    """A stored spec held a secret where nothing can give it back: the run can never resume."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claimed run rebuilt and ready to resume (`Recovery.prepare`)."""

    saved: SavedRun
    spec: RunSpec
    agent: Agent
    redactor: Redactor


def restore_secrets(spec: RunSpec, secrets: Secrets) -> tuple[RunSpec, tuple[str, ...]]:
    """The spec with `secrets` put back, and the redacted fields still missing.

    Raises:
        NotResumable: A redacted value sits where no secret can be given back
            (the command, the prompt, the loop path): the run can never resume.
    """
    what = spec.agent
    context = {**what.context, **secrets.context}
    if secrets.context:
        what = dataclasses.replace(what, context=context)
    if secrets.base_url is not None and isinstance(what, (LoopSpec, AgentSpec)):
        what = dataclasses.replace(what, base_url=secrets.base_url)
    ports = spec.ports
    if secrets.webhooks:
        ports = dataclasses.replace(ports, webhooks=tuple(secrets.webhooks))
    missing: list[str] = []
    for path in spec.redacted:
        where = list(path)
        if where[:2] == ["agent", "context"] and len(where) == 3:
            if where[2] not in secrets.context:
                missing.append(f"agent.context.{where[2]}")
        elif where[:2] == ["ports", "webhooks"]:
            if not secrets.webhooks and "ports.webhooks" not in missing:
                missing.append("ports.webhooks")
        elif where == ["agent", "base_url"]:
            if secrets.base_url is None:
                missing.append("agent.base_url")
        else:
            name = ".".join(str(p) for p in where)
            raise NotResumable(f"its {name} held a secret, which is not stored")
    return dataclasses.replace(spec, agent=what, ports=ports), tuple(missing)


def stop_leftovers(db: str | os.PathLike[str] | None, run_id: str,
                   stop_group: Callable[[Mapping[str, Any]], int]) -> int:
    """Stop every recorded process group of a run that is still alive; how many processes.

    Call it once the run's supervisor is known to be gone (its lease claimed),
    before the run resumes or is closed. Normally there is none (the lifeline
    watcher killed them when the supervisor died); this covers a watcher that
    was killed too. The groups are the run's `process_start` events, read
    from the store runs write to (the journal, without getting in a writer's
    way, or PostgreSQL); `stop_group` is `adapters.stop_leftover_group`.

    The child runs it left open (a sub-loop in flight: a `child_start` with no
    `child_end`, and theirs in turn) died with it: their groups are stopped
    too, and their rows closed `lost`. A child run is never resumed on its own
    (it keeps no checkpoint): a resumed parent runs the state that started it
    again, with a new child run.

    Raises:
        AuditError: The store cannot be read (or an orphan cannot be closed).
    """
    from batteries.audit import queries
    from batteries.store import LoseRun, open_store

    try:
        store = open_store(db)
        try:
            groups = queries.process_groups_from(store.payloads(run_id, "process_start"))
            orphans = _open_children(store, run_id)
            for child in orphans:
                groups += queries.process_groups_from(store.payloads(child, "process_start"))
            stopped = sum(stop_group(g) for g in groups)
            if orphans:
                why = (f"its parent run {run_id} was interrupted (its supervisor is gone); "
                       "a child run is not resumed on its own: a resumed parent starts "
                       "the state again with a new child run")
                store.commit(None, [LoseRun(child, why) for child in orphans])
        finally:
            store.close()
    except KernelError as exc:
        raise AuditError(f"cannot read its processes or close its child runs: {exc}") from exc
    return stopped


def _open_children(store: RunStore, run_id: str) -> list[str]:
    """The child runs `run_id` started and saw no end of, and theirs, depth first."""
    found: list[str] = []
    todo = [run_id]
    while todo:
        parent = todo.pop()
        ended = set(_child_ids(store.payloads(parent, "child_end")))
        for child in _child_ids(store.payloads(parent, "child_start")):
            if child not in ended and child not in found and child != run_id:
                found.append(child)
                todo.append(child)
    return found


def _child_ids(payloads: Iterable[Any]) -> list[str]:
    """The `child_run_id`s of `child_start`/`child_end` payloads (JSON text or decoded)."""
    import json

    out: list[str] = []
    for payload in payloads:
        doc = payload
        if isinstance(payload, (str, bytes)):
            try:
                doc = json.loads(payload)
            except ValueError:
                continue
        child = doc.get("child_run_id") if isinstance(doc, Mapping) else None
        if isinstance(child, str) and child:
            out.append(child)
    return out


class Recovery:
    """Find, claim and resume interrupted runs in one store.

    Args:
        db: The analysts' file (its journal beside it); None: the default
            (`$KERNEL_DB`, then `~/.kernel/kernel.duckdb`).
        build: A spec -> its agent (`adapters.agent_from_spec(spec).agent`);
            a `ConfigError` from it refuses the run (it stays resumable).
        stop_group: A recorded process group -> how many of its processes
            it stopped (`adapters.stop_leftover_group`); it must wait until
            they are gone.
        secrets: Secret values to give back to the runs resumed.
        redact: Extra patterns to redact from everything stored.
        key_values: A spec -> secret values its agent will hold, redacted by
            value from everything the resumed run stores whatever their
            variables are called (`adapters.specs.spec_secrets`: an API key).

    `interrupted`, `claim`, `load` and `stop_leftovers` block (SQLite, a
    wait for processes); `resume` and `recover` run them in worker threads.
    """

    def __init__(self, db: str | os.PathLike[str] | None, *,
                 build: Callable[[RunSpec], Agent],
                 stop_group: Callable[[Mapping[str, Any]], int],
                 secrets: Secrets | None = None, redact: Iterable[str] = (),
                 key_values: Callable[[RunSpec], Iterable[str]] | None = None) -> None:
        from batteries.audit import resolve_db_path

        self.db = str(resolve_db_path(None if db is None else os.fspath(db)))
        self.build = build
        self.stop_group = stop_group
        self.secrets = secrets or Secrets()
        self.redact = tuple(redact)
        self.key_values = key_values
        self.checkpointer = JournalCheckpointer(self.db)

    def __repr__(self) -> str:
        return f"Recovery({self.db!r})"

    # ---------------------------------------------------------------- blocking

    def interrupted(self) -> list[SavedRun]:
        """Runs whose holder is provably gone while they are `running`, oldest first; one
        whose row cannot be read is among them, flagged (`SavedRun.damaged`)."""
        return self.checkpointer.interrupted()

    def claim(self, run_id: str) -> SavedRun | None:
        """Take the run's lease; its checkpoint as of now (None if another process holds it)."""
        if not self.checkpointer.claim(run_id):
            return None
        # Reload: a recoverer that held it before may have moved it on before dying.
        return self.checkpointer.load(run_id)

    def stop_leftovers(self, run_id: str) -> int:
        """`stop_leftovers` for one of this store's runs, with this recovery's `stop_group`.

        Raises:
            AuditError: The store cannot be read.
        """
        return stop_leftovers(self.db, run_id, self.stop_group)

    def batch_of(self, saved: SavedRun) -> str | None:
        """The id of the stored batch this run is a task of (the batch resumes it), or None.

        The run's spec names its batch (`kernel batch` writes `"batch":
        {"batch_id": ...}` into every task's spec); a batch the store no longer
        keeps (purged), or a store without batches, leaves the run to recovery.
        A store that cannot be read is taken to keep it (never a guess that
        closes a batch's run `lost`).
        """
        found = saved.spec.get("batch")
        batch_id = found.get("batch_id") if isinstance(found, Mapping) else None
        if not isinstance(batch_id, str) or not batch_id:
            return None
        batches = getattr(self.checkpointer.store, "batches", None)
        if not callable(batches):
            return None
        try:
            return batch_id if batches(batch_id=batch_id) else None
        except KernelError:
            return batch_id

    def halted(self, result: Result) -> bool:
        """Whether a resumed run was stopped from outside, so a recovery of many stops there.

        A run cancelled by a signal (Ctrl-C: final; SIGTERM, SIGHUP, SIGQUIT: a
        shutdown) or by its host keeps its checkpoint `running` (resumable) or
        has it failed (final): the person or the shutdown that stopped it did
        not mean the next interrupted run to start. A run whose agent stopped
        itself (a loop's `LOOP_STOP`, an action killed by a signal) also ends
        `cancelled`, but its checkpoint is `completed`: that run is over by its
        own doing, and the recovery goes on. A checkpoint that cannot be read
        counts as stopped from outside (stopping leaves the rest interrupted,
        to resume later; going on might start runs nobody wants now).
        """
        if result.status is not Status.CANCELLED:
            return False
        try:
            saved = self.checkpointer.load(result.run_id)
        except KernelError:
            return True
        return saved is None or saved.status != "completed"

    def prepare(self, saved: SavedRun) -> Prepared | Resumed:
        """Rebuild a claimed run for resuming; a `Resumed` saying why not when it cannot be.

        Reads the spec, gives its secrets back, builds the agent with
        `build`. A run that can never resume is closed `lost` here; one
        refused for now (secrets missing, a build error, a run its batch
        resumes: `batch_of`) has its lease given back, so it is interrupted
        again. Call `stop_leftovers` first (`resume` does).
        """
        batch_id = self.batch_of(saved)
        if batch_id is not None:
            return self._refuse(saved, batch_refusal(batch_id))
        if (saved.spec.get("agent") or {}).get("kind") == "command":
            return self._lose(saved, "a plain command has no resumable state")
        try:
            spec = RunSpec.from_dict(saved.spec)
        except ConfigError as exc:
            return self._refuse(saved, f"cannot be rebuilt: {exc}")
        try:
            spec, missing = restore_secrets(spec, self.secrets)
        except NotResumable as exc:
            return self._lose(saved, str(exc), spec)
        if missing:
            return self._refuse(saved, "its secrets are not stored", spec, missing)
        try:
            if spec.ports.webhooks:
                from batteries.delivery import check_webhook_url

                for url in spec.ports.webhooks:  # stored by a version that took it
                    check_webhook_url(url)
            redactor = Redactor.from_env(context=spec.agent.context, patterns=self.redact)
            if self.key_values is not None:  # its API key, by value
                redactor = redactor.with_secrets(self.key_values(spec))
            agent = self.build(spec)
        except ConfigError as exc:
            return self._refuse(saved, f"cannot be rebuilt: {exc}", spec)
        if not callable(getattr(agent, "snapshot", None)):
            return self._lose(saved, f"a {type(agent).__name__} keeps no resumable state", spec)
        return Prepared(saved, spec, agent, redactor)

    def _refuse(self, saved: SavedRun, why: str, spec: RunSpec | None = None,
                missing: tuple[str, ...] = ()) -> Resumed:
        """Not now: give the lease back, so the run is interrupted again for the next try."""
        notes: tuple[str, ...] = ()
        try:
            self.checkpointer.release(saved.run_id)
        except AuditError as exc:
            notes = (f"cannot give its lease back: {exc}",)
        return Resumed(saved.run_id, saved.checkpoint.steps, spec=spec, refused=why,
                       missing=missing, notes=notes)

    def _lose(self, saved: SavedRun, why: str, spec: RunSpec | None = None) -> Resumed:
        notes: tuple[str, ...] = ()
        try:
            self.checkpointer.mark_lost(saved, why)
        except AuditError as exc:
            notes = (f"cannot mark it lost: {exc}",)
        return Resumed(saved.run_id, saved.checkpoint.steps, spec=spec, lost=why, notes=notes)

    # ------------------------------------------------------------------- async

    async def resume(self, saved: SavedRun, *, signals: SignalPolicy | None = None,
                     control: RunControl | None = None,
                     run: SpecRunner | None = None) -> Resumed:
        """Resume one claimed run (see `claim`) from its checkpoint, under its own run id.

        Stops what it left running, rebuilds it (`prepare`), and runs it with
        `run_spec` (`signals`, `control` as there) or with `run`.
        """
        notes: tuple[str, ...] = ()
        try:
            stopped = await trio.to_thread.run_sync(self.stop_leftovers, saved.run_id)
        except AuditError as exc:
            stopped, notes = 0, (str(exc),)
        got = await trio.to_thread.run_sync(self.prepare, saved)
        if isinstance(got, Resumed):
            return dataclasses.replace(got, stopped=stopped, notes=notes + got.notes)
        if run is None:
            result = await run_spec(got.spec, got.agent, resume=saved.checkpoint,
                                    redactor=got.redactor, signals=signals, control=control)
        else:
            result = await run(got.spec, got.agent, resume=saved.checkpoint,
                               redactor=got.redactor)
        return Resumed(saved.run_id, saved.checkpoint.steps, spec=got.spec, result=result,
                       stopped=stopped, notes=notes)

    async def recover(self, *, signals: SignalPolicy | None = None,
                      run: SpecRunner | None = None,
                      on_done: Callable[[Resumed], None] | None = None) -> list[Resumed]:
        """Resume every interrupted run this process can claim, one after another.

        A run another recoverer holds (or finished meanwhile) is skipped, so
        several processes may recover one store at once and each run is
        resumed by exactly one of them. A run of a stored batch is left to
        its batch, untouched (a `Resumed` refused, saying which batch). A run
        whose checkpoint row cannot be read is neither claimed nor touched (a
        `Resumed` refused and `damaged`, saying why); the others go on. A run
        cancelled from outside (a signal under `signals`: see `halted`) stops
        the recovery there; the runs not reached stay interrupted. A run whose
        agent stopped itself (`cancelled` too, but over) does not.
        """
        done: list[Resumed] = []
        for listed in await trio.to_thread.run_sync(self.interrupted):
            if listed.damaged is not None:  # nothing to resume from: reported, left as is
                outcome = Resumed(listed.run_id, listed.checkpoint.steps,
                                  refused=damaged_refusal(listed.damaged), damaged=True)
                done.append(outcome)
                if on_done is not None:
                    on_done(outcome)
                continue
            batch_id = await trio.to_thread.run_sync(self.batch_of, listed)
            if batch_id is not None:  # its batch resumes it: not claimed, left as it is
                outcome = Resumed(listed.run_id, listed.checkpoint.steps,
                                  refused=batch_refusal(batch_id))
                done.append(outcome)
                if on_done is not None:
                    on_done(outcome)
                continue
            try:
                saved = await trio.to_thread.run_sync(self.claim, listed.run_id)
            except AuditError as exc:
                outcome = Resumed(listed.run_id, listed.checkpoint.steps,
                                  refused=f"cannot be claimed: {exc}")
            else:
                if saved is None:
                    continue  # another recoverer holds it (or finished it meanwhile)
                outcome = await self.resume(saved, signals=signals, run=run)
            done.append(outcome)
            if on_done is not None:
                on_done(outcome)
            if outcome.result is not None and await trio.to_thread.run_sync(
                    self.halted, outcome.result):
                break
        return done
