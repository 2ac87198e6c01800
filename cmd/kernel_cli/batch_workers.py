"""`kernel batch --workers N`: the runs of a batch spread over N worker processes.

One Python thread runs a batch's runs at ~1.3 ms of CPU each (spawning,
the kernel's loop, critic, audit); on a machine with more than one CPU the
batch is then bound by that thread while its commands leave the other CPUs
idle. With `--workers N` the batch process keeps everything that decides
*what* runs (the task file, the batch's lease, skipping finished tasks,
claiming interrupted runs, losing ones without a checkpoint, the
concurrency limit, progress and `--json` lines, the exit code) and hands
each task to one of N worker processes, which *run* it: `WorkerDispatch`
is the batch runner's `Dispatch` (one task in, one `Result` out), as
`RayDispatch` is for a cluster.

A worker is forked from the batch process (`fork_workers`, before trio
starts) and opens its own journal on the same store with the CLI's ports; it
runs each task it is sent with `KernelDispatch`, concurrently, as the batch
process would have: the run's opening transaction registers it under the
worker's process and reserves its caller's budget (a `BEGIN IMMEDIATE`
transaction of the shared store, so one budget holds exactly across
workers), and its audit rows are written by the worker. Only the task in
and the `Result` out cross the pipes (length-prefixed pickles between a
process and the children it forked), and a worker's last frame once its
journal closed, when it lost rows (`JOURNAL_FRAME`: the batch exits 1).

**When something dies.** Each worker is a session of its own registered on
the batch process's lifeline (`adapters._proc.lifeline_add`), so a
SIGKILLed batch takes its workers with it (and each worker's own lifeline
takes its commands), leaving the journal as a SIGKILLed single-process
batch does; `kernel batch --resume` finishes it. SIGTERM/SIGINT of the batch
cancels it: each worker is sent SIGTERM, cancels its runs (their
checkpoints stay `running`, so a resume continues them) and exits. A worker
that dies on its own ends the runs it held with an error saying so; the
journal keeps them unfinished and `--resume` finishes them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from adapters._proc import (
    LIFELINE_ENV,
    lifeline_add,
    lifeline_env,
    lifeline_flush,
    lifeline_release,
    start_time,
)

#: Frames on the pipes: a 4-byte big-endian length, then a pickle.
_HEADER = struct.Struct(">I")
#: The sequence number of a worker's last frame, sent once its journal closed: what the
#: journal could not write (`{"unwritten": N}`); tasks are numbered from 1.
JOURNAL_FRAME = 0
#: Seconds a cancelled worker gets to end its runs before it is SIGKILLed.
STOP_GRACE = 30.0


class WorkerDied(Exception):
    """A worker process ended while it held runs."""


def default_workers(tasks: int) -> int:
    """Workers for a batch of `tasks` runs when none are asked for.

    One per CPU this process may use, but no more than one per 100 runs: a
    worker costs its start-up (~0.3 s of imports), which a small batch does
    not win back, so a batch under 200 runs stays in one process.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    return max(1, min(cpus, tasks // 100))


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _frames(stream: trio.abc.ReceiveStream) -> AsyncIterator[Any]:
    """Objects read from `stream` until its end (a cut frame at the end is dropped)."""
    buf = bytearray()
    while chunk := await stream.receive_some(1 << 16):
        buf += chunk
        start = 0
        while len(buf) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf, start)
            end = start + _HEADER.size + size
            if len(buf) < end:
                break
            yield pickle.loads(buf[start + _HEADER.size:end])
            start = end
        del buf[:start]


# ------------------------------------------------------------ batch process


class Forked:
    """A worker process forked by `fork_workers`: its pid and our ends of its pipes."""

    def __init__(self, pid: int, to_worker: int, from_worker: int) -> None:
        self.pid = pid
        self.to_worker = to_worker
        self.from_worker = from_worker
        self.started = start_time(pid)
        self.returncode: int | None = None
        self._pidfd: int | None = None
        self._lock: trio.Lock | None = None

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the worker's process group (quietly, if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def wait(self) -> int:
        """Wait for the worker to exit and reap it (in trio); its status, -N for signal N."""
        if self._lock is None:
            self._lock = trio.Lock()
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)
        async with self._lock:
            if self.returncode is None:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                    trio.lowlevel.notify_closing(self._pidfd)
                    os.close(self._pidfd)
                    self._pidfd = None
                    self.returncode = _reap(self.pid)  # exited: no waiting
                else:
                    self.returncode = await trio.to_thread.run_sync(
                        _reap, self.pid, abandon_on_cancel=True)
                lifeline_release(self.pid)
        return self.returncode


