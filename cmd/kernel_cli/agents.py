"""`kernel run --agent KIND`: the builders live in `adapters.specs` (hosts use them too).

Importing this module loads neither the adapters nor httpx: `adapters.specs`
imports them inside its builders.
"""

from __future__ import annotations

from adapters.specs import KINDS as KINDS
from adapters.specs import PRESETS as PRESETS
from adapters.specs import build_agent as build_agent
from adapters.specs import interpolate as interpolate

__all__ = ["KINDS", "PRESETS", "build_agent", "interpolate"]
