"""Bootstrap: where the CLI chooses real batteries for the kernel's ports.

Heavy imports (duckdb, pyarrow) happen inside these functions, never at
import time, so `kernel --help` stays fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from kernel import Critic, Delivery, Ports, PortFailure, Audit


@dataclass(slots=True)
class PortOptions:
    """What the user asked for on the command line."""

    db: str | None = None
    no_audit: bool = False
    no_critic: bool = False
    soft_timeout: float | None = None
    idle_timeout: float | None = None


@asynccontextmanager
async def open_ports(opts: PortOptions, *, delivery: Delivery | None = None,
                     warnings: list[PortFailure] | None = None) -> AsyncIterator[Ports]:
    """Open the batteries the options ask for and close them afterwards.

    A battery that cannot be opened (a locked or read-only database) is left
    out with a one-line warning added to `warnings`; the run still happens.
    """
    async with AsyncExitStack() as stack:
        audit = None if opts.no_audit else await _open_audit(opts, stack, warnings)
        critic = None if opts.no_critic else _make_critic(opts)
        yield Ports(audit=audit, critic=critic, delivery=delivery)


async def _open_audit(opts: PortOptions, stack: AsyncExitStack,
                      warnings: list[PortFailure] | None) -> Audit | None:
    """The DuckDB audit at --db / $KERNEL_DB / the user data dir (batteries.audit)."""
    return None


def _make_critic(opts: PortOptions) -> Critic | None:
    """The watch-nursery critic with the CLI's thresholds (batteries.critic)."""
    return None
