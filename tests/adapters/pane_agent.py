"""A tiny stand-in for a coding agent in a tmux pane, for the pane adapter's tests.

Run in a pane as `python pane_agent.py --mode MODE`. It prints "agent ready",
a status line "context: NN%" and a "> " prompt, then, line by line:

- alive:   "Repeat X" is answered with "X"; "/compact" shows "Compacting",
           then drops the context to --compact-to; anything else is acknowledged.
- busy:    shows "Working… (esc to interrupt)" and answers nothing.
- silent:  takes input and answers nothing.
- fragile: exits as soon as it receives the first key (the pane then closes,
           so the rest of the typing fails).

Standard library only; the tests start it with the test run's Python.
"""

from __future__ import annotations

import argparse
import sys
import time
import tty


def main() -> int:
    """Play the agent until stdin closes."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["alive", "busy", "silent", "fragile"],
                        default="alive")
    parser.add_argument("--context", type=float, default=80.0)
    parser.add_argument("--compact-to", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds before answering")
    args = parser.parse_args()
    pct = args.context
    if args.mode == "fragile":
        tty.setcbreak(sys.stdin.fileno())  # before "ready": no key can be flushed away
        print("agent ready", flush=True)
        sys.stdin.read(1)
        return 0
    print("agent ready", flush=True)
    if args.mode == "busy":
        print("✻ Working… (esc to interrupt)", flush=True)
    print(f"context: {pct:g}%", flush=True)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if args.mode != "alive":
            continue
        time.sleep(args.delay)
        if line.startswith("Repeat "):
            print(line.removeprefix("Repeat ").strip(), flush=True)
        elif line == "/compact":
            print("Compacting", flush=True)
            time.sleep(args.delay)
            pct = args.compact_to
            print("Compacted.", flush=True)
        else:
            print(f"ok: {line}", flush=True)
        print(f"context: {pct:g}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