def _reap(pid: int) -> int:
    """Reap `pid` (blocking until it exits); its status, -N for a death by signal N."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_workers(n: int, setup: dict[str, Any]) -> list[Forked]:
    """Fork `n` workers of this process (call it before `trio.run`, with no other thread).

    A forked worker shares the modules this process imported (a fresh
    interpreter would import them again, ~0.2 s of CPU each), and starts
    with `setup`: the store, `--db`, the redactor and the secrets given on
    resume. Each worker is a session of its own registered on this process's
    lifeline, so it dies with this process; its stdin closing without the
    goodbye frame (this process died) cancels it too. A worker never returns
    from here: it runs its tasks and exits.

    Raises:
        RuntimeError: This process has other threads (a fork would copy none of them).
    """
    import threading

    if threading.active_count() > 1:
        raise RuntimeError("batch workers are forked before any thread starts")
    # The watcher first (a worker forked before it would go unregistered); the
    # workers' commands carry this process's token as well as their worker's.
    setup = {**setup, "lifeline": lifeline_env()}
    sys.stdout.flush()
    sys.stderr.flush()
    # What this process made so far (modules, the tasks) is set aside from the
    # collector: a collection in a worker then never writes to those objects,
    # which would copy the pages it shares with this process (~1,100 fewer page
    # faults per worker for a 1,000-task batch).
    gc.freeze()
    try:
        return _fork(n, setup)
    finally:
        gc.unfreeze()


def _fork(n: int, setup: dict[str, Any]) -> list[Forked]:
    ours: list[int] = []
    workers: list[Forked] = []
    for _ in range(n):
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.setsid()
                for fd in (*ours, task_w, result_r):
                    os.close(fd)
                code = _worker_process(task_r, result_w, setup)
            finally:
                os._exit(code)
        os.close(task_r)
        os.close(result_w)
        ours += [task_w, result_r]
        worker = Forked(pid, task_w, result_r)
        lifeline_add(pid, worker.started)
        workers.append(worker)
    return workers


@dataclass(eq=False)
class _Worker:
    proc: Forked
    stdin: trio.lowlevel.FdStream
    stdout: trio.lowlevel.FdStream
    lock: trio.Lock = field(default_factory=trio.Lock)
    pending: dict[int, _Slot] = field(default_factory=dict)
    dead: str | None = None
    #: Audit events its journal lost as it closed (its last frame, `JOURNAL_FRAME`).
    unwritten: int = 0


@dataclass(eq=False)
class _Slot:
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: str | None = None


class WorkerDispatch:
    """The batch runner's `Dispatch` onto worker processes (see the module docstring).

    Use `open_workers` to run it over the workers `fork_workers` made.
    """

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers
        self._seq = 0

    def __repr__(self) -> str:
        return f"WorkerDispatch({len(self.workers)} workers)"

    @property
    def unwritten(self) -> int:
        """Audit events the workers' journals lost as they closed (neither written nor
        kept in a spill file), as each worker said before it exited."""
        return sum(w.unwritten for w in self.workers)

    async def __call__(self, task: Any, resume: Any) -> Any:
        live = [w for w in self.workers if w.dead is None]
        if not live:
            raise WorkerDied(self.workers[0].dead or "no batch worker is left")
        worker = min(live, key=lambda w: len(w.pending))
        self._seq += 1
        seq, slot = self._seq, _Slot()
        worker.pending[seq] = slot
        try:
            data = _frame((seq, task, resume))
            async with worker.lock:
                await worker.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            worker.pending.pop(seq, None)
            raise WorkerDied(worker.dead or f"batch worker pid {worker.proc.pid} is gone") \
                from None
        await slot.done.wait()
        if slot.error is not None:
            raise WorkerDied(slot.error)
        return slot.result


async def _read_results(worker: _Worker) -> None:
    async for seq, result in _frames(worker.stdout):
        if seq == JOURNAL_FRAME:
            worker.unwritten += int(result.get("unwritten") or 0)
            continue
        slot = worker.pending.pop(seq, None)
        if slot is not None:
            slot.result = result
            slot.done.set()
    rc = await worker.proc.wait()
    worker.dead = (f"batch worker pid {worker.proc.pid} ended "
                   f"({'signal ' + str(-rc) if rc < 0 else 'exit code ' + str(rc)}) while "
                   f"running this task; kernel batch --resume finishes it")
    for slot in worker.pending.values():
        slot.error = worker.dead
        slot.done.set()
    worker.pending.clear()


@asynccontextmanager
async def open_workers(forked: list[Forked]) -> AsyncIterator[WorkerDispatch]:
    """A `WorkerDispatch` onto forked workers, which are ended when the block is.

    On a normal exit each worker is sent the goodbye frame (it finishes what
    it holds, closes its journal and exits) and waited for; when the block is
    cancelled or raises they are sent SIGTERM (they cancel their runs, which
    stay resumable) and SIGKILL after `STOP_GRACE` seconds.
    """
    workers = [_Worker(f, trio.lowlevel.FdStream(f.to_worker),
                       trio.lowlevel.FdStream(f.from_worker)) for f in forked]
    try:
        async with trio.open_nursery() as nursery:
            for w in workers:
                nursery.start_soon(_read_results, w)
            try:
                yield WorkerDispatch(workers)
                for w in workers:
                    with contextlib.suppress(trio.BrokenResourceError):
                        async with w.lock:
                            await w.stdin.send_all(_frame(None))
                for w in workers:
                    await w.proc.wait()
            except BaseException:
                with trio.CancelScope(shield=True):
                    await _stop(forked, signal.SIGTERM, STOP_GRACE)
                raise
    finally:
        with trio.CancelScope(shield=True):
            await _stop(forked, signal.SIGKILL, 0)
            for w in workers:
                await w.stdin.aclose()
                await w.stdout.aclose()


async def _stop(forked: list[Forked], sig: signal.Signals, grace: float) -> None:
    for f in forked:
        if f.returncode is None:
            f.signal(sig)
    with trio.move_on_after(grace):
        for f in forked:
            await f.wait()
    if grace:
        return
    for f in forked:
        await f.wait()


# ------------------------------------------------------------------ worker


def _worker_process(tasks: int, results: int, setup: dict[str, Any]) -> int:
    """A forked worker's life: its exit code. Results go to `results`; anything else
    printed goes to stderr, so a stray print never breaks a frame."""
    os.dup2(2, 1)
    try:
        trio.run(_worker_main, tasks, results, setup)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the batch process reports its runs as ended with it
        print(f"kernel batch: worker pid {os.getpid()}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    finally:
        lifeline_flush()
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
    return 0


async def _worker_main(tasks_fd: int, results_fd: int, setup: dict[str, Any]) -> None:
    os.environ[LIFELINE_ENV] = setup["lifeline"]  # our commands carry the batch's token
    tasks = trio.lowlevel.FdStream(tasks_fd)
    results = trio.lowlevel.FdStream(results_fd)
    journals: list[Any] = []
    try:
        await _serve_tasks(tasks, results, setup, journals)
    finally:
        # The batch process hears what this worker's journal lost (the batch exits 1).
        unwritten = sum(j.unwritten + j.unwritten_ops for j in journals)
        if unwritten:
            with trio.CancelScope(shield=True), contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError):
                await results.send_all(_frame((JOURNAL_FRAME, {"unwritten": unwritten})))


async def _serve_tasks(tasks: trio.lowlevel.FdStream, results: trio.lowlevel.FdStream,
                       setup: dict[str, Any], journals: list[Any]) -> None:
    from batteries.batch import KernelDispatch
    from kernel_cli.batch_cmd import _build, _critics, worker_ports

    write_lock = trio.Lock()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with worker_ports(setup["store"], db=setup["db"],
                                redactor=setup["redactor"], journals=journals) as ports:
            given = setup.get("given")
            dispatch = KernelDispatch(ports, lambda spec: _build(spec, given),
                                      critic_for=_critics(), redacted=True)

            async def one(seq: int, task: Any, resume: Any) -> None:
                result = await dispatch(task, resume)
                async with write_lock:
                    await results.send_all(_frame((seq, result)))

            async with trio.open_nursery() as nursery:

                async def on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                goodbye = False
                async with trio.open_nursery() as runs:
                    async for frame in _frames(tasks):
                        if frame is None:
                            goodbye = True
                            break
                        runs.start_soon(one, *frame)
                    if not goodbye:  # the batch process is gone: stop, as on SIGTERM
                        nursery.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
