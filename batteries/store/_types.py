"""The values that cross the storage interface: batches, operations, owners, rows.

Everything here is plain data: a second implementation of `RunStore`
(PostgreSQL, for a fleet) receives exactly these objects and interprets
them in its own SQL.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, replace
from typing import Any, Protocol

from kernel import AuditError, Checkpoint, Usage, UsageLimits
from kernel._dataclass import dataclass


class StoreError(AuditError):
    """The journal could not be opened, read or written."""


class StoreBusyError(StoreError):
    """The journal stayed write-locked by other processes for longer than the lock timeout."""


# ------------------------------------------------------------------ owners


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time (clock ticks since boot) of process `pid` (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[19])  # fields 3 and 22 of the whole line
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def _proc_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


@dataclass(slots=True, frozen=True)
class Owner:
    """A process that may hold a run: host, pid, and the pid's start time (pid reuse)."""

    host: str
    pid: int
    started: int | None

    @classmethod
    def me(cls) -> Owner:
        """This process."""
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _proc_start(pid))

    def gone(self) -> bool:
        """True only when this owner is provably not running any more.

        On this host: the pid does not exist, it is a zombie (dead, not yet
        reaped: a process whose parent died with it, under a pid 1 that does
        not reap), or it exists but started at a different time (a recycled
        pid). On another host nothing can be proved from here, so the answer
        is False, unless the owner is nobody (pid 0: a released lease).
        """
        if self.pid <= 0:
            return True
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        stat = _proc_stat(self.pid)
        if stat is not None and stat[0] in ("Z", "X"):
            return True
        if self.started is None:
            return False
        return stat is not None and stat[1] != self.started


# ----------------------------------------------------------------- batches


class RecorderRef(Protocol):
    """What the store needs from an audit recorder: the run, and where its seq starts."""

    run_id: str
    info: Any
    started_us: int
    count: int
    base: int | None
    host: str
    pid: int


