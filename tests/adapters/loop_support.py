"""Helpers shared by the loop adapter tests: write a loop file, run it, read its audit."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from adapters.loop import LoopAgent, LoopSpec, load_loop
from kernel import Checkpoint, Kernel, Limits, Ports, Result, RunInfo
from kernel.testing import AuditEvent, MemoryAudit

LOOP_EVENTS = ("state_enter", "evaluate", "route")


def write(tmp_path: Path, text: str, name: str = "loop.yaml") -> Path:
    """Write a (dedented) loop file and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def spec_of(tmp_path: Path, text: str, *, context: dict[str, str] | None = None,
            name: str = "loop.yaml") -> LoopSpec:
    """Write and load a loop file (raising on errors, like `kernel run`)."""
    return load_loop(write(tmp_path, text, name), context=context)


async def run(spec: LoopSpec, *, context: dict[str, str] | None = None,
              limits: Limits | None = None, ports: Ports | None = None,
              resume: Checkpoint | None = None, info: RunInfo | None = None,
              **agent_kw: Any) -> tuple[Result, MemoryAudit, LoopAgent]:
    """Run `spec` under a real kernel with a memory audit (unless `ports` brings one)."""
    audit = MemoryAudit()
    if ports is None:
        ports = Ports(audit=audit)
    elif ports.audit is None:
        ports.audit = audit
    else:
        assert isinstance(ports.audit, MemoryAudit)
        audit = ports.audit
    agent = LoopAgent(spec, context=context, **agent_kw)
    result = await Kernel(ports).run(agent, info or RunInfo(name=spec.name),
                                     limits or spec.limits(), resume=resume)
    return result, audit, agent


def events(audit: MemoryAudit, run_id: str, *kinds: str) -> list[AuditEvent]:
    """The run's events of the given kinds, in order."""
    return [e for e in audit.events(run_id) if e.kind in kinds]


def path_taken(audit: MemoryAudit, run_id: str) -> list[str]:
    """The states the run entered, in order."""
    return [e.name or "" for e in events(audit, run_id, "state_enter")]


def routes(audit: MemoryAudit, run_id: str) -> list[tuple[str, str, str]]:
    """(from, to, reason) of every route event."""
    return [(e.payload["from"], e.payload["to"], e.payload["reason"])
            for e in events(audit, run_id, "route")]


def verdicts(audit: MemoryAudit, run_id: str) -> list[str]:
    """The verdict of every evaluate event."""
    return [e.payload["verdict"] for e in events(audit, run_id, "evaluate")]
