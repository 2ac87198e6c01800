"""YAML state-machine loops: `kernel run LOOP.yaml`, `kernel validate`, dry runs.

A loop file names states; each state runs an action (a shell command, a
prompt, an MCP tool call, or a whole sub-loop), evaluates the result into a
verdict, and routes on it. `LoopAgent` runs one state per kernel step::

    spec = load_loop("examples/fix-until-tests-pass.yaml")
    result = await Kernel(ports).run(LoopAgent(spec), RunInfo(name=spec.name),
                                      spec.limits())

The public surface is re-exported here; the modules behind it are private.
PyYAML is imported only when a file is read.
"""

from typing import TYPE_CHECKING

from kernel._renamed import renamed

from ._agent import LoopAgent as LoopAgent
from ._agent import detect_signal as detect_signal
from ._evaluators import Evaluation as Evaluation
from ._evaluators import JudgeRequest as JudgeRequest
from ._evaluators import VerdictSource as VerdictSource
from ._process import ActionResult as ActionResult
from ._simulation import SCENARIOS as SCENARIOS
from ._simulation import Asker as Asker
from ._spec import EvaluateSpec as EvaluateSpec
from ._spec import LLMSpec as LLMSpec
from ._spec import LoopSpec as LoopSpec
from ._spec import Problem as Problem
from ._spec import RouteSpec as RouteSpec
from ._spec import StateSpec as StateSpec
from ._spec import parse_loop as parse_loop
from ._template import MissingVariable as MissingVariable
from ._template import TemplateError as TemplateError
from ._template import UnsafeValue as UnsafeValue
from ._validate import LoopFileError as LoopFileError
from ._validate import Report as Report
from ._validate import check_loop as check_loop
from ._validate import load_loop as load_loop

__all__ = [
    "SCENARIOS",
    "ActionResult",
    "Asker",
    "EvaluateSpec",
    "Evaluation",
    "JudgeRequest",
    "LLMSpec",
    "LoopAgent",
    "LoopFileError",
    "LoopSpec",
    "MissingVariable",
    "Problem",
    "Report",
    "RouteSpec",
    "StateSpec",
    "TemplateError",
    "UnsafeValue",
    "VerdictSource",
    "check_loop",
    "detect_signal",
    "load_loop",
    "parse_loop",
]


# Names renamed in 0.2 (see README, "Renamed names"): still importable for one
# release, with a DeprecationWarning; type checkers see them as plain aliases.
if TYPE_CHECKING:
    Verdict = Evaluation


__getattr__ = renamed(__name__, {"Verdict": "Evaluation"}, globals())
