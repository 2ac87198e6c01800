"""A tiny calculator with two bugs, for the fix-until-tests-pass example loop."""


def add(a: int, b: int) -> int:
    """The sum of a and b."""
    return a - b


def mul(a: int, b: int) -> int:
    """The product of a and b."""
    return a + b
