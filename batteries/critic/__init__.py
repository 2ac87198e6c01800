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

from ._judge import LOOPING as LOOPING
from ._judge import STALLED as STALLED
from ._judge import Intervention as Intervention
from ._judge import Judge as Judge
from ._judge import RulesJudge as RulesJudge
from ._judge import RunView as RunView
from ._judge import Verdict as Verdict
from ._judge import Window as Window
from ._judge import call_key as call_key
from ._judge import find_loop as find_loop
from ._policy import CriticPolicy as CriticPolicy
from ._watch import WatchCritic as WatchCritic
from ._watch import WatchHandle as WatchHandle

__all__ = [
    "LOOPING",
    "STALLED",
    "CriticPolicy",
    "Intervention",
    "Judge",
    "RulesJudge",
    "RunView",
    "Verdict",
    "WatchCritic",
    "WatchHandle",
    "Window",
    "call_key",
    "find_loop",
]
