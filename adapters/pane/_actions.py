"""The concrete pane actions: `nonce-probe` (is the agent answering?) and `compact`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from kernel import ConfigError

from ._engine import ActionContext, PaneAction
from ._liveness import classify_probe, generate_nonce, has_nonce_echo, is_busy, read_context_pct


class NonceProbe(PaneAction):
    """Functional liveness: type "Repeat <nonce>" and wait for the agent to echo the nonce.

    Precheck: no busy marker in the pane's tail (a busy agent would not
    answer, and typing would queue behind its work). Complete: the nonce
    shows other than in a copy of the request (`cat` echoing "Repeat <nonce>"
    back is no answer). Extras: the nonce and the
    probe classification (alive / busy / silent) of the last snapshot.
    """

    name: ClassVar[str] = "nonce-probe"

    def __init__(self, nonce: str | None = None) -> None:
        self.nonce = nonce

    async def snapshot(self, ctx: ActionContext) -> dict[str, Any]:
        """The pane text."""
        return {"text": await ctx.capture()}

    def precheck(self, before: dict[str, Any]) -> bool:
        """Act only on a pane that does not look busy."""
        return not is_busy(before["text"])

    async def before_send(self, ctx: ActionContext) -> None:
        """Mint the nonce (unless one was given) and note it in the extras."""
        if self.nonce is None:
            self.nonce = generate_nonce()
        ctx.extras["nonce"] = self.nonce

    async def send(self, ctx: ActionContext) -> None:
        """Ask the agent to repeat the nonce."""
        assert self.nonce is not None, "before_send mints the nonce"
        await ctx.type(f"Repeat {self.nonce}")

    def is_complete(self, before: dict[str, Any], now: dict[str, Any]) -> bool:
        """Done once the nonce is echoed (on its own, not as a copy of the request)."""
        return self.nonce is not None and has_nonce_echo(now["text"], self.nonce)

    def describe(self, before: dict[str, Any] | None,
                 after: dict[str, Any] | None) -> dict[str, Any]:
        """The probe classification of the last snapshot."""
        last = after if after is not None else before
        if last is None:
            return {}
        return {"probe": str(classify_probe(last["text"], self.nonce))}


class Compact(PaneAction):
    """Type "/compact" and wait for the context percentage to drop by `min_drop_pct` or more.

    Precheck: the pane is not busy and shows a context percentage. Complete:
    `before - now >= min_drop_pct` (inclusive). Extras: both percentages and
    the drop.

    Args:
        min_drop_pct: Percentage points the context use must fall (0 < x <= 100).

    Raises:
        ConfigError: `min_drop_pct` is out of range.
    """

    name: ClassVar[str] = "compact"
    DEFAULT_MIN_DROP_PCT: ClassVar[float] = 20.0

    def __init__(self, min_drop_pct: float | None = None) -> None:
        value = self.DEFAULT_MIN_DROP_PCT if min_drop_pct is None else float(min_drop_pct)
        if not (0 < value <= 100 and math.isfinite(value)):
            raise ConfigError(f"min_drop_pct must be in (0, 100], got {value:g}")
        self.min_drop_pct = value

    async def snapshot(self, ctx: ActionContext) -> dict[str, Any]:
        """The pane text and the context percentage read from it (None if not shown)."""
        text = await ctx.capture()
        return {"text": text, "context_pct": read_context_pct(text)}

    def precheck(self, before: dict[str, Any]) -> bool:
        """Act only on an idle pane that shows how full the context is."""
        return before["context_pct"] is not None and not is_busy(before["text"])

    async def send(self, ctx: ActionContext) -> None:
        """Ask the agent to compact its context."""
        await ctx.type("/compact")

    def is_complete(self, before: dict[str, Any], now: dict[str, Any]) -> bool:
        """Done once the percentage fell by at least `min_drop_pct`."""
        was, now_pct = before["context_pct"], now["context_pct"]
        if was is None or now_pct is None:
            return False
        # Rounded, so that 80.0 - 60.0 >= 20 is not lost to float noise.
        return bool(round(was - now_pct, 6) >= self.min_drop_pct)

    def describe(self, before: dict[str, Any] | None,
                 after: dict[str, Any] | None) -> dict[str, Any]:
        """The percentages compared, the drop, and the threshold."""
        was = before["context_pct"] if before is not None else None
        now = after["context_pct"] if after is not None else None
        facts: dict[str, Any] = {"min_drop_pct": self.min_drop_pct,
                                 "context_pct_before": was, "context_pct_after": now}
        if before is not None and was is None:
            facts["reason"] = "the pane shows no context percentage"
        elif before is not None and after is None and is_busy(before["text"]):
            facts["reason"] = "the pane is busy"
        if was is not None and now is not None:
            facts["drop_pct"] = round(was - now, 6)
        return facts


#: The actions by name; each factory takes the CLI's options as keywords.
ACTIONS: Mapping[str, Callable[..., PaneAction]] = {
    NonceProbe.name: lambda **_: NonceProbe(),
    Compact.name: lambda *, min_drop_pct=None, **_: Compact(min_drop_pct),
}


def make_action(name: str, *, min_drop_pct: float | None = None) -> PaneAction:
    """Build a fresh action by name.

    Raises:
        ConfigError: No action has that name, or an option is out of range.
    """
    factory = ACTIONS.get(name)
    if factory is None:
        raise ConfigError(f"unknown action {name!r} (choose from: {', '.join(sorted(ACTIONS))})")
    return factory(min_drop_pct=min_drop_pct)
