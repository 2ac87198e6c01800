"""What redaction adds to the audit's hot path, against the same calls without it.

    python bench/bench_redact.py [--calls N] [--best-of K]

Each variant is timed K times, alternating, in process CPU time, and the
best is reported (the machine is shared). Three variants of the same payloads:

1. encode: `encode_payload` alone (orjson + caps), no redactor: the baseline.
2. encode + redact: with `Redactor.from_env()` over an environment holding
   five secret-named variables (so five literal values are checked too).
3. recorder call: `DuckDBRecorder.log_event` (encode + buffer append), with a
   redactor that can change nothing vs the default one.

Payloads are typical events (step, output lines, tool results, action_end)
with no secret in them, then the same mix where 1 payload in 20 holds a
token, to show the cost of the slow path (the armed rules' regexes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from batteries.audit import DuckDBAudit
from batteries.audit._encode import encode_payload
from batteries.audit._recorder import DuckDBRecorder
from batteries.redact import Redactor
from batteries.store import Journal
from kernel import RunInfo

ENV = {"GITHUB_TOKEN": "ghp_ZYXWVUTSRQPONMLKJIHGFEDCBA9876543210",
       "OPENAI_API_KEY": "sk-abcdefghijklmnopqrstuvwxyz012345",
       "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
       "DB_PASSWORD": "correct-horse-battery", "NPM_TOKEN": "npm_abcdefghijklmnop0123",
       "HOME": "/root", "PATH": "/usr/bin:/bin"}

CLEAN: list[dict[str, Any]] = [
    {"final": False, "tool_calls": 0, "output": "thinking..."},
    {"line": "tests/test_loop.py::TestRun::test_something_long PASSED          [ 45%]"},
    {"output": "result 123", "error": None},
    {"line": "Compiling kernel v0.1.0 (/work/project) through the night"},
    {"state": "test", "exit_code": 1, "signal": None, "timed_out": False,
     "output_tail": "FAILED tests/test_app.py::test_add - assert 3 == 4\n1 failed in 0.02s",
     "stderr_tail": ""},
    {"args": {"path": "/tmp/src/main.py"}, "id": "call_1"},
]
SECRET = {"line": "export GITHUB_TOKEN=ghp_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"}


def best(fn: Callable[[], None], calls: int, rounds: int) -> float:
    """Best of `rounds` timings of `fn`, in CPU microseconds per call.

    CPU time of this process, not wall time: on a shared machine the wall
    clock also counts the time other processes held the core.
    """
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) / calls * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--best-of", type=int, default=7)
    args = parser.parse_args()
    n, k = args.calls, args.best_of
    redactor = Redactor.from_env(ENV)
    off = Redactor(shapes=False)
    mixes = {"no secrets": [CLEAN[i % len(CLEAN)] for i in range(n)],
             "1 in 20 with a token": [SECRET if i % 20 == 0 else CLEAN[i % len(CLEAN)]
                                      for i in range(n)]}
    print(f"calls per round: {n:,}, best of {k}")
    print(f"{'variant':46} {'us/call':>8} {'x base':>7}")
    for label, payloads in mixes.items():
        def plain(p: list[dict[str, Any]] = payloads) -> None:
            for x in p:
                encode_payload(x, 65536, 262144)

        def redacted(p: list[dict[str, Any]] = payloads) -> None:
            for x in p:
                encode_payload(x, 65536, 262144, redactor)

        # Journals that never write here (no flusher; a batch larger than a round).
        audit = DuckDBAudit(Journal(":memory:", batch_size=10 * n, max_pending_events=20 * n),
                            redactor=off)
        rec_off = DuckDBRecorder(audit, RunInfo(name="bench"))
        audit_on = DuckDBAudit(Journal(":memory:", batch_size=10 * n,
                                       max_pending_events=20 * n), redactor=redactor)
        rec_on = DuckDBRecorder(audit_on, RunInfo(name="bench"))

        def record(rec: DuckDBRecorder, a: DuckDBAudit, p: list[dict[str, Any]]) -> None:
            log = rec.log_event
            for x in p:
                log("output", payload=x)
            a.journal.pending = type(a.journal.pending)()  # drop the buffered rows

        timings: dict[str, list[float]] = {"e": [], "r": [], "ro": [], "rn": []}
        for _ in range(k):  # alternate, so both see the same machine
            timings["e"].append(best(plain, n, 1))
            timings["r"].append(best(redacted, n, 1))
            timings["ro"].append(best(partial(record, rec_off, audit, payloads), n, 1))
            timings["rn"].append(best(partial(record, rec_on, audit_on, payloads), n, 1))
        e, r, ro, rn = (min(timings[x]) for x in ("e", "r", "ro", "rn"))
        print(f"[{label}]")
        print(f"{'  encode_payload (baseline)':46} {e:8.2f} {1.0:7.2f}")
        print(f"{'  encode_payload + redact':46} {r:8.2f} {r / e:7.2f}")
        print(f"{'  recorder.log_event, nothing to redact':46} {ro:8.2f} {1.0:7.2f}")
        print(f"{'  recorder.log_event, default redactor':46} {rn:8.2f} {rn / ro:7.2f}")
        print(f"  redaction adds {r - e:.2f} us per payload")


if __name__ == "__main__":
    main()
