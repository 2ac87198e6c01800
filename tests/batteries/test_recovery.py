"""batteries.recovery: interrupted runs found, claimed, given their secrets and resumed.

The interrupted runs here are registered by a checkpointer whose owner is this
process with another start time: provably gone, as after a SIGKILL (the real
SIGKILL/SIGTERM cases run as processes in tests/test_examples.py and
tests/cmd/test_recover_cli.py).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.checkpoint import JournalCheckpointer
from batteries.recovery import (
    NotResumable,
    Prepared,
    Recovery,
    Resumed,
    Secrets,
    restore_secrets,
)
from batteries.store import Owner
from kernel import (
    Agent,
    AgentSpec,
    Checkpoint,
    CommandSpec,
    ConfigError,
    Limits,
    LoopSpec,
    PortSpec,
    RunContext,
    RunInfo,
    RunSpec,
    Status,
    Step,
)


class Counter:
    """Counts to three, one step at a time; resumable."""

    def __init__(self) -> None:
        self.n = 0

    async def step(self, ctx: RunContext) -> Step:
        if ctx.resumed_from is not None and self.n == 0:
            self.n = ctx.resumed_from["n"]
        self.n += 1
        return Step(output=self.n, final=self.n == 3)

    def snapshot(self) -> dict[str, Any]:
        return {"n": self.n}


class Forgetful:
    """Keeps no resumable state."""

    async def step(self, ctx: RunContext) -> Step:
        return Step(final=True)


def _spec(db: Path, what: Any = None, webhooks: tuple[str, ...] = ()) -> RunSpec:
    return RunSpec(what or LoopSpec(str(db.parent / "loop.yaml"), {"dir": "src"}),
                   RunInfo(name="counter"), Limits(timeout=60),
                   PortSpec(db=str(db), no_critic=True, webhooks=webhooks), cwd=str(db.parent))


def _interrupt(db: Path, spec: RunSpec, steps: int = 1) -> None:
    """Register `spec` and save a checkpoint as a process that has since died."""
    cp = JournalCheckpointer(db)
    cp.owner = Owner(socket.gethostname(), os.getpid(), 1)  # our pid, another start: gone

    async def go() -> None:
        await cp.register(spec.run_id, spec)
        await cp.save(Checkpoint(spec.run_id, steps, {"n": steps}))

    trio.run(go)


def _recovery(db: Path, build: Any = None, secrets: Secrets | None = None) -> Recovery:
    def no_groups(group: Any) -> int:
        raise AssertionError(f"no process group was recorded, got {group}")

    return Recovery(db, build=build or (lambda spec: Counter()), stop_group=no_groups,
                    secrets=secrets)


def test_recover_resumes_each_interrupted_run_once(tmp_path: Path) -> None:
    """recover() resumes the run from its checkpoint under its own id; then nothing is left."""
    db = tmp_path / "k.duckdb"
    spec = _spec(db)
    _interrupt(db, spec, steps=1)
    rec = _recovery(db)
    assert [r.run_id for r in rec.interrupted()] == [spec.run_id]
    seen: list[Resumed] = []
    [done] = trio.run(lambda: rec.recover(on_done=seen.append))
    assert seen == [done]
    assert done.run_id == spec.run_id and done.steps == 1 and done.why is None
    assert done.result is not None and done.result.status is Status.OK
    assert done.result.run_id == spec.run_id and done.result.output == 3
    assert done.spec == RunSpec.from_dict(JournalCheckpointer(db).load(spec.run_id).spec)  # type: ignore[union-attr]
    assert rec.interrupted() == []
    assert trio.run(rec.recover) == []


def test_a_command_is_closed_lost(tmp_path: Path) -> None:
    """A plain command keeps no state: the run is marked lost, not resumed."""
    db = tmp_path / "k.duckdb"
    spec = _spec(db, CommandSpec(("sleep", "60")))
    _interrupt(db, spec)
    rec = _recovery(db)
    saved = rec.claim(spec.run_id)
    assert saved is not None
    got = rec.prepare(saved)
    assert isinstance(got, Resumed) and got.lost == "a plain command has no resumable state"
    assert got.result is None and got.refused is None
    assert rec.interrupted() == []
    assert JournalCheckpointer(db).load(spec.run_id).status == "failed"  # type: ignore[union-attr]


@pytest.mark.parametrize(("build", "lost", "refused"), [
    (lambda spec: Forgetful(), "a Forgetful keeps no resumable state", None),
    (lambda spec: (_ for _ in ()).throw(ConfigError("loop file not found: /x")), None,
     "cannot be rebuilt: loop file not found: /x"),
], ids=["no-snapshot", "build-fails"])
def test_what_cannot_be_built(tmp_path: Path, build: Any, lost: str | None,
                              refused: str | None) -> None:
    """An agent without state is lost for good; a build error refuses, leaving it resumable."""
    db = tmp_path / "k.duckdb"
    spec = _spec(db)
    _interrupt(db, spec)
    rec = _recovery(db, build)
    saved = rec.claim(spec.run_id)
    assert saved is not None
    got = rec.prepare(saved)
    assert isinstance(got, Resumed) and (got.lost, got.refused) == (lost, refused)
    still = [r.run_id for r in rec.interrupted()]
    assert still == ([spec.run_id] if refused else [])


def test_a_stored_webhook_that_can_never_be_posted_to_refuses_that_run(
    tmp_path: Path) -> None:
    """A webhook URL stored by a version that took it (`check_webhook_url` refuses it now)
    refuses its run in `prepare` ("cannot be rebuilt", left resumable), instead of a
    ConfigError out of `recover()` that left every other interrupted run waiting."""
    db = tmp_path / "k.duckdb"
    bad = _spec(db, webhooks=("http://127.0.0.1:99999/hook",))
    good = _spec(db)
    _interrupt(db, bad)
    _interrupt(db, good)
    done = {r.run_id: r for r in trio.run(_recovery(db).recover)}
    assert done[bad.run_id].refused is not None
    assert "cannot be rebuilt" in done[bad.run_id].refused
    assert "Port out of range" in done[bad.run_id].refused
    result = done[good.run_id].result
    assert result is not None and result.status is Status.OK
    assert [r.run_id for r in _recovery(db).interrupted()] == [bad.run_id]


def test_secrets_must_be_given_back(tmp_path: Path) -> None:
    """A secret context value and a webhook password are not stored: refused until given."""
    db = tmp_path / "k.duckdb"
    spec = _spec(db, AgentSpec("llm", model="m", prompt="hi", context={"api_token": "s3cr3t-v"}),
                 webhooks=("http://user:pw@127.0.0.1:9/hook",))
    _interrupt(db, spec)
    stored = JournalCheckpointer(db).load(spec.run_id)
    assert stored is not None and "s3cr3t-v" not in str(stored.spec)
    assert "user:pw" not in str(stored.spec)

    refusing = _recovery(db)
    saved = refusing.claim(spec.run_id)
    assert saved is not None
    got = refusing.prepare(saved)
    assert isinstance(got, Resumed) and got.refused == "its secrets are not stored"
    assert got.missing == ("agent.context.api_token", "ports.webhooks")
    assert [r.run_id for r in refusing.interrupted()] == [spec.run_id]  # still resumable

    agents: list[RunSpec] = []

    def build(given: RunSpec) -> Agent:
        agents.append(given)
        return Counter()

    giving = _recovery(db, build, Secrets(context={"api_token": "s3cr3t-v"},
                                          webhooks=("http://127.0.0.1:9/other",)))
    saved = giving.claim(spec.run_id)
    assert saved is not None
    ready = giving.prepare(saved)
    assert isinstance(ready, Prepared)
    assert agents[0].agent.context == {"api_token": "s3cr3t-v"}
    assert agents[0].ports.webhooks == ("http://127.0.0.1:9/other",)
    assert ready.redactor.text("s3cr3t-v") != "s3cr3t-v"  # the resumed run stores none of it


@pytest.mark.parametrize("path", [("agent", "path"), ("agent", "argv", 0), ("cwd",)])
def test_a_secret_nothing_can_give_back(path: tuple[str | int, ...]) -> None:
    """A redacted value outside the context, webhooks and base URL can never be restored."""
    spec = RunSpec(LoopSpec("/x/loop.yaml"), redacted=(path,))
    with pytest.raises(NotResumable, match=f"its {'.'.join(map(str, path))} held a secret"):
        restore_secrets(spec, Secrets(context={"a": "b"}))


def test_base_url_given_back() -> None:
    """A base URL that held a password is replaced by the one given; nothing else changes."""
    spec = RunSpec(AgentSpec("llm", model="m", prompt="p", base_url="http://[REDACTED]@h/v1"),
                   redacted=(("agent", "base_url"),))
    assert restore_secrets(spec, Secrets())[1] == ("agent.base_url",)
    back, missing = restore_secrets(spec, Secrets(base_url="http://u:p@h/v1"))
    assert missing == () and isinstance(back.agent, AgentSpec)
    assert back.agent.base_url == "http://u:p@h/v1" and back.info is spec.info
