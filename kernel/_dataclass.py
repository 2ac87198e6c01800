"""`dataclass`, with the generated methods compiled on first use.

`dataclasses.dataclass` writes `__init__`, `__repr__`, `__eq__`, `__hash__`
(and, frozen, `__setattr__`/`__delattr__`) as source text and compiles each
one as the class is defined: ~4 M instructions for a frozen class, paid at
import by every process that imports the module, for ~100 classes of which a
`kernel run` uses a third and `kernel runs` two. Here the class is made a
dataclass at once without those methods (its fields, `__slots__`,
`__match_args__`: `fields()`, `asdict()`, `replace()` and `is_dataclass()`
work from the start), and each method is made by `dataclasses.dataclass`
itself, on a copy of the class body, the first time it is called:
`__init__` at the first instance (or the first `inspect.signature(cls)`),
`__repr__`/`__eq__`/`__hash__` at the first use of one of them. What a
program sees is the same class, with the same methods, as
`dataclasses.dataclass` makes.

Used as `dataclasses.dataclass` is (`@dataclass`, `@dataclass(slots=True,
frozen=True)`, `eq=False`); a class this does not cover (a base class other
than `object`, one of those methods written by hand, no docstring, another
option) is handed to `dataclasses.dataclass` as it is. Type checkers see
`dataclasses.dataclass` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["dataclass"]

if TYPE_CHECKING:
    from dataclasses import dataclass
else:
    def dataclass(cls: type | None = None, /, **options: Any) -> Any:
        """`dataclasses.dataclass(cls, **options)`, its methods compiled on first use."""
        if cls is None:
            return lambda c: _make(c, options)
        return _make(cls, options)


#: The options this module makes lazily; any other goes to dataclasses.dataclass as is.
_OPTIONS = frozenset({"frozen", "slots", "eq"})
#: Methods dataclasses may write: a class that has its own goes to dataclasses as is.
_GENERATED = ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__",
              "__getstate__", "__setstate__")


def _make(cls: type, options: dict[str, Any]) -> Any:
    body = dict(cls.__dict__)
    if (not options.keys() <= _OPTIONS or cls.__bases__ != (object,) or not cls.__doc__
            or any(name in body for name in (*_GENERATED, "__slots__"))):
        return dataclasses.dataclass(cls, **options)
    frozen = bool(options.get("frozen", False))
    eq = bool(options.get("eq", True))
    # Fields, __slots__ (a new class), __match_args__: no source compiled.
    made: Any = dataclasses.dataclass(cls, init=False, repr=False, eq=False,
                                       slots=bool(options.get("slots", False)))
    for key in ("__dict__", "__weakref__"):
        body.pop(key, None)
    body["__qualname__"] = cls.__qualname__

    def generate(init: bool) -> None:
        """Compile `__init__` (init) or the other methods on a copy of the class body,
        with the class's own options, and give them to the class."""
        twin = type(cls.__name__, (), dict(body))
        if init:
            dataclasses.dataclass(twin, init=True, repr=False, eq=False, frozen=frozen)
            names: tuple[str, ...] = ("__init__",)
        else:
            # unsafe_hash makes the hash a frozen eq class gets, without the frozen methods.
            dataclasses.dataclass(twin, init=False, repr=True, eq=eq,
                                  unsafe_hash=eq and frozen)
            names = ("__repr__", "__eq__", "__hash__") if eq and frozen else (
                ("__repr__", "__eq__") if eq else ("__repr__",))
        for name in names:
            setattr(made, name, twin.__dict__[name])

    def first_use(name: str, init: bool) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if made.__dict__[name] is method:
                generate(init)
            return made.__dict__[name](self, *args, **kwargs)

        method.__name__ = name
        method.__qualname__ = f"{made.__qualname__}.{name}"
        return method

    made.__init__ = first_use("__init__", True)
    made.__signature__ = _Signature(lambda: made.__dict__["__init__"], generate)
    made.__repr__ = first_use("__repr__", False)
    if eq:
        made.__eq__ = first_use("__eq__", False)
        made.__hash__ = first_use("__hash__", False) if frozen else None
    if frozen:
        _freeze(made, options.get("slots", False))
    params = made.__dataclass_params__
    params.init, params.repr, params.eq, params.frozen = True, True, eq, frozen
    return made


class _Signature:
    """`inspect.signature(cls)` before the first instance: makes `__init__` first, then
    answers None, so inspect reads the signature from it as for any class."""

    def __init__(self, init: Callable[[], Any], generate: Callable[[bool], None]) -> None:
        self._init = init
        self._generate = generate
        self._placeholder = init()

    def __get__(self, obj: Any, owner: Any = None) -> None:
        if self._init() is self._placeholder:
            self._generate(True)


def _freeze(cls: Any, slots: bool) -> None:
    """What a frozen dataclass has: assignment and deletion raise, and (with slots) the
    state methods pickle and copy use."""
    names = frozenset(f.name for f in dataclasses.fields(cls))

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is cls or name in names:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    for fn in (__setattr__, __delattr__):
        fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
        setattr(cls, fn.__name__, fn)
    if slots:
        fields = dataclasses.fields(cls)

        def __getstate__(self: Any) -> list[Any]:
            return [getattr(self, f.name) for f in fields]

        def __setstate__(self: Any, state: list[Any]) -> None:
            for f, value in zip(fields, state, strict=False):
                object.__setattr__(self, f.name, value)

        cls.__getstate__ = __getstate__
        cls.__setstate__ = __setstate__
