"""The pane adapter's errors.

::

    kernel.KernelError
    └── PaneError               base of what the pane adapter raises on purpose
        ├── MultiplexerError    a multiplexer command failed (no server, no pane, tmux missing)
        └── PaneLockError       the pane's lock file cannot be used safely

Bad settings (a malformed `KERNEL_PANE_*` variable, an unknown action name,
an out-of-range `min_drop_pct`) are `kernel.ConfigError`s instead.
"""

from __future__ import annotations

from kernel import KernelError


class PaneError(KernelError):
    """Base class of the pane adapter's errors."""


class MultiplexerError(PaneError):
    """A multiplexer command failed; the message names the command and says why."""


class PaneLockError(PaneError):
    """The pane's lock cannot be taken safely (a directory or file someone else controls).

    Nothing may be typed then: without the lock, two runs could type into one pane.
    """
