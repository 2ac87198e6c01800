"""Operations the journal had to give up on are counted (`Journal.unwritten_ops`).

`unwritten` counts events only: a process whose exit flush could write nothing
(the journal locked past its timeout) and could not keep it in a spill file
either (here a real file-size limit on the process: the spill's write fails with
EFBIG) lost a batch's finish or its delivery marks without a word in `unwritten`,
so `kernel batch` exited 0. Real parts: a real journal, a second connection
holding its write lock, a subprocess with `RLIMIT_FSIZE` of 1 byte.
"""

from __future__ import annotations

import json
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import trio

from batteries.store import Journal, journal_path

PATIENCE = 120.0

SCRIPT = """
import json, sys, time, trio
from pathlib import Path
from batteries.store import FinishBatch, Journal, Owner

async def main(db, ready, go):
    async with Journal.open(db, lock_timeout=0.3) as journal:
        Path(ready).touch()
        while not Path(go).exists():  # the test holds the lock and limits us first
            await trio.sleep(0.01)
        await journal.later(FinishBatch("no-such-batch", Owner.me()))
    print(json.dumps({"unwritten": journal.unwritten,
                      "unwritten_ops": journal.unwritten_ops,
                      "spilled": journal.spilled}))

trio.run(main, *sys.argv[1:])
"""


def test_a_lost_operation_alone_is_counted(tmp_path: Path) -> None:
    db = tmp_path / "k.duckdb"

    async def create() -> None:
        async with Journal.open(db) as journal:
            await journal.transact()

    trio.run(create)
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(db), str(ready), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    holder = None
    try:
        deadline = time.monotonic() + PATIENCE  # readiness, not a timing assertion
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the journal never opened"
            time.sleep(0.01)
        holder = sqlite3.connect(journal_path(db), isolation_level=None, timeout=PATIENCE)
        holder.execute("BEGIN EXCLUSIVE")
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, 1))
        go.touch()
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if holder is not None:
            holder.execute("ROLLBACK")
            holder.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    counts = json.loads(out.splitlines()[-1])
    assert counts == {"unwritten": 0, "unwritten_ops": 1, "spilled": 0}, err
