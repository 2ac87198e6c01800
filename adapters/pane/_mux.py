"""The multiplexer port (what the pane adapter needs from tmux) and its tmux implementation.

Typing into a terminal UI reliably takes two pauses: one between keys, so a
TUI does not mistake fast input for a paste and mangle it, and a longer one
between the text and Enter, so the UI has drawn the text before it is
submitted. Both come from the environment, read when a `TmuxMultiplexer` is
built (never at import time):

==========================  =======  ==========================================
variable                    default  meaning
==========================  =======  ==========================================
`KERNEL_PANE_KEY_DELAY`     0.01     seconds between keys; 0 types the text in one go
`KERNEL_PANE_SUBMIT_DELAY`  0.3      seconds between the text and Enter
==========================  =======  ==========================================
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio

from kernel import ConfigError

from ._errors import MultiplexerError

#: Seconds between keys when `KERNEL_PANE_KEY_DELAY` is unset.
DEFAULT_KEY_DELAY = 0.01
#: Seconds between the text and Enter when `KERNEL_PANE_SUBMIT_DELAY` is unset.
DEFAULT_SUBMIT_DELAY = 0.3
KEY_DELAY_ENV = "KERNEL_PANE_KEY_DELAY"
SUBMIT_DELAY_ENV = "KERNEL_PANE_SUBMIT_DELAY"


class TargetState(enum.StrEnum):
    """Whether a pane can be acted on."""

    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class TargetStatus:
    """A pane's liveness, with the multiplexer's own words when it is not alive.

    Attributes:
        state: ALIVE (its program runs), DEAD (the program exited and the pane
            was kept), or UNKNOWN (no such session/pane, or no server at all).
        detail: Why, in one line ("can't find pane: %9", "exited with status 0").
        pid: The pane's program's process id (`#{pane_pid}`), when known: the
            critic samples the processes under it.
    """

    state: TargetState
    detail: str = ""
    pid: int | None = None

    @property
    def alive(self) -> bool:
        """True when the pane's program is running."""
        return self.state is TargetState.ALIVE


@runtime_checkable
class Multiplexer(Protocol):
    """A terminal multiplexer holding panes the pane adapter reads and types into.

    **Protocol:** every method may block on a subprocess or socket, so each is
    async and must stay cancellable (let `trio.Cancelled` through). `capture`
    and `send_text` raise `MultiplexerError` when the pane cannot be reached;
    `target_status` never raises for a missing pane (it reports UNKNOWN) and
    raises `MultiplexerError` only when the multiplexer itself cannot be run.
    Calls for one pane are made one at a time by the adapter; an
    implementation need not serialise them itself.
    """

    async def capture(self, target: str) -> str:
        """Return the pane's visible text, wrapped lines joined, trailing blanks dropped."""
        ...

    async def send_text(self, target: str, text: str, *, submit: bool = True) -> None:
        """Type `text` into the pane (newlines become spaces), then Enter if `submit`."""
        ...

    async def target_status(self, target: str) -> TargetStatus:
        """Say whether the pane exists and its program still runs."""
        ...


