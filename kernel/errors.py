"""The kernel's one error hierarchy.

::

    KernelError                  base of everything the kernel and batteries raise on purpose
    ├── ConfigError              bad input from a user or host (CLI exit code 2)
    ├── AgentError               an agent broke its contract (returned something not a Step)
    └── PortError                a battery failed in a way it reports instead of hiding
        ├── AuditError           the audit store could not be opened, read or written
        │   └── AuditWriteError  buffered audit rows could not be made durable
        └── DeliveryError        a result could not be delivered

`BudgetRefused` (in `kernel.ports`) is how a budget says no; it is not a fault.
Batteries translate their backend's errors into these with ``raise ... from exc``.
"""

from __future__ import annotations


class KernelError(Exception):
    """Base class of the errors the kernel and its batteries raise deliberately."""


class ConfigError(KernelError):
    """Bad input: an unknown option value, a malformed file, a missing variable."""


class AgentError(KernelError):
    """An agent broke its contract with the kernel."""


class PortError(KernelError):
    """A port implementation failed and says so."""


class AuditError(PortError):
    """The audit store could not be opened, read or written."""


class AuditWriteError(AuditError):
    """Audit rows could not be made durable."""


class DeliveryError(PortError):
    """A result could not be delivered."""
