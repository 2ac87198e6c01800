"""kernel._dataclass: the same classes as dataclasses.dataclass, methods compiled on first use."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest

from kernel._dataclass import dataclass as lazy


def _define(make: Any, **options: Any) -> type:
    """One class body, made into a dataclass by `make` with `options`, kept in this module
    as `Point` (so pickle finds it) until the next one."""

    class Point:
        """A point."""

        x: int
        y: int = 0
        tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)
        note: str = dataclasses.field(default="", compare=False, repr=False)

    Point.__qualname__ = "Point"
    made = make(**options)(Point)
    globals()["Point"] = made
    return made  # type: ignore[no-any-return]


OPTIONS = [{}, {"frozen": True}, {"slots": True}, {"slots": True, "frozen": True},
           {"slots": True, "eq": False}, {"eq": False}]


def _behaviour(cls: Any) -> list[Any]:
    """Everything a program sees of a dataclass, as plain values."""
    p = cls(1, 2, ("a",), note="n")
    q = cls(1, y=2, tags=("a",), note="other")
    seen: list[Any] = [repr(p), p == q, p != cls(2), p == p, p.__eq__(3)]
    try:
        seen.append(hash(p) == hash(q))
    except TypeError as exc:
        seen.append(str(exc))
    r = cls(3)
    for attempt in (lambda: setattr(r, "x", 5), lambda: delattr(r, "y")):
        try:
            attempt()
            seen.append("changed")
        except dataclasses.FrozenInstanceError as exc:
            seen.append(f"frozen: {exc}")
    seen += [dataclasses.asdict(p), dataclasses.astuple(p), repr(dataclasses.replace(p, y=9)),
             [(f.name, f.default, f.compare, f.repr) for f in dataclasses.fields(cls)],
             cls.__match_args__, getattr(cls, "__slots__", None), dataclasses.is_dataclass(cls),
             cls.__hash__ is None, repr(cls.__dataclass_params__),
             cls.__init__.__qualname__, cls.__repr__.__qualname__, cls.__doc__,
             repr(pickle.loads(pickle.dumps(p))), repr(copy.deepcopy(p)), repr(copy.copy(p)),
             pickle.loads(pickle.dumps(p)).note]
    match p:
        case cls(1, 2):
            seen.append("matched")
    return seen


def _source(method: Any) -> str:
    """Where a method's code comes from: "<string>" for the source dataclasses compiles."""
    return str(getattr(method, "__wrapped__", method).__code__.co_filename)


class TestLikeDataclasses:
    @pytest.mark.parametrize("options", OPTIONS, ids=repr)
    def test_same_behaviour(self, options: dict[str, Any]) -> None:
        """Repr, equality, hash, frozenness, fields, replace, pickle and match are dataclasses'."""
        assert _behaviour(_define(lazy, **options)) == _behaviour(
            _define(dataclasses.dataclass, **options))

    @pytest.mark.parametrize("options", OPTIONS, ids=repr)
    def test_methods_made_on_first_use(self, options: dict[str, Any]) -> None:
        """No method is compiled at definition; __init__ at the first instance, repr/eq/hash
        at the first use of one of them, and from then on the class has dataclasses' own."""
        cls: Any = _define(lazy, **options)
        real: Any = _define(dataclasses.dataclass, **options)
        placeholder = cls.__dict__["__init__"]
        point = cls(1)
        assert cls.__dict__["__init__"] is not placeholder
        assert _source(cls.__dict__["__init__"]) == "<string>"  # compiled by dataclasses
        assert "__repr__" in cls.__dict__
        first = cls.__dict__["__repr__"]
        assert repr(point) == repr(real(1))
        assert cls.__dict__["__repr__"] is not first
        assert _source(cls.__dict__["__repr__"]) == "<string>"

    def test_post_init_and_defaults(self) -> None:
        """__post_init__ runs; a default factory makes a new value per instance."""

        @lazy
        class Counter:
            """Counts."""

            n: int = 0
            seen: list[int] = dataclasses.field(default_factory=list)

            def __post_init__(self) -> None:
                self.n += 1

        a, b = Counter(), Counter()
        a.seen.append(1)
        assert (a.n, b.seen, Counter(5).n) == (1, [], 6)

    def test_a_plain_subclass_uses_the_base_methods(self) -> None:
        """A subclass that is not itself a dataclass gets the base's methods on first use."""

        @lazy(frozen=True)
        class Base:
            """Base."""

            v: int = 1

        class Sub(Base):
            pass

        assert repr(Sub(2)).endswith(".Sub(v=2)")
        assert Sub(2) == Sub(2) and Sub(2) != Base(2)

    def test_classes_it_does_not_cover_go_to_dataclasses(self) -> None:
        """A hand-written method, a base class or another option: dataclasses.dataclass as is."""

        @lazy(order=True)
        class Ordered:
            """Ordered."""

            v: int

        @lazy
        class OwnRepr:
            """Own repr."""

            v: int

            def __repr__(self) -> str:
                return "mine"

        assert Ordered(1) < Ordered(2)
        assert _source(Ordered.__dict__["__init__"]) == "<string>"
        assert repr(OwnRepr(1)) == "mine" and OwnRepr(1) == OwnRepr(1)

    @pytest.mark.parametrize("options", OPTIONS, ids=repr)
    def test_signature_before_the_first_instance(self, options: dict[str, Any]) -> None:
        """inspect.signature(cls) is dataclasses' from the start (it makes __init__ first)."""
        import inspect

        assert str(inspect.signature(_define(lazy, **options))) == str(
            inspect.signature(_define(dataclasses.dataclass, **options)))