@dataclass(slots=True, eq=False)
class Batch:
    """Audit rows buffered on the trio thread, written whole by one transaction.

    Events are column lists (one list append per column is the cheapest
    thing the hot path can do): `recs[i]` is the recorder of event `i` and
    `seqs[i]` its seq *relative to that recorder*. The store resolves the
    absolute seq inside the transaction: 1 + relative for a new run (after
    its `run_start` at 0), last seq + 1 + relative for a resumed one, and
    then sets each new recorder's `base`.
    """

    recs: list[Any] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    ts: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    iters: list[int | None] = field(default_factory=list)
    names: list[str | None] = field(default_factory=list)
    durs: list[float | None] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)
    new: list[Any] = field(default_factory=list)
    closes: list[tuple[Any, tuple[Any, ...]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.recs)

    def empty(self) -> bool:
        """True when there is nothing to write."""
        return not (self.recs or self.new or self.closes)

    def extend(self, other: Batch) -> None:
        """Append `other`'s rows after this batch's."""
        self.recs += other.recs
        self.seqs += other.seqs
        self.ts += other.ts
        self.kinds += other.kinds
        self.iters += other.iters
        self.names += other.names
        self.durs += other.durs
        self.payloads += other.payloads
        self.new += other.new
        self.closes += other.closes


# -------------------------------------------------------------- operations
# One transaction writes the pending audit batch and then a list of these,
# in order. Each returns a value (see `RunStore.commit`).


@dataclass(slots=True, frozen=True)
class RegisterRun:
    """Record a run's spec before it starts; the run is `running`, owned by `owner`."""

    run_id: str
    spec: dict[str, Any]
    owner: Owner


@dataclass(slots=True, frozen=True)
class SaveCheckpoint:
    """Store a run's resumable state (and refresh its owner's heartbeat).

    Returns True; raises `StoreError` if the run was never registered and
    `spec` is None (a save must not vanish silently).

    `state_json` is the state as the store keeps it, already encoded as JSON
    (and redacted) by the caller: the store then writes it as given and never
    reads `checkpoint.state`. None: the store encodes `checkpoint.state`.
    """

    checkpoint: Checkpoint
    owner: Owner
    spec: dict[str, Any] | None = None
    state_json: str | None = None


@dataclass(slots=True, frozen=True)
class FinishRun:
    """Mark a registered run `completed` or `failed` and drop its state."""

    run_id: str
    status: str
    error: str | None = None


@dataclass(slots=True, frozen=True)
class LoseRun:
    """Close a run whose supervisor is gone and that cannot resume: status `lost`.

    Closes the run's open row; a run killed before its first audit write has
    no row, and one is made from `info` (the run spec's RunInfo fields) so
    that `kernel runs` shows it. Returns True if a row was closed or made.
    """

    run_id: str
    why: str
    info: Mapping[str, Any] | None = None
    started_us: int | None = None


@dataclass(slots=True, frozen=True)
class ClaimRun:
    """Take over an interrupted run for recovery: True if the lease is now `owner`'s.

    Refused (False) while the current owner may still be alive, or when the
    run is no longer `running`.

    `gone` is a holder the caller has proof of death for that this machine
    cannot check itself: a process on another host, reported dead by a
    cluster manager that ran it (Ray reports the worker or node that ran a
    task as dead). The claim then also succeeds when the run's holder is
    exactly `gone` (host, pid and start time), re-checked in the same
    transaction, so a holder that changed since the proof was taken (another
    recoverer claimed it) is never taken over.
    """

    run_id: str
    owner: Owner
    gone: Owner | None = None


@dataclass(slots=True, frozen=True)
class ReleaseRun:
    """Give a claimed run back (its owner becomes nobody, so the next recoverer may claim it)."""

    run_id: str
    owner: Owner


@dataclass(slots=True, frozen=True)
class ReserveBudget:
    """Check the caller's budget and, if it allows one more run, reserve it.

    Returns a `Reservation`, or None when no budget applies (nothing written).
    A *resumed* run (`resumed=True`) was admitted when it first opened: it is
    never refused, and its own reservation (the newest row for its `run_id`
    in the budget's window) is handed back instead of a new one, with the budget's tokens and cost
    counted without that row (the run's usage carries them over the resume;
    its runtime stays counted, since runtime is settled per session). Only if
    it has no row (e.g. the budget was set after it opened) is one made.
    """

    caller_id: str
    run_id: str
    resumed: bool = False


@dataclass(slots=True, frozen=True)
class SettleBudget:
    """Settle a reservation with what the run spent.

    `runtime_seconds` is one session's and is added; `tokens` and `cost_usd`
    are the run's totals so far (carried over a resume) and replace the
    row's when larger. A fresh reservation's spend is zero, so for a run
    that never resumed this is what it spent.
    """

    reservation_id: int
    runtime_seconds: float
    tokens: int
    cost_usd: float


@dataclass(slots=True, frozen=True)
class SetBudget:
    """Create or replace a caller's budget."""

    caller_id: str
    window_seconds: float
    max_runs: int | None
    max_runtime_seconds: float | None
    max_tokens: int | None
    max_cost_usd: float | None


@dataclass(slots=True, frozen=True)
class RemoveBudget:
    """Delete a caller's budget; returns True if there was one."""

    caller_id: str


@dataclass(slots=True, frozen=True)
class BatchTask:
    """One task of a batch: its id in the batch, the run it becomes, and its run spec."""

    task_id: str
    run_id: str
    spec: dict[str, Any]


@dataclass(slots=True, frozen=True)
class CreateBatch:
    """Record a new batch and all of its tasks, held by `owner` (status `running`).

    Every task is given its run id here, so "which run each task became" is
    known before anything runs and a resumed batch finds each task's run by
    it. Raises `StoreError` (undone alone) if the batch id is taken.
    """

    batch_id: str
    tasks: tuple[BatchTask, ...]
    owner: Owner
    name: str = ""
    source: str = ""
    concurrency: int = 1
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class ClaimBatch:
    """Take over a batch to run (or resume) it: True if its lease is now `owner`'s.

    Refused (False) while the current holder may still be alive (`Owner.gone`).
    """

    batch_id: str
    owner: Owner


@dataclass(slots=True, frozen=True)
class FinishBatch:
    """Mark a batch `finished` (every task ran) and release it; only by its holder."""

    batch_id: str
    owner: Owner


#: `TaskRow.delivery` of a task whose result is owed a delivery: its run was to be
#: delivered (marked before it started) and no delivery of its result has ended yet.
DELIVERY_PENDING = "pending"
#: `TaskRow.delivery` once its result reached every destination.
DELIVERY_DONE = "delivered"
#: `TaskRow.delivery` once a delivery of its result failed (`TaskRow.delivery_error` says how).
DELIVERY_FAILED = "failed"
DELIVERY_STATES = frozenset({DELIVERY_PENDING, DELIVERY_DONE, DELIVERY_FAILED})


@dataclass(slots=True, frozen=True)
class MarkDelivery:
    """Record where the results of tasks of a batch stand, each mark (index, state,
    error): a `DELIVERY_STATES` state, or None (nothing to deliver), and for `failed`
    why (redacted by the caller). Raises `StoreError` (undone alone) for another state."""

    batch_id: str
    marks: tuple[tuple[int, str | None, str | None], ...]


Op = (RegisterRun | SaveCheckpoint | FinishRun | LoseRun | ClaimRun | ReleaseRun
      | ReserveBudget | SettleBudget | SetBudget | RemoveBudget | CreateBatch | ClaimBatch
      | FinishBatch | MarkDelivery)


# -------------------------------------------------------------------- rows


def dollars(amount: float) -> str:
    """An amount of US dollars as people read it: cents from $1 up, else three significant
    digits ($12.50, $0.0125, $0.007), so a small cap and its spend do not both read $0.01."""
    return f"${amount:.2f}" if amount >= 1 or amount == 0 else f"${amount:.3g}"


@dataclass(slots=True, frozen=True)
class CallerBudget:
    """One caller's budget and what they spent (or reserved) in the current window."""

    caller_id: str
    window_seconds: float
    max_runs: int | None
    max_runtime_seconds: float | None
    max_tokens: int | None
    max_cost_usd: float | None
    runs: int = 0
    runtime_seconds: float = 0.0
    tokens: int = 0
    cost_usd: float = 0.0

    def refusal(self) -> str | None:
        """Why a new run must be refused, or None."""
        window = _window_text(self.window_seconds)
        checks: list[tuple[str, float | None, float, Callable[[float], str]]] = [
            ("runs", self.max_runs, self.runs, "{:g}".format),
            ("runtime", self.max_runtime_seconds, self.runtime_seconds, "{:.0f}s".format),
            ("tokens", self.max_tokens, self.tokens, "{:g}".format),
            ("cost", self.max_cost_usd, self.cost_usd, dollars),
        ]
        for what, limit, used, fmt in checks:
            if limit is not None and used >= limit:
                return (f"caller {self.caller_id!r} used {fmt(used)} of "
                        f"{fmt(limit)} {what} {window}")
        return None

    def without(self, tokens: int, cost_usd: float) -> CallerBudget:
        """This budget with one run's tokens and cost taken back out of the spend."""
        return replace(self, tokens=max(self.tokens - tokens, 0),
                       cost_usd=max(self.cost_usd - cost_usd, 0.0))

    def remaining(self) -> UsageLimits:
        """What is left, as caps for the next run."""
        def left(limit: float | None, used: float) -> float | None:
            return None if limit is None else max(limit - used, 0)

        tokens = left(self.max_tokens, self.tokens)
        return UsageLimits(
            max_total_tokens=None if tokens is None else int(tokens),
            max_cost_usd=left(self.max_cost_usd, self.cost_usd),
            max_runtime_seconds=left(self.max_runtime_seconds, self.runtime_seconds),
        )


def window_label(seconds: float) -> str:
    """A budget window as people write it: 90s, 90m, 24h, 7d (whole units), else seconds."""
    if seconds >= 7 * 86400 and seconds % 86400 == 0:
        return f"{seconds / 86400:g}d"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _window_text(seconds: float) -> str:
    return f"in the last {window_label(seconds)}"


@dataclass(slots=True, frozen=True)
class Reservation:
    """The answer to `ReserveBudget`: the budget as checked, and the reserved row (if allowed)."""

    budget: CallerBudget
    reservation_id: int | None


@dataclass(slots=True, frozen=True)
class SavedRun:
    """A registered run: its spec, its last checkpoint, and the process holding it.

    Attributes:
        damaged: Why its row cannot be read (its spec or state is not JSON: a damaged
            disk, a hand edit), when a read asked for such rows flagged instead of
            raising (`RunStore.interrupted`, `saved_runs(damaged=True)`); its `spec` is
            then `{}` if the spec is the damaged part, and its state None. None for a
            row that reads whole.
    """

    run_id: str
    spec: dict[str, Any]
    checkpoint: Checkpoint
    status: str
    owner: Owner
    updated_at: dt.datetime
    heartbeat_at: dt.datetime | None = None
    damaged: str | None = None

    @property
    def host(self) -> str:
        """The host of the process holding the run."""
        return self.owner.host

    @property
    def pid(self) -> int:
        """The pid of the process holding the run."""
        return self.owner.pid

    @property
    def process_alive(self) -> bool:
        """False only when the holder is provably gone (see `Owner.gone`)."""
        return not self.owner.gone()


@dataclass(slots=True, frozen=True)
class BatchRow:
    """A batch as `RunStore.batches` lists it, with its tasks counted by status.

    Attributes:
        status: `running` (held by a live or dead process: see `interrupted`) or `finished`.
        counts: Tasks by their run's status; `pending` (not started) and `running`
            (started, not ended) besides the run statuses.
    """

    batch_id: str
    name: str
    source: str
    created_at: dt.datetime
    ended_at: dt.datetime | None
    status: str
    tasks: int
    concurrency: int
    owner: Owner
    counts: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    #: Tasks whose run ended, by where their result's delivery stands (`TaskRow.delivery`:
    #: `pending`, `delivered`, `failed`); empty when the batch delivers nothing.
    deliveries: dict[str, int] = field(default_factory=dict)

    @property
    def interrupted(self) -> bool:
        """True when the batch is unfinished and its holder is provably gone."""
        return self.status == "running" and self.owner.gone()


@dataclass(slots=True, frozen=True)
class TaskRow:
    """One task of a stored batch and where its run stands.

    Attributes:
        run_status: The run's terminal status; None while it has not ended (or started).
        started: True once the run exists (a run row or a registered checkpoint).
        saved: The run's checkpoint, if it registered one (its lease and state).
        delivery: Where the delivery of its result stands: `pending` (owed: its run was to
            be delivered and no delivery of it has ended), `delivered`, `failed`; None when
            there is nothing to deliver (the batch delivered nothing when it ran).
        delivery_error: Why its delivery failed (`failed`).
        ended: For a task whose run ended and whose result is owed a delivery (`pending`
            or `failed`), its result as the journal's runs row has it (`RESULT_COLUMNS`);
            else None.
    """

    index: int
    task_id: str
    run_id: str
    spec: dict[str, Any]
    run_status: str | None
    started: bool
    saved: SavedRun | None = None
    delivery: str | None = None
    delivery_error: str | None = None
    ended: dict[str, Any] | None = None


#: The runs row's columns `TaskRow.ended` holds: what a result is rebuilt from.
RESULT_COLUMNS = ("name", "output", "error", "reason", "steps", "tool_calls",
                  "runtime_seconds", "input_tokens", "output_tokens", "thinking_tokens",
                  "cost_usd", "exit_code")


# ------------------------------------------------------------------ spills
# What a process could not commit when it exited (the journal locked past the lock
# timeout, the server unreachable) is written to a *spill file* instead of being
# dropped, and the next process that opens the store for writing commits it, exactly
# once (see `Journal._final_flush` and `SQLiteStore.spill`). These are the file's
# contents: every buffered audit row and every operation, as plain JSON.

#: The spill format's name and version (a reader refuses any other: `SpillError`).
SPILL_FORMAT = "kernel-journal-spill"
SPILL_VERSION = 1


class SpillError(StoreError):
    """A spill file that cannot be read back: not JSON, another format or version, or a
    field of the wrong shape (it is moved aside, never replayed in part)."""


@dataclass(slots=True)
class SpilledInfo:
    """The `RunInfo` fields the store writes for a new run (runs row and `run_start`)."""

    name: Any
    subject_id: Any
    caller_id: Any
    channel_id: Any
    parent_run_id: Any
    inputs: Any


@dataclass(slots=True, eq=False)
class SpilledRecorder:
    """A recorder as a spill file keeps it: what the store reads from one (`RecorderRef`).

    Compared (and hashed) by identity, as recorders are: a batch keys them in dicts.
    """

    run_id: str
    info: SpilledInfo
    started_us: int
    count: int
    base: int | None
    host: str
    pid: int


@dataclass(slots=True, frozen=True)
class Spill:
    """A spill file read back: its id (the journal's exactly-once key), the store it was
    written for, and the rows and operations to commit."""

    spill_id: str
    store: str
    batch: Batch
    ops: tuple[Op, ...]
    pid: int = 0
    written_us: int = 0


_OP_TYPES: dict[str, type[Any]] = {cls.__name__: cls for cls in (
    RegisterRun, SaveCheckpoint, FinishRun, LoseRun, ClaimRun, ReleaseRun, ReserveBudget,
    SettleBudget, SetBudget, RemoveBudget, CreateBatch, ClaimBatch, FinishBatch,
    MarkDelivery)}
#: Op fields that hold an `Owner` (or None), a `Checkpoint`, `BatchTask`s, or a JSON object.
_OWNER_FIELDS = frozenset({"owner", "gone"})
_MAPPING_FIELDS = frozenset({"spec", "info", "options"})


def _owner_doc(owner: Owner | None) -> list[Any] | None:
    return None if owner is None else [owner.host, owner.pid, owner.started]


def _op_doc(op: Op) -> dict[str, Any]:
    """One operation as a JSON object: its type's name under `op`, then its fields."""
    from dataclasses import fields

    doc: dict[str, Any] = {"op": type(op).__name__}
    for f in fields(op):
        value = getattr(op, f.name)
        if f.name in _OWNER_FIELDS:
            value = _owner_doc(value)
        elif f.name == "checkpoint":
            cp: Checkpoint = value
            u = cp.usage
            value = {"run_id": cp.run_id, "steps": cp.steps, "state": cp.state,
                     "usage": [u.input_tokens, u.output_tokens, u.thinking_tokens, u.cost_usd],
                     "tool_calls": cp.tool_calls}
        elif f.name == "tasks":
            value = [[t.task_id, t.run_id, t.spec] for t in value]
        elif f.name in _MAPPING_FIELDS and value is not None:
            value = dict(value)
        doc[f.name] = value
    return doc


def encode_spill(batch: Batch, ops: Sequence[Op], *, spill_id: str, store: str) -> str:
    """The spill file's text for `batch` and `ops` (JSON, format `SPILL_VERSION`).

    Recorders are written once each and events refer to them by index, so a
    run's events keep their recorder's seq base (or lack of one: a run whose
    start was never written is written new on replay, as it would have been).
    Values JSON cannot hold are written as their text, as the store would.
    """
    recs: dict[Any, int] = {}
    for rec in (*batch.recs, *batch.new, *(rec for rec, _ in batch.closes)):
        if rec not in recs:
            recs[rec] = len(recs)
    doc = {
        "format": SPILL_FORMAT, "version": SPILL_VERSION, "id": spill_id, "store": store,
        "pid": os.getpid(), "written_us": time_us(),
        "recorders": [{"run_id": r.run_id, "started_us": r.started_us, "count": r.count,
                       "base": r.base, "host": r.host, "pid": r.pid,
                       "info": {k: getattr(r.info, k, None) for k in _INFO_FIELDS}}
                      for r in recs],
        "events": {"rec": [recs[r] for r in batch.recs], "seq": batch.seqs, "ts": batch.ts,
                   "kind": batch.kinds, "iteration": batch.iters, "name": batch.names,
                   "duration_ms": batch.durs, "payload": batch.payloads},
        "new": [recs[r] for r in batch.new],
        "closes": [[recs[r], list(row)] for r, row in batch.closes],
        "ops": [_op_doc(op) for op in ops],
    }
    return json.dumps(doc, default=str)


def time_us() -> int:
    """Now, in microseconds since the epoch."""
    import time

    return time.time_ns() // 1000


_INFO_FIELDS = ("name", "subject_id", "caller_id", "channel_id", "parent_run_id", "inputs")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise SpillError(what)


def _int(value: Any) -> bool:
    return type(value) is int


def _column(events: Mapping[str, Any], key: str, n: int, ok: Callable[[Any], bool]) -> list[Any]:
    col = events.get(key)
    _need(isinstance(col, list) and len(col) == n, f"events.{key} is not a list of {n}")
    assert isinstance(col, list)
    _need(all(map(ok, col)), f"events.{key} holds a value of the wrong type")
    return col


def decode_spill(text: str) -> Spill:
    """A spill file's text read back (`encode_spill`'s inverse).

    Raises:
        SpillError: It is not JSON, not a spill of this version, or a field has the
            wrong shape (nothing of it is used then).
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SpillError(f"not JSON ({' '.join(str(exc).split())})") from None
    _need(isinstance(doc, dict) and doc.get("format") == SPILL_FORMAT, "not a journal spill")
    _need(doc.get("version") == SPILL_VERSION,
          f"spill version {doc.get('version')!r}, this kernel reads {SPILL_VERSION}")
    spill_id, store = doc.get("id"), doc.get("store")
    _need(isinstance(spill_id, str) and bool(spill_id) and isinstance(store, str),
          "no spill id or store")
    try:
        recs = [_recorder(r) for r in doc.get("recorders") or []]
        batch = _batch(doc, recs)
        ops = tuple(_op(o) for o in doc.get("ops") or [])
    except SpillError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise SpillError(f"malformed ({type(exc).__name__}: {exc})") from None
    pid, written = doc.get("pid"), doc.get("written_us")
    return Spill(spill_id, store, batch, ops, pid if _int(pid) else 0,
                 written if _int(written) else 0)


def _recorder(doc: Any) -> SpilledRecorder:
    _need(isinstance(doc, dict), "a recorder is not an object")
    info = doc["info"]
    _need(isinstance(info, dict), "a recorder's info is not an object")
    rec = SpilledRecorder(doc["run_id"], SpilledInfo(*(info.get(k) for k in _INFO_FIELDS)),
                          doc["started_us"], doc["count"], doc["base"], doc["host"], doc["pid"])
    _need(isinstance(rec.run_id, str) and _int(rec.started_us) and _int(rec.count)
          and (rec.base is None or _int(rec.base)) and isinstance(rec.host, str)
          and _int(rec.pid), "a recorder's field has the wrong type")
    if not isinstance(rec.info.inputs, dict):
        rec.info.inputs = {}
    return rec


def _batch(doc: Mapping[str, Any], recs: list[SpilledRecorder]) -> Batch:
    events = doc.get("events") or {}
    _need(isinstance(events, dict), "events is not an object")
    rec_ix = events.get("rec") or []
    _need(isinstance(rec_ix, list), "events.rec is not a list")
    n = len(rec_ix)

    def index(i: Any) -> bool:
        return _int(i) and 0 <= i < len(recs)

    def opt_int(v: Any) -> bool:
        return v is None or _int(v)

    def opt_str(v: Any) -> bool:
        return v is None or isinstance(v, str)

    def opt_num(v: Any) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    _need(all(map(index, rec_ix)), "events.rec names no recorder")
    batch = Batch(
        recs=[recs[i] for i in rec_ix],
        seqs=_column(events, "seq", n, _int), ts=_column(events, "ts", n, _int),
        kinds=_column(events, "kind", n, lambda v: isinstance(v, str)),
        iters=_column(events, "iteration", n, opt_int),
        names=_column(events, "name", n, opt_str),
        durs=_column(events, "duration_ms", n, opt_num),
        payloads=_column(events, "payload", n, lambda v: isinstance(v, str)))
    new = doc.get("new") or []
    _need(isinstance(new, list) and all(map(index, new)), "new names no recorder")
    batch.new = [recs[i] for i in new]
    for item in doc.get("closes") or []:
        _need(isinstance(item, list) and len(item) == 2 and index(item[0])
              and isinstance(item[1], list) and len(item[1]) == 15, "a close is malformed")
        batch.closes.append((recs[item[0]], tuple(item[1])))
    return batch


def _op(doc: Any) -> Op:
    from dataclasses import fields

    _need(isinstance(doc, dict), "an operation is not an object")
    cls = _OP_TYPES.get(doc.get("op"))
    _need(cls is not None, f"unknown operation {doc.get('op')!r}")
    assert cls is not None
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in doc:
            continue  # its default
        value = doc[f.name]
        if f.name in _OWNER_FIELDS:
            value = None if value is None else Owner(str(value[0]), int(value[1]),
                                                     None if value[2] is None else int(value[2]))
        elif f.name == "checkpoint":
            u = value["usage"]
            value = Checkpoint(str(value["run_id"]), int(value["steps"]), value["state"],
                               Usage(int(u[0]), int(u[1]), int(u[2]), float(u[3])),
                               int(value["tool_calls"]))
        elif f.name == "tasks":
            value = tuple(BatchTask(str(t[0]), str(t[1]), dict(t[2])) for t in value)
        elif f.name == "marks":  # MarkDelivery: (index, state, error) each
            value = tuple((int(m[0]), m[1], m[2]) for m in value)
        elif f.name in _MAPPING_FIELDS and value is not None:
            _need(isinstance(value, dict), f"{doc['op']}.{f.name} is not an object")
        kwargs[f.name] = value
    op: Op = cls(**kwargs)
    return op
