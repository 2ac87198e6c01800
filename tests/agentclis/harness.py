"""Running a real agent CLI under the kernel against a scripted fake model server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients import CLIENTS, client_env, require
from fake_models import FakeModelServer, Reply

from adapters.agentcli import SessionCLIAgent, preset
from batteries.critic import CriticPolicy, WatchCritic
from kernel import Critic, Kernel, Limits, Ports, Result, RunInfo
from kernel.testing import AuditEvent, MemoryAudit

#: The idle window of the scenarios: generous, since a client may take seconds to start
#: on a loaded 2-core machine, and the window counts from the spawn.
IDLE_TTL = 10.0
LIMITS = Limits(timeout=180, poll_interval=0.05, checkpoint_every_seconds=0)


@dataclass
class Outcome:
    """What one scenario run produced."""

    result: Result
    events: list[AuditEvent]
    server: FakeModelServer
    agent: SessionCLIAgent

    def kinds(self, *wanted: str) -> list[AuditEvent]:
        """The audit events of these kinds, in order."""
        return [e for e in self.events if e.kind in wanted]

    def agent_events(self) -> list[str]:
        """The normalised event types the adapter saw, in order."""
        return [str(e.payload.get("event")) for e in self.events
                if e.payload and "event" in e.payload]

    def unknown(self) -> list[Any]:
        """Sources of the events no mapping knew (there should be none)."""
        return [e.payload.get("source") for e in self.events
                if e.payload and e.payload.get("event") == "unknown"]

    def tools(self) -> list[tuple[str, float | None]]:
        """(name, duration_ms) of every tool that ended."""
        return [(e.name or "", e.duration_ms) for e in self.kinds("tool_end")]


def default_critic() -> WatchCritic:
    """The real critic, its stall detection left to the adapter's idle window."""
    return WatchCritic(CriticPolicy(idle_timeout=None, soft_timeout=None))


async def run_client(client: str, replies: list[Reply], tmp_path: Path, *,
                     repeat_last: bool = False, critic: Critic | None = None,
                     wrap_audit: Any = None,
                     prompt: str = "List the files, read notes.txt, then say what it holds.",
                     **options: Any) -> Outcome:
    """Run `client` (real process) on a fake server scripted with `replies`.

    `wrap_audit(audit)` may wrap the in-memory audit (e.g. in the live progress).
    """
    exe = require(client)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "notes.txt").write_text("remember the milk\n")
    with FakeModelServer(CLIENTS[client][2], replies, repeat_last=repeat_last) as srv:
        env = client_env(client, srv.url, tmp_path / "home")
        options.setdefault("idle_ttl", IDLE_TTL)
        agent = preset(client, prompt, cwd=str(work), env=env, executable=str(exe),
                       **options)
        audit = MemoryAudit()
        ports = Ports(audit=wrap_audit(audit) if wrap_audit is not None else audit,
                      critic=critic if critic is not None else default_critic())
        result = await Kernel(ports).run(agent, RunInfo(name=f"{client} scenario"), LIMITS)
        return Outcome(result, audit.events(result.run_id), srv, agent)
