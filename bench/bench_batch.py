"""`kernel batch` against `xargs -P`: the same short commands, measured in the same run.

    python bench/bench_batch.py                          # 1,000 commands, concurrency 32
    python bench/bench_batch.py --tasks 1000 --concurrency 32 --repeat 3
    python bench/bench_batch.py --workers 1              # the runs in the batch process itself
    python bench/bench_batch.py --work 0.05              # each command sleeps 50 ms first
    python bench/bench_batch.py --instructions           # instructions per task (callgrind)

Each task is `sh -c 'echo N >> FILE'` (with `--work S`: `sleep S; echo N >> FILE`,
for all three alike: commands that do something, where the issue's case measures
nothing but the supervisor). Per repeat, in alternating order:
`xargs -P C -I{} sh -c 'echo {} >> FILE'` over the numbers 1..N (the
baseline), then `kernel batch TASKS.jsonl --concurrency C --json` (the
installed executable, as a user runs it: the time includes start-up, reading
and validating the task file, storing the batch, every run with its audit,
budget check, checkpoint registration and critic, and the last journal
transaction). After each batch the analysts' file is brought up to date
(`kernel sync`, not timed) and read back: every task's run must be there
exactly once, `ok`, with exactly one `run_start` and one `run_end` event,
bound to its task in `batch_runs`; and each side-effect file must hold every
number once. Any miss fails the bench (exit 1). Each repeat also runs the
design's floor: the same commands started by a bare trio program (a fresh
interpreter importing only trio, `os.posix_spawnp` in a new session with
stdout and stderr pipes read and the exit awaited on a pidfd, as
`adapters._proc.spawn` does, in as many forked processes as the batch has
workers): what any Python + trio supervisor pays before it does anything of
its own.

Prints wall seconds and CPU seconds (the process and its children, from
`getrusage(RUSAGE_CHILDREN)`; the CPU figure moves less with other work on
the machine), the ratio of batch to xargs for both, and the load average
before and after (the machine is shared). The target is a wall ratio of at
most 1.5 (issue 19); the figure is reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(argv: list[str], **kw: Any) -> tuple[float, float, subprocess.CompletedProcess[bytes]]:
    c0, t0 = _cpu(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False, **kw)
    return time.perf_counter() - t0, _cpu() - c0, done


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # As on a user's machine: bytecode is cached (this machine sets the variable).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("KERNEL_CALLER", "bench")
    return env


def _kernel() -> str:
    exe = Path(sys.executable).with_name("kernel")
    return str(exe) if exe.exists() else "kernel"


#: `--work S`: seconds each command sleeps before its side effect (0: none).
WORK = 0.0


def _before() -> str:
    """What each command does before its side effect (`--work`)."""
    return f"sleep {WORK:g}; " if WORK else ""


def _shell(number: str, out: Path) -> str:
    """The shell text of the task numbered `number` (`{}` for xargs' placeholder)."""
    return f"{_before()}echo {number} >> {out}"


def run_xargs(work: Path, n: int, concurrency: int) -> tuple[float, float]:
    out = work / "xargs.effects"
    numbers = "".join(f"{i}\n" for i in range(n)).encode()
    c0, t0 = _cpu(), time.perf_counter()
    done = subprocess.run(["xargs", "-P", str(concurrency), "-I{}", "sh", "-c",
                           _shell("{}", out)], input=numbers, capture_output=True,
                          check=False)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if done.returncode != 0:
        sys.exit(f"xargs failed: {done.stderr.decode()[-500:]}")
    _check_effects(out, n, "xargs")
    out.unlink()
    return wall, cpu


#: `--workers N` for `kernel batch` (None: its default).
WORKERS: int | None = None

#: The floor of this design: the same commands started by a bare trio program (a
#: fresh interpreter importing trio only), as `adapters._proc.spawn` starts them
#: (`os.posix_spawnp` in a new session, stdin /dev/null, stdout and stderr pipes read
#: to their end, the exit awaited on a pidfd), in as many forked processes as the batch
#: has workers, `concurrency` at once in all: no kernel, critic, audit or task file.
_FLOOR = """
import os, sys, trio
n, concurrency, procs, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
before = sys.argv[5]  # what each command does before its side effect ("" for nothing)

async def one(i):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.posix_spawnp("sh", ["sh", "-c", f"{before}echo {i} >> {out}"], os.environ,
                          setsid=True,
                          file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0),
                                        (os.POSIX_SPAWN_DUP2, w1, 1),
                                        (os.POSIX_SPAWN_DUP2, w2, 2)])
    os.close(w1)
    os.close(w2)
    fd = os.pidfd_open(pid)
    await trio.lowlevel.wait_readable(fd)
    trio.lowlevel.notify_closing(fd)
    os.close(fd)
    os.waitpid(pid, 0)
    for r in (r1, r2):
        stream = trio.lowlevel.FdStream(r)
        while await stream.receive_some():
            pass
        await stream.aclose()

async def run(numbers, at_once):
    async def worker():
        for i in numbers:
            await one(i)
    async with trio.open_nursery() as nursery:
        for _ in range(at_once):
            nursery.start_soon(worker)

children = []
for k in range(procs):
    mine = iter(range(k, n, procs))
    at_once = concurrency // procs + (k < concurrency % procs)
    if k == procs - 1:
        trio.run(run, mine, at_once)
    else:
        pid = os.fork()
        if pid == 0:
            trio.run(run, mine, at_once)
            os._exit(0)
        children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def run_floor(work: Path, n: int, concurrency: int, procs: int) -> tuple[float, float]:
    """The bare trio program (`_FLOOR`) over the same commands: (wall, CPU) seconds."""
    out = work / "floor.effects"
    wall, cpu, done = _timed([sys.executable, "-c", _FLOOR, str(n), str(concurrency),
                              str(procs), str(out), _before()],
                             env=_env())
    if done.returncode != 0:
        sys.exit(f"the bare trio floor failed: {done.stderr.decode()[-500:]}")
    _check_effects(out, n, "bare trio")
    out.unlink()
    return wall, cpu


def _default_workers(n: int) -> int:
    from kernel_cli.batch_workers import default_workers

    return default_workers(n)


def run_batch(work: Path, n: int, concurrency: int, repeat: int) -> tuple[float, float]:
    out = work / f"batch{repeat}.effects"
    tasks = work / f"tasks{repeat}.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "command": [
        "sh", "-c", _shell(str(i), out)]}) + "\n" for i in range(n)))
    db = work / "audit.duckdb"
    workers = [] if WORKERS is None else ["--workers", str(WORKERS)]
    wall, cpu, done = _timed([_kernel(), "batch", str(tasks), "--concurrency",
                              str(concurrency), "--json", "--db", str(db), *workers], env=_env())
    if done.returncode != 0:
        sys.exit(f"kernel batch exited {done.returncode}: {done.stderr.decode()[-800:]}")
    lines = [json.loads(x) for x in done.stdout.decode().splitlines()]
    batch_id = lines[0]["batch_id"]
    if len(lines) != n or {x["status"] for x in lines} != {"ok"}:
        sys.exit(f"kernel batch: {len(lines)} result lines, statuses "
                 f"{sorted({x['status'] for x in lines})}")
    _check_effects(out, n, "kernel batch")
    _check_audit(db, batch_id, n)
    out.unlink()
    return wall, cpu


def _check_effects(path: Path, n: int, who: str) -> None:
    got = sorted(int(x) for x in path.read_text().split())
    if got != list(range(n)):
        sys.exit(f"{who}: side effects wrong: {len(got)} lines, {len(set(got))} distinct")


def _check_audit(db: Path, batch_id: str, n: int) -> None:
    """Every task's run read back from the analysts' file, once, ok, with its events."""
    env = _env()
    subprocess.run([_kernel(), "sync", "--db", str(db)], check=True, capture_output=True,
                   env=env)
    sql = (f"SELECT count(*) AS tasks, count(DISTINCT run_id) AS runs, "
           f"count(*) FILTER (WHERE status = 'ok') AS ok, "
           f"(SELECT count(*) FROM events e JOIN batch_tasks t USING (run_id) "
           f" WHERE t.batch_id = '{batch_id}' AND e.kind = 'run_start') AS starts, "
           f"(SELECT count(*) FROM events e JOIN batch_tasks t USING (run_id) "
           f" WHERE t.batch_id = '{batch_id}' AND e.kind = 'run_end') AS ends, "
           f"(SELECT count(*) FROM runs r JOIN batch_tasks t USING (run_id) "
           f" WHERE t.batch_id = '{batch_id}') AS rows "
           f"FROM batch_runs WHERE batch_id = '{batch_id}'")
    done = subprocess.run([_kernel(), "query", sql, "--format", "json", "--db", str(db)],
                          check=True, capture_output=True, env=env)
    [row] = [json.loads(x) for x in done.stdout.decode().splitlines() if x.strip()]
    want = {"tasks": n, "runs": n, "ok": n, "starts": n, "ends": n, "rows": n}
    if row != want:
        sys.exit(f"audit read back {row}, expected {want}")


#: Task counts whose difference `--instructions` divides by.
_SIZES = (200, 400)

_PREPARE = """
import sys
from kernel_cli.batch_cmd import _prepare_new
_prepare_new(sys.argv[1], sys.argv[2], 32, None, [])
"""


def _callgrind(argv: list[str], out: Path) -> dict[int, int]:
    """Instructions per process (pid -> count) of `argv` under callgrind (forks followed)."""
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p",
                           *argv], capture_output=True, text=True, check=False, env=_env())
    if done.returncode != 0:
        sys.exit(f"{argv[0]} under callgrind exited {done.returncode}: {done.stderr[-800:]}")
    import re

    return {int(pid): int(n) for pid, n in
            re.findall(r"==(\d+)== Collected : (\d+)", done.stderr)}


def instructions(workers: int) -> None:
    """`--instructions`: what one task costs the batch's Python processes, in instructions.

    `kernel batch` of 200 and of 400 tasks under callgrind (`--workers`
    processes are forks: followed; the commands are exec'd: not counted),
    the difference divided by 200. A worker's count includes what the batch
    process did before forking it (start-up, reading the file), so that part
    is measured apart (`_prepare_new` alone, same sizes) and taken out.
    """
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    got: dict[int, tuple[int, list[int], int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-batch-cg-") as tmp:
        work = Path(tmp)
        for n in _SIZES:
            out = work / f"effects{n}"
            tasks = work / f"tasks{n}.jsonl"
            tasks.write_text("".join(json.dumps({"id": f"t{i}", "command": [
                "sh", "-c", f"echo {i} >> {out}"]}) + "\n" for i in range(n)))
            counts = _callgrind([sys.executable, _kernel(), "batch", str(tasks), "-j", "32",
                                 "--json", "--db", str(work / f"a{n}.duckdb"), "--workers",
                                 str(workers)], work / f"cg{n}")
            _check_effects(out, n, "kernel batch")
            first = list(counts)[-1]  # the batch process: it ends after its workers
            prepare = _callgrind([sys.executable, "-c", _PREPARE, str(tasks),
                                  str(work / f"p{n}.duckdb")], work / f"cgp{n}")
            got[n] = (counts[first], [c for p, c in counts.items() if p != first],
                      sum(prepare.values()))
    (a_parent, a_workers, a_prep), (b_parent, b_workers, b_prep) = got[_SIZES[0]], \
        got[_SIZES[1]]
    span = _SIZES[1] - _SIZES[0]
    read = (b_prep - a_prep) / span
    parent = (b_parent - a_parent) / span
    runs = (sum(b_workers) - sum(a_workers)) / span - len(a_workers) * read
    print(f"instructions per task, {workers} workers (callgrind, {_SIZES[1]} minus "
          f"{_SIZES[0]} tasks):")
    print(f"  batch process: {parent / 1e6:.2f} M (reading and validating the line "
          f"{read / 1e6:.2f} M; storing, dispatching, results, --json "
          f"{(parent - read) / 1e6:.2f} M)")
    print(f"  workers (the run): {runs / 1e6:.2f} M")
    print(f"  all Python processes: {(parent + runs) / 1e6:.2f} M")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None,
                    help="kernel batch --workers N (default: the CLI's own default)")
    ap.add_argument("--work", type=float, default=0.0, metavar="SECONDS",
                    help="each command sleeps this long before its side effect (default 0: "
                         "the issue's case, nothing but the supervisors)")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per task under callgrind instead (a figure "
                         "load does not move; --workers default 2)")
    a = ap.parse_args()
    if a.instructions:
        instructions(a.workers or 2)
        return
    if not a.work >= 0:
        sys.exit("--work must be >= 0 seconds")
    global WORKERS, WORK
    WORKERS = a.workers
    WORK = a.work
    rows = []
    floors = []
    procs = WORKERS or _default_workers(a.tasks)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        # Warm-up (not counted): the bytecode cache and the journal exist afterwards.
        run_batch(work, 20, a.concurrency, -1)
        for r in range(a.repeat):
            if r % 2 == 0:
                xw, xc = run_xargs(work, a.tasks, a.concurrency)
                bw, bc = run_batch(work, a.tasks, a.concurrency, r)
            else:
                bw, bc = run_batch(work, a.tasks, a.concurrency, r)
                xw, xc = run_xargs(work, a.tasks, a.concurrency)
            fw, fc = run_floor(work, a.tasks, a.concurrency, procs)
            rows.append((xw, xc, bw, bc))
            floors.append((fw, fc, fw / xw))
            print(f"repeat {r + 1}: xargs {xw:.2f}s wall {xc:.2f}s cpu | kernel batch "
                  f"{bw:.2f}s wall {bc:.2f}s cpu | ratio wall {bw / xw:.2f} cpu {bc / xc:.2f}"
                  f" | bare trio {fw:.2f}s wall {fc:.2f}s cpu (wall {fw / xw:.2f})")
    load1 = os.getloadavg()
    med = [statistics.median(x) for x in zip(*rows, strict=True)]
    ratios = sorted(b / x for x, _, b, _ in rows)
    print(f"{a.tasks} commands{f' of {a.work:g}s each' if a.work else ''} at concurrency "
          f"{a.concurrency}, "
          f"{'default' if a.workers is None else a.workers} workers, {a.repeat} repeats (median): "
          f"xargs -P {a.concurrency} {med[0]:.2f}s wall {med[1]:.2f}s cpu; kernel batch "
          f"{med[2]:.2f}s wall {med[3]:.2f}s cpu; wall ratio {statistics.median(ratios):.2f} "
          f"(best {ratios[0]:.2f}, worst {ratios[-1]:.2f}), cpu ratio "
          f"{med[3] / med[1]:.2f}")
    fmed = [statistics.median(x) for x in zip(*floors, strict=True)]
    print(f"the design's floor, bare trio in {procs} process(es) (no kernel): {fmed[0]:.2f}s "
          f"wall {fmed[1]:.2f}s cpu, wall ratio to xargs {fmed[2]:.2f}")
    print(f"every run audited once (read back after sync); load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
