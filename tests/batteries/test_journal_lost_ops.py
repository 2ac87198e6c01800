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
import os
import sys
from pathlib import Path

import trio

from batteries.store import Journal, journal_path
from tests.cmd.test_run_spill_cli import closing_locked

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
    done = closing_locked([sys.executable, "-c", SCRIPT, str(db), str(ready), str(go)],
                          dict(os.environ), tmp_path, journal_path(db), ready.exists, go,
                          limit_files=True)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.splitlines()[-1])
    assert counts == {"unwritten": 0, "unwritten_ops": 1, "spilled": 0}, done.stderr
