"""Bootstrap: where the CLI chooses real batteries for the kernel's ports.

Heavy imports (duckdb, pyarrow) happen inside these functions, never at
import time, so `kernel --help` stays fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernel import Audit, Budget, Checkpointer, Critic, Delivery, PortFailure, Ports

if TYPE_CHECKING:
    from batteries.redact import Redactor


@dataclass(slots=True)
class PortOptions:
    """What the user asked for on the command line."""

    db: str | None = None
    no_audit: bool = False
    no_critic: bool = False
    soft_timeout: float | None = None
    idle_timeout: float | None = None
    model_timeout: float | None = None
    tool_timeout: float | None = None
    deliver_dir: str | None = None
    webhooks: tuple[str, ...] = ()


@asynccontextmanager
async def open_ports(opts: PortOptions, *, delivery: Delivery | None = None,
                     warnings: list[PortFailure] | None = None,
                     redactor: Redactor | None = None) -> AsyncIterator[Ports]:
    """Open the batteries the options ask for and close them afterwards.

    A battery that cannot be opened (a locked or read-only database) is left
    out with a one-line warning added to `warnings`; the run still happens.
    `redactor` (None: `Redactor.from_env()`) is shared by the audit and the
    checkpointer: nothing they store holds a secret it knows.
    """
    async with AsyncExitStack() as stack:
        if redactor is None and not opts.no_audit:
            from batteries.redact import Redactor

            redactor = Redactor.from_env()
        audit = None if opts.no_audit else await _open_audit(opts, stack, warnings, redactor)
        critic = None if opts.no_critic else _make_critic(opts)
        # Budgets live in the audit file: enforced whenever that file is usable.
        budget = _budget(opts) if audit is not None else None
        checkpointer = _checkpointer(opts, redactor) if audit is not None else None
        yield Ports(audit=audit, budget=budget, critic=critic, checkpointer=checkpointer,
                    delivery=_delivery(opts, delivery))


def _checkpointer(opts: PortOptions, redactor: Redactor | None) -> Checkpointer:
    """Checkpoints (and run specs, for `kernel recover`) in the audit database."""
    from batteries.audit import resolve_db_path
    from batteries.checkpoint import DuckDBCheckpointer

    return DuckDBCheckpointer(resolve_db_path(opts.db), redactor=redactor)


def _budget(opts: PortOptions) -> Budget:
    """Per-caller budgets from the audit database (`kernel budget set`)."""
    from batteries.audit import resolve_db_path
    from batteries.budget import DuckDBBudget

    return DuckDBBudget(resolve_db_path(opts.db))


def _delivery(opts: PortOptions, first: Delivery | None) -> Delivery | None:
    """`first` (the CLI's own capture), then --deliver-dir and each --webhook."""
    chosen: list[Delivery] = [first] if first is not None else []
    if opts.deliver_dir or opts.webhooks:
        from batteries.delivery import DirectoryDelivery, FanOut, WebhookDelivery

        if opts.deliver_dir:
            chosen.append(DirectoryDelivery(opts.deliver_dir))
        chosen.extend(WebhookDelivery(url) for url in opts.webhooks)
        return FanOut(chosen)
    return first


async def _open_audit(opts: PortOptions, stack: AsyncExitStack,
                      warnings: list[PortFailure] | None,
                      redactor: Redactor | None = None) -> Audit | None:
    """The DuckDB audit at --db / $KERNEL_DB / the user data dir (batteries.audit).

    Opening creates or migrates the file, retrying while another process
    holds it (up to `$KERNEL_AUDIT_LOCK_TIMEOUT`). If that fails (read-only
    file or directory, still locked, not a DuckDB file, a bad KERNEL_AUDIT_*
    variable) the run goes ahead unaudited: the reason is appended to
    `warnings` as an `audit.open` failure and None is returned.
    """
    from batteries.audit import DuckDBAudit

    try:
        return await stack.enter_async_context(DuckDBAudit.open(opts.db, redactor=redactor))
    except Exception as exc:
        if warnings is not None:
            message = " ".join(str(exc).split()) or type(exc).__name__
            warnings.append(PortFailure("audit", "open", message))
        return None


def _make_critic(opts: PortOptions) -> Critic | None:
    """The watch-nursery critic with the CLI's thresholds (batteries.critic).

    `--soft-timeout` / `--idle-timeout` / `--model-timeout` / `--tool-timeout`:
    None keeps the critic's default (600 s / 300 s / 300 s / 300 s); 0 turns
    that rule off (no progress judgments / no stall detection / no bound of
    its own for work in flight); a negative value is a `ConfigError` naming
    the flag.
    """
    from batteries.critic import CriticPolicy, WatchCritic
    from kernel import ConfigError

    defaults = CriticPolicy()
    chosen: dict[str, float | None] = {}
    for flag, field, value in (("--soft-timeout", "soft_timeout", opts.soft_timeout),
                               ("--idle-timeout", "idle_timeout", opts.idle_timeout),
                               ("--model-timeout", "model_timeout", opts.model_timeout),
                               ("--tool-timeout", "tool_timeout", opts.tool_timeout)):
        if value is None:
            chosen[field] = getattr(defaults, field)
        elif not value >= 0 or value == float("inf"):
            raise ConfigError(f"{flag} must be a number of seconds >= 0, got {value:g}")
        else:
            chosen[field] = value or None
    return WatchCritic(CriticPolicy(soft_timeout=chosen["soft_timeout"],
                                    idle_timeout=chosen["idle_timeout"],
                                    model_timeout=chosen["model_timeout"],
                                    tool_timeout=chosen["tool_timeout"]))
