"""Per-caller budgets in the journal, checked and reserved in one transaction.

A budget row says how much a caller may spend per rolling window (a day by
default): runs, runtime seconds, tokens, dollars. `check` refuses a caller
who has used any of them up (`BudgetRefused`, the run ends
`budget_exceeded` with exit code 3) and otherwise *reserves* the run in the
same `BEGIN IMMEDIATE` transaction (a spend row of one run, nothing spent
yet) and hands the kernel what is left as `UsageLimits`. `commit` settles
the reservation with what the run really spent, deferred to the journal's
next transaction (the run's close). A settled amount the journal could not
keep is clamped to what it can: NaN or negative as 0, infinite or huge as
`MAX_SETTLED_TOKENS` / `MAX_SETTLED_AMOUNT` (see `_amount`). The caller `*`
holds the default budget for callers without a row of their own.

Why this holds under concurrency: the journal's write lock serialises the
check-and-reserve transactions of every process, and each sees the
reservations committed before it, so N simultaneous runs against a budget
of K runs: exactly K run. Runtime, tokens and cost are known only at the
end: each run is capped at what was left when it started, so runs of one
caller that overlap can together overspend those by at most what the
others spend meanwhile (run counts are exact).

Fails closed: if the journal cannot be reached (locked past the lock
timeout, unreadable, not writable) `check` raises and the kernel refuses the
run, unless the journal proves that no budget applies to the caller: it
does not exist (and cannot be created), or it can still be read and holds
no budget for them. No row
is written for a caller without a budget, and nothing is settled for them.

Tables (in the journal; mirrored into the analysts' file by `sync`)::

    budgets(caller_id PK, window_seconds, max_runs, max_runtime_seconds,
            max_tokens, max_cost_usd, updated_at)
    budget_spend(id PK, caller_id, ts, run_id, runtime_seconds, tokens,
                 cost_usd, settled)
"""

from __future__ import annotations

import math
import operator
import os
from collections import deque

from kernel import BudgetRefused, RunInfo, Usage, UsageLimits

from .store import (
    CallerBudget,
    Journal,
    RemoveBudget,
    Reservation,
    ReserveBudget,
    SetBudget,
    SettleBudget,
)

DEFAULT_CALLER = "*"

__all__ = ["DEFAULT_CALLER", "CallerBudget", "DuckDBBudget", "JournalBudget"]


