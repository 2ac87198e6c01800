"""Two revisions of the kernel at scale, side by side: is a change faster, or was it the machine?

    python bench/ab_scale.py --base main~1                 # HEAD against main~1
    python bench/ab_scale.py --base v1 --cand v2 --runs 1000 --rounds 5

On a shared machine one `bench_scale` round cannot tell a 5 % change: the
same code moves by 10-20 % from one minute to the next (BENCHMARKS.md). This
checks both revisions out into worktrees under one temporary directory (the
same place on disk for both; the harness, `bench_scale`, is this checkout's),
then runs, `--rounds` times in alternating
order, each revision's `bench_scale` kernel side (N concurrent runs x 100
steps, audit and critic) and bare trio tasks of the same shape, each in a
fresh process. Per measurement it prints wall seconds, the trio thread's CPU,
its idle time, the rest (waiting for the GIL), the collector's seconds and the
ratio to the bare tasks of the same round; at the end the median of each
revision, and the median of the per-round differences (candidate - base),
which cancels most of the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Runs in a fresh interpreter: one side, one measurement, printed as JSON.
_CHILD = """
import gc, json, sys, tempfile
tree, bench, mode = sys.argv[1], sys.argv[2], sys.argv[3]
runs, steps = int(sys.argv[4]), int(sys.argv[5])
sys.path[:0] = [tree, bench]  # the revision's packages, this checkout's harness
from pathlib import Path
import trio
import bench_scale
with tempfile.TemporaryDirectory() as tmp:
    gc.collect()
    with bench_scale.CollectorTime() as collector:
        if mode == "bare":
            wall, _ = trio.run(bench_scale.bare, runs, steps)
            out = {"wall": wall, "trio_cpu": wall, "idle": 0.0}
        else:
            side = trio.run(bench_scale.kernel_runs, runs, steps, Path(tmp) / "ab.duckdb")
            assert side.done == runs, side
            out = {"wall": side.elapsed, "trio_cpu": side.trio_cpu, "idle": side.io_wait}
out["gc"] = collector.seconds
print(json.dumps(out))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def measure(tree: Path, mode: str, runs: int, steps: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(ROOT / "bench"), mode,
                           str(runs), str(steps)],
                          capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"{mode} in {tree} failed:\n{done.stderr.strip()}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--cand", default="HEAD", help="the revision measured (default HEAD)")
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1 or args.runs < 1 or args.steps < 1:
        parser.error("--rounds, --runs and --steps must be at least 1")
    revs = {}
    for name in ("base", "cand"):
        try:
            revs[name] = git("rev-parse", "--verify", getattr(args, name) + "^{commit}")
        except subprocess.CalledProcessError:
            parser.error(f"--{name}: no such revision: {getattr(args, name)}")
    if git("status", "--porcelain", "--untracked-files=no"):
        print("note: this checkout has uncommitted changes; only the revisions are measured "
              "(commit them, or name a branch with --cand)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ab-scale-") as tmp:
        trees = {name: Path(tmp) / name for name in revs}
        for name, rev in revs.items():
            git("worktree", "add", "--detach", "--quiet", str(trees[name]), rev)
        try:
            run(args, revs, trees)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)


def run(args: argparse.Namespace, revs: dict[str, str], trees: dict[str, Path]) -> None:
    print(f"base {revs['base'][:10]}  cand {revs['cand'][:10]}  {args.runs} runs x {args.steps} "
          f"steps, {args.rounds} rounds, each side in a fresh process")
    print(f"{'round':>5} {'side':>5} {'wall s':>7} {'trio cpu':>9} {'idle':>6} {'rest':>6} "
          f"{'gc s':>6} {'bare s':>7} {'x bare':>7}")
    walls: dict[str, list[float]] = {"base": [], "cand": []}
    ratios: dict[str, list[float]] = {"base": [], "cand": []}
    for i in range(args.rounds):
        order = ("base", "cand") if i % 2 == 0 else ("cand", "base")
        diff = {}
        for name in order:
            k = measure(trees[name], "kernel", args.runs, args.steps)
            b = measure(trees[name], "bare", args.runs, args.steps)
            rest = max(0.0, k["wall"] - k["trio_cpu"] - k["idle"])  # clocks' granularity
            walls[name].append(k["wall"])
            ratios[name].append(k["wall"] / b["wall"])
            diff[name] = k["wall"]
            print(f"{i + 1:>5} {name:>5} {k['wall']:>7.2f} {k['trio_cpu']:>9.2f} "
                  f"{k['idle']:>6.2f} {rest:>6.2f} {k['gc']:>6.2f} {b['wall']:>7.2f} "
                  f"{k['wall'] / b['wall']:>7.2f}")
        walls.setdefault("diff", []).append(diff["cand"] - diff["base"])
    for name in ("base", "cand"):
        print(f"median {name}: {statistics.median(walls[name]):.2f} s, "
              f"{statistics.median(ratios[name]):.2f}x bare")
    d = statistics.median(walls["diff"])
    print(f"median of the rounds' differences (cand - base): {d:+.2f} s "
          f"({d / statistics.median(walls['base']) * 100:+.1f} %)")


if __name__ == "__main__":
    main()
