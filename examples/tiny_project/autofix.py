"""A stand-in for a coding agent: fixes the first known bug left in calc.py.

It fixes one bug per run, so the loop needs several test/fix rounds.
Exit status: 0 when it changed something, 1 when it found nothing to fix.
"""

import pathlib
import sys


def main() -> int:
    source = pathlib.Path("calc.py")
    text = source.read_text()
    if "return a - b" in text:
        source.write_text(text.replace("return a - b", "return a + b", 1))
        print("fixed: add() subtracted instead of adding")
        return 0
    head, sep, tail = text.partition("def mul")
    if sep and "return a + b" in tail:
        source.write_text(head + sep + tail.replace("return a + b", "return a * b", 1))
        print("fixed: mul() added instead of multiplying")
        return 0
    print("nothing left that I know how to fix")
    return 1


if __name__ == "__main__":
    sys.exit(main())
