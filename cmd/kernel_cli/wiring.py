"""Bootstrap: where the CLI chooses real batteries for the kernel's ports.

Heavy imports (duckdb, pyarrow) happen inside these functions, never at
import time, so `kernel --help` stays fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batteries.redact import Redactor
    from kernel import Audit, Critic, Delivery, PortFailure, Ports


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
    otlp: str | None = None


@asynccontextmanager
async def open_ports(opts: PortOptions, *, delivery: Delivery | None = None,
                     warnings: list[PortFailure] | None = None,
                     redactor: Redactor | None = None,
                     journals: list[Any] | None = None) -> AsyncIterator[Ports]:
    """Open the batteries the options ask for and close them afterwards.

    The audit, budget and checkpointer share one `Journal` (the SQLite file
    beside the analysts' DuckDB file), so a run's writes ride along in two
    transactions: one when it opens, one when it closes. Opening does no
    I/O. Budgets fail closed: if the journal cannot be reached the budget
    check refuses the run. An audit that cannot be built (a bad
    KERNEL_AUDIT_* variable) is left out with a one-line warning added to
    `warnings`. `journals` receives the journal, for its statistics.
    `redactor` (None: `Redactor.from_env()`) is shared by the audit and the
    checkpointer: nothing they store holds a secret it knows.

    Raises:
        ConfigError: A bad `$KERNEL_AUDIT_LOCK_TIMEOUT` or `$KERNEL_JOURNAL_SYNC`.
    """
    from kernel import Ports

    async with AsyncExitStack() as stack:
        audit = budget = checkpointer = None
        if not opts.no_audit:
            from batteries.budget import JournalBudget
            from batteries.checkpoint import JournalCheckpointer
            from batteries.redact import Redactor
            from batteries.store import Journal

            if redactor is None:
                redactor = Redactor.from_env()
            journal = await stack.enter_async_context(Journal.open(opts.db))
            if journals is not None:
                journals.append(journal)
            audit = _audit(journal, warnings, redactor)
            budget = JournalBudget(journal)
            checkpointer = JournalCheckpointer(journal, redactor=redactor)
        audit = await _with_otel(opts, audit, stack, warnings)
        critic = None if opts.no_critic else _make_critic(opts)
        yield Ports(audit=audit, budget=budget, critic=critic, checkpointer=checkpointer,
                    delivery=_delivery(opts, delivery))


def _audit(journal: Any, warnings: list[PortFailure] | None,
           redactor: Redactor | None = None) -> Audit | None:
    """The audit on `journal`; None (and an `audit.open` warning) if its settings are bad."""
    from batteries.audit import JournalAudit
    from kernel import PortFailure

    try:
        return JournalAudit(journal, redactor=redactor)
    except Exception as exc:
        if warnings is not None:
            message = " ".join(str(exc).split()) or type(exc).__name__
            warnings.append(PortFailure("audit", "open", message))
        return None


def _delivery(opts: PortOptions, first: Delivery | None) -> Delivery | None:
    """`first` (the CLI's own capture), then --deliver-dir and each --webhook."""
    chosen: list[Delivery] = [first] if first is not None else []
    if opts.deliver_dir or opts.webhooks:
        from batteries.delivery import DirectoryDelivery, FanOutDelivery, WebhookDelivery

        if opts.deliver_dir:
            chosen.append(DirectoryDelivery(opts.deliver_dir))
        chosen.extend(WebhookDelivery(url) for url in opts.webhooks)
        return FanOutDelivery(chosen)
    return first


async def _with_otel(opts: PortOptions, audit: Audit | None, stack: AsyncExitStack,
                     warnings: list[PortFailure] | None) -> Audit | None:
    """`audit`, teed into an OpenTelemetry export when --otlp or $OTEL_EXPORTER_OTLP_ENDPOINT.

    --otlp without the otel extra is a `ConfigError` (exit 2). The environment
    variable is often set machine-wide: without the extra it is an
    `otlp.open` warning and the run goes on. --otlp "" turns the export off.
    """
    import os

    endpoint = opts.otlp if opts.otlp is not None else (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)
    if not endpoint:
        return audit
    from batteries.otel import OTelAudit
    from batteries.tee import TeeAudit
    from kernel import ConfigError

    try:
        otel = await stack.enter_async_context(OTelAudit.open(endpoint))
    except ConfigError as exc:
        if opts.otlp is not None:
            raise ConfigError(f"--otlp: {exc}") from exc
        if warnings is not None:
            warnings.append(PortFailure("otlp", "open", f"$OTEL_EXPORTER_OTLP_ENDPOINT: {exc}"))
        return audit
    return otel if audit is None else TeeAudit(audit, otel)


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
