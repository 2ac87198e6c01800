"""Old names kept importable for one release (README, "Renamed names").

A package that renamed a public name answers the old one through a module
`__getattr__` made here: the new object, with a `DeprecationWarning` naming
the replacement. Type checkers see the old names as plain aliases, declared
under `TYPE_CHECKING` in the package itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, str],
            namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module` answering each old name in `names` (old -> new)
    with the new name's object from `namespace` (the module's `globals()`)."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: use {new}", DeprecationWarning,
                      stacklevel=2)
        return namespace[new]

    return __getattr__
