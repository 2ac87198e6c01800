"""Whole-process wall time of everyday `kernel` commands, against `python -c pass`.

    python bench/bench_cli.py [--runs N] [--only NAME ...] [--baseline KERNEL]

Each case is the installed `kernel` executable started afresh (as a user's
shell starts it), timed from spawn to exit; the cases are run round-robin,
N times each (default 21), so load on the shared machine hits them alike.
The median wall time is reported with the median CPU time (user + system,
which load on the shared machine disturbs less), each also as a ratio to
the baseline `python -c pass` (the same interpreter, measured in the same
rounds), with the load average before and after, and the issue 17 target.
With `--baseline KERNEL` (another `kernel` executable, e.g. one installed
from main in its own venv), every kernel case is also run with it, in the
same rounds. The audit database is
a fresh one in a temporary $HOME holding a few runs.
Bytecode is written as on a user's machine (PYTHONDONTWRITEBYTECODE unset).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL = shutil.which("kernel") or str(Path(sys.executable).with_name("kernel"))

#: name -> (argv, target seconds or None, expected exit code)
CASES: dict[str, tuple[list[str], float | None, int]] = {
    "python -c pass": ([sys.executable, "-c", "pass"], None, 0),
    "kernel --help": ([KERNEL, "--help"], 0.15, 0),
    "kernel run -- true": ([KERNEL, "run", "--", "true"], 0.20, 0),
    "kernel runs": ([KERNEL, "runs"], 0.25, 0),
    "kernel run --timeout 1 -- sleep 30": (
        [KERNEL, "run", "--timeout", "1", "--", "sleep", "30"], 1.30, 124),
}


def main() -> None:
    """Time every case, round-robin, and print a Markdown table of medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="runs of each case (>= 20)")
    parser.add_argument("--only", nargs="*", help="case names to run (and the baseline)")
    parser.add_argument("--baseline", metavar="KERNEL",
                        help="another kernel executable to time the same cases with")
    ns = parser.parse_args()
    cases = {k: v for k, v in CASES.items()
             if not ns.only or k == "python -c pass" or k in ns.only}
    if ns.baseline:
        for name, (argv, _target, code) in list(cases.items()):
            if argv[0] == KERNEL:
                cases[f"baseline: {name}"] = ([ns.baseline, *argv[1:]], None, code)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONDONTWRITEBYTECODE", "KERNEL_DB")}
        env.update(HOME=home, XDG_DATA_HOME=str(Path(home) / "data"))
        for exe in (KERNEL, ns.baseline or KERNEL):  # a few runs; bytecode compiled once
            for _ in range(2):
                subprocess.run([exe, "run", "--", "true"], env=env, capture_output=True,
                               check=True, stdin=subprocess.DEVNULL)
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(ns.runs):
            for name, (argv, _target, code) in cases.items():
                t0 = time.perf_counter()
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
                assert proc.stderr is not None
                err = proc.stderr.read()
                _, status, usage = os.wait4(proc.pid, 0)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(usage.ru_utime + usage.ru_stime)
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode != code:
                    sys.exit(f"{name}: exit {proc.returncode}, expected {code}: "
                             f"{err.decode(errors='replace')}")
    base = statistics.median(times["python -c pass"])
    base_cpu = statistics.median(cpu["python -c pass"])
    print(f"{ns.runs} runs each, round-robin; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)\n")
    print("| command | median wall | p90 wall | wall minus `python -c pass` | wall / "
          "`python -c pass` | median CPU (user+sys) | CPU / `python -c pass` | target (wall) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, samples in times.items():
        med = statistics.median(samples)
        p90 = statistics.quantiles(samples, n=10)[-1]
        med_cpu = statistics.median(cpu[name])
        target = cases[name][1]
        verdict = "" if target is None else (
            f"{target:.2f} s {'met' if med <= target else 'missed'}")
        print(f"| `{name}` | {med:.3f} s | {p90:.3f} s | {med - base:.3f} s | "
              f"{med / base:.1f}x | {med_cpu:.3f} s | {med_cpu / base_cpu:.1f}x | {verdict} |")


if __name__ == "__main__":
    main()