def env_seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Read a non-negative number of seconds from the environment variable `name`.

    Raises:
        ConfigError: The variable is set to something that is not a finite number >= 0.
    """
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


class TmuxMultiplexer:
    """The `Multiplexer` over the tmux command line (every call through `trio.run_process`).

    Targets are tmux target-panes: `session`, `session:window`,
    `session:window.pane`, `%7`. They are matched exactly (`exact_target`):
    tmux on its own would take `dev` for a session `devprod` once `dev` is
    gone (a prefix or pattern match), or for a window named `dev`, and type
    into the wrong pane.

    Args:
        socket: The tmux server: a name (`tmux -L NAME`) or, if it holds a
            `/`, a socket path (`tmux -S PATH`). None: tmux's default server.
        key_delay: Seconds between keys; None reads `KERNEL_PANE_KEY_DELAY`.
        submit_delay: Seconds before Enter; None reads `KERNEL_PANE_SUBMIT_DELAY`.
        tmux: The tmux executable.
        command_timeout: Bound on each tmux command; a hung server becomes a
            `MultiplexerError` instead of a hung run.

    Raises:
        ConfigError: A delay (given or from the environment) is malformed or negative.
    """

    name = "tmux"

    def __init__(self, *, socket: str | None = None, key_delay: float | None = None,
                 submit_delay: float | None = None, tmux: str = "tmux",
                 command_timeout: float = 10.0) -> None:
        self.socket = socket or None
        self.key_delay = (env_seconds(KEY_DELAY_ENV, DEFAULT_KEY_DELAY)
                          if key_delay is None else key_delay)
        self.submit_delay = (env_seconds(SUBMIT_DELAY_ENV, DEFAULT_SUBMIT_DELAY)
                             if submit_delay is None else submit_delay)
        for label, value in (("key_delay", self.key_delay),
                             ("submit_delay", self.submit_delay)):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"TmuxMultiplexer {label} must be >= 0 seconds, got {value}")
        self.tmux = tmux
        self.command_timeout = command_timeout

    def _argv(self, args: Sequence[str]) -> list[str]:
        argv = [self.tmux]
        if self.socket is not None:
            argv += ["-S" if "/" in self.socket else "-L", self.socket]
        return [*argv, *args]

    async def _run(self, *args: str) -> tuple[int, str, str]:
        """Run one tmux command; return (returncode, stdout, stderr) as text."""
        argv = self._argv(args)
        try:
            with trio.fail_after(self.command_timeout):
                proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                              check=False, stdin=b"")
        except trio.TooSlowError:
            raise MultiplexerError(
                f"tmux {args[0]} did not answer within {self.command_timeout:g}s") from None
        except FileNotFoundError:
            raise MultiplexerError(f"tmux is not installed (no {self.tmux!r} on PATH)") from None
        except OSError as exc:
            raise MultiplexerError(f"cannot run {self.tmux!r}: {exc}") from exc
        out = proc.stdout.decode("utf-8", errors="replace")
        err = proc.stderr.decode("utf-8", errors="replace").strip()
        return proc.returncode, out, err

    async def _check(self, *args: str) -> str:
        code, out, err = await self._run(*args)
        if code != 0:
            why = err.splitlines()[-1] if err else f"exit status {code}"
            raise MultiplexerError(f"tmux {args[0]} failed: {why}")
        return out

    async def capture(self, target: str) -> str:
        """Return the pane's visible text (`capture-pane -p -J`)."""
        out = await self._check("capture-pane", "-p", "-J", "-t", exact_target(target))
        return out.rstrip("\n")

    async def send_text(self, target: str, text: str, *, submit: bool = True) -> None:
        """Type `text` key by key (`send-keys -l`), pause, then press Enter.

        A `;` is sent by its hex code: tmux would read a trailing `;` in an
        argument as a command separator and drop it.
        """
        text = " ".join(text.splitlines())
        target = exact_target(target)
        if self.key_delay > 0:
            for i, key in enumerate(text):
                if i:
                    await trio.sleep(self.key_delay)
                await self._send_literal(target, key)
        elif text:
            await self._send_literal(target, text)
        if submit:
            await trio.sleep(self.submit_delay)
            await self._check("send-keys", "-t", target, "Enter")

    async def _send_literal(self, target: str, text: str) -> None:
        # Split around ';' so no argument ends in one (see send_text).
        chunk: list[str] = []
        for ch in text:
            if ch == ";":
                if chunk:
                    await self._check("send-keys", "-t", target, "-l", "--", "".join(chunk))
                    chunk = []
                await self._check("send-keys", "-t", target, "-H", "3b")
            else:
                chunk.append(ch)
        if chunk:
            await self._check("send-keys", "-t", target, "-l", "--", "".join(chunk))

    async def resolve(self, target: str) -> str:
        """The id (`%7`) of the pane `target` names now, to use for the rest of a run.

        A name is looked up again by every tmux command: `dev` is the session's
        *active* pane, so a person switching panes while we type key by key
        would get the rest of the keys in the other pane. `display-message`
        falls back to some other pane for a target it cannot find, so the target
        is checked strictly (`capture-pane`) before and after asking for its id.

        Raises:
            MultiplexerError: The pane does not exist (or vanished meanwhile).
        """
        exact = exact_target(target)
        if exact.startswith("%"):
            return exact
        strict = ("capture-pane", "-p", "-t", exact, "-S", "0", "-E", "0")
        await self._check(*strict)
        pane = (await self._check("display-message", "-p", "-t", exact, "#{pane_id}")).strip()
        await self._check(*strict)
        if not pane.startswith("%"):
            raise MultiplexerError(f"tmux display-message failed: no pane id for {target!r}")
        return pane

    async def pane_key(self, target: str) -> str:
        """What names the pane on this machine: the server's socket path and the pane id.

        `dev`, `dev:0.0` and `%3` may be one pane: runs serialise on this key
        (`PaneLock`), not on the text of the target.
        """
        out = await self._check("display-message", "-p", "-t", exact_target(target),
                                "#{socket_path}|#{pane_id}")
        return f"tmux:{out.strip()}"

    async def target_status(self, target: str) -> TargetStatus:
        """Check that the pane exists (strictly) and whether its program is still running.

        `capture-pane` resolves the target strictly (`display-message` would
        fall back to another pane), so it decides existence; then
        `display-message` reads the pane's dead flag and exit status.
        """
        exact = exact_target(target)
        code, _, err = await self._run("capture-pane", "-p", "-t", exact, "-S", "0", "-E", "0")
        if code != 0:
            return TargetStatus(TargetState.UNKNOWN,
                                err.splitlines()[-1] if err else f"no tmux pane {target!r}")
        out = await self._check("display-message", "-p", "-t", exact,
                                "#{pane_dead}|#{pane_dead_status}|#{pane_pid}")
        dead, _, rest = out.strip().partition("|")
        status, _, pid = rest.partition("|")
        if dead == "1":
            return TargetStatus(TargetState.DEAD,
                                f"the pane's program exited (status {status or '?'})")
        return TargetStatus(TargetState.ALIVE, pid=int(pid) if pid.isdigit() else None)


#: Window tokens tmux gives a meaning of their own (`session:!` is the last window).
_WINDOW_TOKENS = frozenset({"^", "$", "!", "+", "-"})


def exact_target(target: str) -> str:
    """`target` in the form tmux matches exactly: names get tmux's `=` prefix.

    `dev` -> `=dev:` (the session named exactly dev, its current window and
    pane; a bare `=dev` would be looked up as a window first),
    `dev:work.1` -> `=dev:=work.1`, `dev:2` -> `=dev:2` (a window index).
    Ids (`%3`, `@2`, `$1`), special tokens (`{last}`, `!`) and names already
    marked `=` are kept as they are. Without this, tmux resolves a name it
    cannot find exactly as the start of another (`dev` -> `devprod`) or as
    a pattern.
    """
    t = target.strip()
    if not t or t[0] in "%@{":
        return t
    session, colon, rest = t.partition(":")
    if session and session[0] not in "=$":
        session = "=" + session
    if not colon:
        return session + ":"
    window, dot, pane = rest.partition(".")
    if (window and window[0] not in "=@{" and window not in _WINDOW_TOKENS
            and not window.isdigit()):
        window = "=" + window
    return f"{session}:{window}{dot}{pane}"