class JournalBudget:
    """The Budget port on the journal (a decider: it fails closed).

    Args:
        journal: A `Journal` shared with the other batteries (its deferred
            settlements then ride along with the run's close), or the path
            of the analysts' file, whose journal this budget opens itself.
        lock_timeout: With a path: seconds to wait for the journal's write lock.
    """

    def __init__(self, journal: Journal | str | os.PathLike[str], *,
                 lock_timeout: float | None = None) -> None:
        self.journal = journal if isinstance(journal, Journal) else Journal(
            journal, lock_timeout=lock_timeout)
        self.store = self.journal.store
        self._reserved: dict[str, deque[int]] = {}
        self._by_run: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"JournalBudget({str(self.store.path)!r})"

    # --------------------------------------------------------------- the port

    async def check(self, caller_id: str) -> UsageLimits | None:
        """Refuse a caller who has used up a budget; else reserve this run and return what is left.

        Raises:
            BudgetRefused: The caller's budget is used up.
            StoreError: The journal cannot be reached (the kernel refuses the run).
        """
        found = await self._reserve(ReserveBudget(caller_id, ""))
        if found is None:
            return None
        rid, caps = found
        self._reserved.setdefault(caller_id, deque()).append(rid)
        return caps

    async def commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
        """Settle the caller's oldest open reservation with this run's spend (nothing if none)."""
        queue = self._reserved.get(caller_id)
        if not queue:
            return
        rid = queue.popleft()
        if not queue:
            del self._reserved[caller_id]
        await self._settle(rid, runtime_seconds, usage)

    async def check_run(self, info: RunInfo, *, resumed: bool) -> UsageLimits | None:
        """`check` for one run (`SupportsRunBudget`): its reservation names it.

        A resumed run is never refused and reserves nothing new: it settles
        into what it reserved when it first opened (see `ReserveBudget`).
        """
        found = await self._reserve(ReserveBudget(info.caller_id, info.run_id, resumed))
        if found is None:
            return None
        rid, caps = found
        self._by_run[info.run_id] = rid
        return caps

    async def commit_run(self, info: RunInfo, runtime_seconds: float, usage: Usage) -> None:
        """Settle this run's reservation: this session's runtime, the run's usage so far."""
        rid = self._by_run.pop(info.run_id, None)
        if rid is not None:
            await self._settle(rid, runtime_seconds, usage)

    async def _reserve(self, op: ReserveBudget) -> tuple[int, UsageLimits] | None:
        try:
            [found] = await self.journal.transact([op])
        except Exception:
            # Fail closed, unless the journal proves no budget applies: it does
            # not exist (and cannot be made here), or it can still be read and
            # holds no budget for this caller (e.g. another process holds its
            # write lock past the timeout: the audit will report that).
            if not self.store.exists():
                return None
            try:
                applies = await self.journal.read(self.store.budget, op.caller_id)
            except Exception:
                applies = True
            if applies is None:
                return None
            raise
        if found is None:
            return None
        assert isinstance(found, Reservation)
        if found.reservation_id is None:
            raise BudgetRefused(found.budget.refusal() or "budget used up")
        return found.reservation_id, found.budget.remaining()

    async def _settle(self, rid: int, runtime_seconds: float, usage: Usage) -> None:
        try:
            tokens = usage.total_tokens
        except TypeError:  # a token count that is not a number
            tokens = 0
        await self.journal.later(SettleBudget(
            rid, _amount(runtime_seconds, MAX_SETTLED_AMOUNT),
            int(_amount(tokens, MAX_SETTLED_TOKENS)), _amount(usage.cost_usd,
                                                              MAX_SETTLED_AMOUNT)))

    # ------------------------------------------------------------ management

    def set(self, caller_id: str, *, window_seconds: float = 86400,
            max_runs: int | None = None, max_runtime_seconds: float | None = None,
            max_tokens: int | None = None, max_cost_usd: float | None = None) -> None:
        """Create or replace a caller's budget (blocking; for the CLI and hosts).

        Raises:
            ValueError: A caller id that is empty or holds a control character
                (no run started by `kernel run --caller` can have it, so the
                budget could never bind, and listing it would send the
                characters raw to a terminal), a window that is not a finite
                number > 0 seconds, a limit that is negative, NaN or infinite
                (None means no limit), or a count (`max_runs`, `max_tokens`)
                that is not a whole number (an int; `1.5` runs is refused, as
                `kernel budget set` does).
        """
        if not isinstance(caller_id, str) or not caller_id.strip() or not caller_id.isprintable():
            raise ValueError(f"the budget's caller id must be printable text, not empty, "
                             f"got {caller_id!r}")
        if not (_is_real(window_seconds) and 0 < window_seconds < math.inf):
            raise ValueError(f"the budget window must be a finite number > 0 seconds, "
                             f"got {window_seconds!r}")
        counts = {"max_runs": max_runs, "max_tokens": max_tokens}
        for name, count in counts.items():
            if count is not None and not (_is_whole(count) and 0 <= count < 2**63):
                raise ValueError(f"budget {name} must be a whole number >= 0 or None, "
                                 f"got {count!r}")
            if count is not None:
                counts[name] = operator.index(count)  # a numpy integer as an int
        max_runs, max_tokens = counts["max_runs"], counts["max_tokens"]
        for name, value in (("max_runs", max_runs), ("max_runtime_seconds", max_runtime_seconds),
                            ("max_tokens", max_tokens), ("max_cost_usd", max_cost_usd)):
            if value is not None and not (_is_real(value) and 0 <= value < math.inf):
                raise ValueError(f"budget {name} must be a finite number >= 0 or None, "
                                 f"got {value!r}")
        self.store.commit(None, [SetBudget(caller_id, window_seconds, max_runs,
                                           max_runtime_seconds, max_tokens, max_cost_usd)])

    def remove(self, caller_id: str) -> bool:
        """Delete a caller's budget; True if there was one.

        Where no journal exists there is no budget to remove: it answers False
        without creating one (and its directory) at what may be a mistyped path.
        """
        if not self.store.exists():
            return False
        [found] = self.store.commit(None, [RemoveBudget(caller_id)])
        return bool(found)

    def status(self, caller_id: str) -> CallerBudget | None:
        """The caller's budget (own row, else `*`) and spend in its window; None if unbounded."""
        return self.store.budget(caller_id)

    def all(self) -> list[CallerBudget]:
        """Every budget row with its own caller's current spend."""
        return self.store.budgets()




#: The most tokens one run's settlement counts (2**48, ~2.8e14): far above any real
#: run, and low enough that a window's sum of spend rows stays within the store's
#: 64-bit integers.
MAX_SETTLED_TOKENS = 2**48
#: The most dollars, or runtime seconds, one run's settlement counts (1e12).
MAX_SETTLED_AMOUNT = 1e12


def _is_whole(value: object) -> bool:
    """True for an integer (an int, or anything with `__index__`; not a bool)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _is_real(value: object) -> bool:
    """True for an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _amount(value: object, most: float) -> float:
    """One settled amount the store can keep: `value` clamped to [0, `most`].

    A settlement is what a run reports it spent, and the budget is a decider
    that fails closed: an amount that is infinite or above `most` settles as
    `most` (the caller's budget is spent), a negative one (no refund) as 0,
    and one that is NaN or not a number (no amount at all) as 0. Such usage
    never reaches a budget from the kernel, which ends a run that reports it
    `error`; this keeps the journal's NOT NULL and 64-bit columns safe from
    any other caller of `commit`.
    """
    if not _is_real(value):
        return 0.0
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int too large for a float: far above `most`
        return most
    if number != number or number <= 0:  # NaN or nothing spent
        return 0.0
    return min(number, most)


#: The budget's former name (it lived in the DuckDB file); kept for hosts.
DuckDBBudget = JournalBudget
