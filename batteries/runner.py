"""Run specs with the usual ports: what `kernel run`, `kernel recover` and hosts share.

    from adapters import agent_from_spec
    from batteries.runner import SignalPolicy, run_spec
    from kernel import Limits, LoopSpec, PortSpec, RunSpec

    what = LoopSpec(path="/abs/loop.yaml")
    built = agent_from_spec(what)
    spec = RunSpec(what, built.info, built.limits or Limits(), PortSpec(db="k.duckdb"))
    result = await run_spec(spec, built.agent, signals=SignalPolicy())

- `open_ports(PortSpec)`: the batteries a spec's ports ask for (the journal
  shared by audit, budget and checkpointer; the watch critic; deliveries;
  OpenTelemetry), closed afterwards.
- `run_spec(spec, agent)`: one run with those ports, its spec registered
  for recovery first; the `Result` comes back even when the run is
  cancelled (`RunControl.cancel`, or a signal under a `SignalPolicy`).
- `SignalPolicy`: the CLI's rule. SIGINT (Ctrl-C, a person deciding) is
  final: the run ends `cancelled` and its checkpoint is closed, so
  `recover` leaves it alone. SIGTERM, SIGHUP and SIGQUIT (a shutdown) are
  resumable: the run ends `cancelled` with its checkpoint kept.

Batteries never import adapters: whoever builds agents (`adapters.agent_from_spec`)
is passed in. Heavy imports (duckdb, pyarrow) happen inside these
functions, never at import time.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from kernel import Agent, Checkpoint, PortFailure, PortSpec, Result, RunSpec, Status
from kernel._dataclass import dataclass

if TYPE_CHECKING:
    from batteries.redact import Redactor
    from batteries.store import Journal
    from kernel import Audit, Critic, Delivery, Ports

__all__ = ["PortSpec", "RunControl", "SignalPolicy", "make_critic", "open_ports", "run_spec",
           "watch_signals"]


@asynccontextmanager
async def open_ports(opts: PortSpec, *, delivery: Delivery | None = None,
                     warnings: list[PortFailure] | None = None,
                     redactor: Redactor | None = None,
                     journals: list[Journal] | None = None) -> AsyncIterator[Ports]:
    """Open the batteries a spec's ports ask for and close them afterwards.

    The audit, budget and checkpointer share one `Journal` (the SQLite file
    beside the analysts' DuckDB file), so a run's writes ride along in two
    transactions: one when it opens, one when it closes. Opening does no
    I/O. Budgets fail closed: if the journal cannot be reached the budget
    check refuses the run. An audit whose settings are bad (a
    KERNEL_AUDIT_* variable) is a `ConfigError`, like the journal's: nothing
    runs unaudited because of a typo. One that cannot be built for another
    reason is left out with a one-line warning added to `warnings`.
    `journals` receives the journal, for its statistics.
    `delivery` goes first, before the spec's directory and webhooks.
    `redactor` (None: `Redactor.from_env()`) is shared by the audit and the
    checkpointer: nothing they store holds a secret it knows.

    Raises:
        ConfigError: A bad `$KERNEL_AUDIT_*` setting or `$KERNEL_JOURNAL_SYNC`.
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
        audit = await _with_otel(opts, audit, stack, warnings, redactor)
        critic = None if opts.no_critic else make_critic(opts)
        yield Ports(audit=audit, budget=budget, critic=critic, checkpointer=checkpointer,
                    delivery=_delivery(opts, delivery))


def _audit(journal: Any, warnings: list[PortFailure] | None,
           redactor: Redactor | None = None) -> Audit | None:
    """The audit on `journal`; None (and an `audit.open` warning) if it cannot be built.

    Raises:
        ConfigError: Its settings are bad (a `$KERNEL_AUDIT_*` variable).
    """
    from batteries.audit import JournalAudit
    from kernel import ConfigError

    try:
        return JournalAudit(journal, redactor=redactor)
    except ConfigError:
        raise
    except Exception as exc:
        if warnings is not None:
            message = " ".join(str(exc).split()) or type(exc).__name__
            warnings.append(PortFailure("audit", "open", message))
        return None


def _delivery(opts: PortSpec, first: Delivery | None) -> Delivery | None:
    """`first` (the caller's own), then the directory and each webhook."""
    chosen: list[Delivery] = [first] if first is not None else []
    if opts.deliver_dir or opts.webhooks:
        from batteries.delivery import DirectoryDelivery, FanOutDelivery, WebhookDelivery

        if opts.deliver_dir:
            chosen.append(DirectoryDelivery(opts.deliver_dir))
        chosen.extend(WebhookDelivery(url) for url in opts.webhooks)
        return FanOutDelivery(chosen)
    return first


async def _with_otel(opts: PortSpec, audit: Audit | None, stack: AsyncExitStack,
                     warnings: list[PortFailure] | None,
                     redactor: Redactor | None = None) -> Audit | None:
    """`audit`, teed into an OpenTelemetry export when --otlp or $OTEL_EXPORTER_OTLP_ENDPOINT.

    --otlp without the otel extra is a `ConfigError` (exit 2). The environment
    variable is often set machine-wide: without the extra it is an
    `otlp.open` warning and the run goes on. --otlp "" turns the export off.
    The export is redacted with the audit's `redactor` (the run's own secrets,
    `--redact` patterns), not only with what the environment names.
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
        otel = await stack.enter_async_context(
            OTelAudit.open(endpoint, warnings=warnings, redactor=redactor))
    except ConfigError as exc:
        if opts.otlp is not None:
            raise ConfigError(f"--otlp: {exc}") from exc
        if warnings is not None:
            warnings.append(PortFailure("otlp", "open", f"$OTEL_EXPORTER_OTLP_ENDPOINT: {exc}"))
        return audit
    return otel if audit is None else TeeAudit(audit, otel)


def make_critic(opts: PortSpec) -> Critic:
    """The watch-nursery critic with a spec's thresholds (batteries.critic).

    `--soft-timeout` / `--idle-timeout` / `--model-timeout` / `--tool-timeout`:
    None keeps the critic's default (600 s / 300 s / 300 s / 300 s); 0 turns
    that rule off (no progress judgments / no stall detection / no bound of
    its own for work in flight); a negative value is a `ConfigError` naming
    the flag.

    `--tool-timeout` is also `Limits.tool_timeout`, the kernel's bound on each
    tool call it runs, whose answer is an error result and the run goes on.
    The critic's bound on a tool call in flight is that plus `tool_grace`
    (`tool_timeout_grace`), so the kernel's own timeout answers first; the
    critic kills `tool_timeout` only a tool that outlives it (one that ignores
    cancellation, or a CLI agent's tool, which the kernel does not time).
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
    tool = chosen["tool_timeout"]
    if tool is not None:
        chosen["tool_timeout"] = tool + tool_timeout_grace(tool)
    return WatchCritic(CriticPolicy(soft_timeout=chosen["soft_timeout"],
                                    idle_timeout=chosen["idle_timeout"],
                                    model_timeout=chosen["model_timeout"],
                                    tool_timeout=chosen["tool_timeout"]))


def tool_timeout_grace(tool_timeout: float) -> float:
    """How long past `Limits.tool_timeout` the critic waits before it kills `tool_timeout`.

    A tenth of the timeout, at least 5 s and at most 60 s: room for the kernel
    to cancel the call and for the tool to stop what it started (the shell
    tool's process group gets SIGTERM, then SIGKILL 2 s later).
    """
    return min(max(tool_timeout * 0.1, 5.0), 60.0)


# ------------------------------------------------------------------ one run


class RunControl:
    """Cancel one `run_spec` run from outside and still get its `Result`.

    Cancelling before the run starts cancels it as soon as it does. The first
    cancel decides whether it is final: a final one closes the run's
    checkpoint (`recover` will not resume it), any other leaves it resumable.
    One control serves one run.
    """

    def __init__(self) -> None:
        self.final: str | None = None
        self.signal: signal.Signals | None = None
        self._cancelled = False
        self._scope: trio.CancelScope | None = None

    def cancel(self, *, final: bool = False, reason: str = "cancelled by the host") -> None:
        """End the run `cancelled`; `final` also closes its checkpoint with `reason`."""
        if not self._cancelled:
            self._cancelled = True
            self.final = reason if final else None
        if self._scope is not None:
            self._scope.cancel()

    @property
    def cancelled(self) -> bool:
        """True once `cancel` was called."""
        return self._cancelled

    def _open(self) -> trio.CancelScope:
        """The run's scope (cancelled at once if `cancel` came first)."""
        if self._scope is not None:
            raise RuntimeError("a RunControl serves one run")
        self._scope = trio.CancelScope()
        if self._cancelled:
            self._scope.cancel()
        return self._scope


def _sigset(*names: str) -> frozenset[signal.Signals]:
    return frozenset(getattr(signal, n) for n in names if hasattr(signal, n))


@dataclass(frozen=True, slots=True)
class SignalPolicy:
    """Which signals cancel a run, and which of them are final.

    The defaults are the CLI's: Ctrl-C (SIGINT) is a person deciding to stop,
    final; SIGTERM, SIGHUP (the terminal closed) and SIGQUIT are a shutdown,
    and the run stays resumable for `recover`. Signals are received only in
    the main thread (trio's rule).

    Attributes:
        final: Signals that end the run for good.
        resumable: Signals that end it leaving its checkpoint to resume.
        on_signal: Called with each signal received (the CLI prints a line).
    """

    final: Collection[signal.Signals] = _sigset("SIGINT")
    resumable: Collection[signal.Signals] = _sigset("SIGTERM", "SIGHUP", "SIGQUIT")
    on_signal: Callable[[signal.Signals], None] | None = None


async def watch_signals(control: RunControl, policy: SignalPolicy, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Cancel `control`'s run on the policy's signals until cancelled (use `nursery.start`).

    The signals are caught from the moment this task has started until it
    is cancelled; their default actions (ending the process) do not happen.
    """
    with trio.open_signal_receiver(*policy.final, *policy.resumable) as signals:
        task_status.started()
        async for signum in signals:
            sig = signal.Signals(signum)
            if control.signal is None:
                control.signal = sig
            if policy.on_signal is not None:
                policy.on_signal(sig)
            final = sig in policy.final
            reason = ("cancelled with Ctrl-C" if sig == signal.SIGINT
                      else f"cancelled with {sig.name}")
            control.cancel(final=final, reason=reason)


class _Capture:
    """A Delivery that keeps the result, so a cancelled run still hands one back."""

    result: Result | None = None

    async def deliver(self, result: Result) -> None:
        self.result = result


async def run_spec(spec: RunSpec, agent: Agent, *, resume: Checkpoint | None = None,
                   control: RunControl | None = None, signals: SignalPolicy | None = None,
                   redactor: Redactor | None = None,
                   wrap_audit: Callable[[Audit | None], Audit | None] | None = None,
                   journals: list[Journal] | None = None) -> Result:
    """Run `agent` as `spec` says, with the ports `spec.ports` asks for; its `Result`.

    The spec is registered with the checkpointer first (unless it is a dry
    run), redacted, so `Recovery` can rebuild and resume the run if this
    process dies. The result comes back whatever the status, `cancelled`
    included; port failures (a bad audit setting, a spec that could not be
    registered) are on `result.port_failures`.

    Args:
        spec: The run (what, info, limits, ports, cwd).
        agent: Built from the spec (`adapters.agent_from_spec(spec).agent`).
        resume: A checkpoint to continue from (the same run id).
        control: Cancel the run from another task (`control.cancel()`).
        signals: Cancel it on these signals (main thread only).
        redactor: What keeps secrets out of everything stored (None:
            `Redactor.from_env()`).
        wrap_audit: Wraps the audit before the run (a live progress display).
        journals: Receives the journal, for its statistics.

    Raises:
        ConfigError: The ports cannot be opened as the spec says (a bad
            setting); nothing ran.
    """
    from kernel import Kernel

    control = control or RunControl()
    capture = _Capture()
    warnings: list[PortFailure] = []
    async with trio.open_nursery() as nursery:
        if signals is not None:
            await nursery.start(watch_signals, control, signals)
        async with open_ports(spec.ports, delivery=capture, warnings=warnings,
                              redactor=redactor, journals=journals) as ports:
            if wrap_audit is not None:
                ports.audit = wrap_audit(ports.audit)
            register = getattr(ports.checkpointer, "register", None)
            if not spec.limits.dry_run and register is not None:
                try:
                    await register(spec.run_id, spec)
                except Exception as exc:  # an observer: the run goes on, unrecoverable
                    warnings.append(PortFailure("checkpointer", "register", str(exc)))
                    ports.checkpointer = None
            kernel = Kernel(ports)
            with control._open():
                await kernel.run(agent, spec.info, spec.limits, resume=resume)
            ended = capture.result
            if (control.final is not None and ports.checkpointer is not None
                    and ended is not None and ended.status is Status.CANCELLED):
                with trio.CancelScope(shield=True):
                    try:
                        await ports.checkpointer.fail(spec.run_id, control.final)
                    except Exception as exc:
                        warnings.append(PortFailure("checkpointer", "fail", str(exc)))
        nursery.cancel_scope.cancel()
    result = capture.result
    if result is None:  # pragma: no cover - the kernel delivers every result
        raise RuntimeError("the kernel delivered no result")
    result.port_failures[:0] = warnings
    return result
