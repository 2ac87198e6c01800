"""The watch-nursery critic: the default `kernel.Critic`.

Two tiers, as DESIGN.md describes them:

- **At the soft timeout** the critic judges progress since its last
  judgment. A progressing run gets its deadline extended (never past the
  hard backstop) and its step ceiling raised. A silent window is the stall
  rule's business (below); with stall detection off, it lets the run time
  out.
- **All the time** it watches for a stalled run (no step, tool call or
  output for `idle_timeout`: nudge, then kill `stalled` after `grace`) and
  a looping one (the same tool call over and over, or an A-B-A-B cycle:
  nudge naming the calls, then kill `looping` if the agent carries on).

Every decision is an audit event of kind `critic`. The decisions come from
a pluggable `Judge`; `RulesJudge` with a `CriticPolicy` is the default::

    from batteries.critic import CriticPolicy, WatchCritic
    critic = WatchCritic(CriticPolicy(idle_timeout=120, loop_repeats=4))
    result = await Kernel(Ports(critic=critic)).run(agent, info, limits)
"""

from typing import TYPE_CHECKING

from kernel._renamed import renamed

from ._evidence import Novelty as Novelty
from ._evidence import call_key as call_key
from ._evidence import line_key as line_key
from ._evidence import mask_volatile as mask_volatile
from ._evidence import masked_call_key as masked_call_key
from ._judge import EMPTY_ANSWER as EMPTY_ANSWER
from ._judge import LOOPING as LOOPING
from ._judge import MODEL_TIMEOUT as MODEL_TIMEOUT
from ._judge import REPEATED_ERROR as REPEATED_ERROR
from ._judge import REPEATING as REPEATING
from ._judge import STALLED as STALLED
from ._judge import TOOL_TIMEOUT as TOOL_TIMEOUT
from ._judge import WAITING_INPUT as WAITING_INPUT
from ._judge import Decision as Decision
from ._judge import Intervention as Intervention
from ._judge import Judge as Judge
from ._judge import Outcome as Outcome
from ._judge import Process as Process
from ._judge import RulesJudge as RulesJudge
from ._judge import RunView as RunView
from ._judge import SupportsQuietUntil as SupportsQuietUntil
from ._judge import Window as Window
from ._judge import find_loop as find_loop
from ._policy import CriticPolicy as CriticPolicy
from ._process import ProcessProbe as ProcessProbe
from ._process import ProcessSampler as ProcessSampler
from ._process import PsutilProbe as PsutilProbe
from ._process import TreeSample as TreeSample
from ._watch import WatchCritic as WatchCritic
from ._watch import WatchHandle as WatchHandle

__all__ = [
    "EMPTY_ANSWER",
    "LOOPING",
    "MODEL_TIMEOUT",
    "REPEATED_ERROR",
    "REPEATING",
    "STALLED",
    "TOOL_TIMEOUT",
    "WAITING_INPUT",
    "CriticPolicy",
    "Decision",
    "Intervention",
    "Judge",
    "Novelty",
    "Outcome",
    "Process",
    "ProcessProbe",
    "ProcessSampler",
    "PsutilProbe",
    "RulesJudge",
    "RunView",
    "SupportsQuietUntil",
    "TreeSample",
    "WatchCritic",
    "WatchHandle",
    "Window",
    "call_key",
    "find_loop",
    "line_key",
    "mask_volatile",
    "masked_call_key",
]


# Names renamed in 0.2 (see README, "Renamed names"): still importable for one
# release, with a DeprecationWarning; type checkers see them as plain aliases.
if TYPE_CHECKING:
    Verdict = Decision


__getattr__ = renamed(__name__, {"Verdict": "Decision"}, globals())
