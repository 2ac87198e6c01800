"""The run kernel: run agent runs under trio, supervised, with every step audited.

The public surface is re-exported here; the modules behind it are private.

The library logs through the standard `logging` module, under loggers named
`kernel`, `kernel.journal`, `kernel.critic`, `kernel.llm`, ...; the `kernel`
logger has a `NullHandler`, so nothing is printed unless the host configures
logging (e.g. `logging.basicConfig(level=logging.WARNING)`).
"""

import logging as _logging
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._spec import AgentSpec as AgentSpec
from ._spec import CommandSpec as CommandSpec
from ._spec import LoopSpec as LoopSpec
from ._spec import PortSpec as PortSpec
from ._spec import RunSpec as RunSpec
from ._types import Limits as Limits
from ._types import Message as Message
from ._types import PortFailure as PortFailure
from ._types import Result as Result
from ._types import RunInfo as RunInfo
from ._types import RunStats as RunStats
from ._types import Status as Status
from ._types import Step as Step
from ._types import ToolCall as ToolCall
from ._types import ToolResult as ToolResult
from ._types import Usage as Usage
from ._types import UsageLimits as UsageLimits
from ._types import new_run_id as new_run_id
from .errors import AgentError as AgentError
from .errors import AuditError as AuditError
from .errors import AuditWriteError as AuditWriteError
from .errors import ConfigError as ConfigError
from .errors import DeliveryError as DeliveryError
from .errors import KernelError as KernelError
from .errors import PortError as PortError
from .ports import Agent as Agent
from .ports import Audit as Audit
from .ports import Budget as Budget
from .ports import BudgetRefused as BudgetRefused
from .ports import Checkpoint as Checkpoint
from .ports import Checkpointer as Checkpointer
from .ports import Critic as Critic
from .ports import CriticHandle as CriticHandle
from .ports import Delivery as Delivery
from .ports import EventSink as EventSink
from .ports import Ports as Ports
from .ports import RunRecorder as RunRecorder
from .ports import SupportsAttach as SupportsAttach
from .ports import SupportsFixedCeiling as SupportsFixedCeiling
from .ports import SupportsNextLook as SupportsNextLook
from .ports import SupportsPricing as SupportsPricing
from .ports import SupportsProcesses as SupportsProcesses
from .ports import SupportsResumedStart as SupportsResumedStart
from .ports import SupportsRunBudget as SupportsRunBudget
from .ports import SupportsSimulate as SupportsSimulate
from .ports import SupportsSnapshot as SupportsSnapshot
from .ports import SupportsSteer as SupportsSteer
from .ports import SupportsStepEnd as SupportsStepEnd
from .ports import SupportsToolEnd as SupportsToolEnd
from .ports import SupportsTools as SupportsTools
from .ports import takes_resumed as takes_resumed

if _TYPE_CHECKING:
    from ._context import RunContext as RunContext
    from ._loop import Kernel as Kernel


def __getattr__(name: str) -> _Any:
    """`Kernel` and `RunContext` are imported on first use: they bring trio, which
    programs that only read the audit (`kernel runs`, `kernel show`) never need."""
    if name == "Kernel":
        from ._loop import Kernel

        return Kernel
    if name == "RunContext":
        from ._context import RunContext

        return RunContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "Kernel", "RunContext"})


_logging.getLogger("kernel").addHandler(_logging.NullHandler())

__all__ = [
    "Agent",
    "AgentError",
    "AgentSpec",
    "Audit",
    "AuditError",
    "AuditWriteError",
    "Budget",
    "BudgetRefused",
    "Checkpoint",
    "Checkpointer",
    "CommandSpec",
    "ConfigError",
    "Critic",
    "CriticHandle",
    "Delivery",
    "DeliveryError",
    "EventSink",
    "Kernel",
    "KernelError",
    "Limits",
    "LoopSpec",
    "Message",
    "PortError",
    "PortFailure",
    "PortSpec",
    "Ports",
    "Result",
    "RunContext",
    "RunInfo",
    "RunRecorder",
    "RunSpec",
    "RunStats",
    "Status",
    "Step",
    "SupportsAttach",
    "SupportsFixedCeiling",
    "SupportsNextLook",
    "SupportsPricing",
    "SupportsProcesses",
    "SupportsResumedStart",
    "SupportsRunBudget",
    "SupportsSimulate",
    "SupportsSnapshot",
    "SupportsSteer",
    "SupportsStepEnd",
    "SupportsToolEnd",
    "SupportsTools",
    "ToolCall",
    "ToolResult",
    "Usage",
    "UsageLimits",
    "new_run_id",
    "takes_resumed",
]
