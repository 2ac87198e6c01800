"""Renamed public names: the new ones are exported, the old ones still import, with a warning."""

from __future__ import annotations

import importlib
import warnings

import pytest

RENAMED = [
    ("adapters.agentcli", "AgentCLI", "CLIAgent"),
    ("adapters.agentcli", "SessionAgentCLI", "SessionCLIAgent"),
    ("batteries.delivery", "FanOut", "FanOutDelivery"),
    ("batteries.critic", "Verdict", "Decision"),
    ("adapters.loop", "Verdict", "Evaluation"),
]


class TestRenamedNames:
    @pytest.mark.parametrize(("module", "old", "new"), RENAMED)
    def test_old_name_warns_and_is_the_new_class(self, module: str, old: str, new: str) -> None:
        """`from module import Old` gives the new class and a DeprecationWarning naming both."""
        mod = importlib.import_module(module)
        with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use {new}"):
            alias = getattr(mod, old)
        assert alias is getattr(mod, new)

    @pytest.mark.parametrize(("module", "old", "new"), RENAMED)
    def test_new_name_is_public_and_silent(self, module: str, old: str, new: str) -> None:
        """The new name is in `__all__` (the old is not) and importing it warns of nothing."""
        mod = importlib.import_module(module)
        if hasattr(mod, "__all__"):
            assert new in mod.__all__ and old not in mod.__all__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec(f"from {module} import {new}", {})

    def test_unknown_name_is_still_an_attribute_error(self) -> None:
        """The module `__getattr__` answers only for the renamed names."""
        import batteries.critic

        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            batteries.critic.Nope  # type: ignore[attr-defined]  # noqa: B018
