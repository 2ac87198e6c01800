"""The values that cross the storage interface: batches, operations, owners, rows.

Everything here is plain data: a second implementation of `RunStore`
(PostgreSQL, for a fleet) receives exactly these objects and interprets
them in its own SQL.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import field, replace
from typing import Any, Protocol

from kernel import AuditError, Checkpoint, UsageLimits
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


Op = (RegisterRun | SaveCheckpoint | FinishRun | LoseRun | ClaimRun | ReleaseRun
      | ReserveBudget | SettleBudget | SetBudget | RemoveBudget | CreateBatch | ClaimBatch
      | FinishBatch)


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
    """A registered run: its spec, its last checkpoint, and the process holding it."""

    run_id: str
    spec: dict[str, Any]
    checkpoint: Checkpoint
    status: str
    owner: Owner
    updated_at: dt.datetime
    heartbeat_at: dt.datetime | None = None

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
    """

    index: int
    task_id: str
    run_id: str
    spec: dict[str, Any]
    run_status: str | None
    started: bool
    saved: SavedRun | None = None
