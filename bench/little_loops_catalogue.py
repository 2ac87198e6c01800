"""Run little-loops' public loop catalogue through `kernel validate` and a dry run.

    python bench/little_loops_catalogue.py PATH [--list] [--reference]

PATH is a checkout of https://github.com/BrennonTWilliams/little-loops (or its
`scripts/little_loops/loops` directory). Every `*.yaml` under the catalogue
(including `lib/` and `oracles/`) goes through

1. `kernel validate FILE` (exit 0: it validates, warnings allowed), and
2. `kernel run --no-audit --dry-run --scenario all-pass FILE`: it dry-runs
   when the command exits 0 and the walk it prints ends without an error
   (a terminal, a failure terminal, a signal, or the step limit); a refusal
   or a walk that ends `-> error: ...` (no route for a verdict, a missing
   variable) does not.

It prints the counts and, with `--list`, every file that does not validate or
dry-run with the first reason. With `--reference` it also asks little-loops'
own validator (imported from the checkout; skipped when it cannot be
imported) which files it accepts, and lists the ones it accepts that we refuse.
Nothing is fetched: without a checkout there is nothing to do (exit 0, a note).
The tests run this script against small self-written loops only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def catalogue(root: Path) -> Path | None:
    """The catalogue directory inside a checkout (or `root` itself if it is one)."""
    for candidate in (root / "scripts" / "little_loops" / "loops", root):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def kernel_exe() -> str:
    candidate = Path(sys.executable).parent / "kernel"
    return str(candidate) if candidate.exists() else "kernel"


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith(("error:", "kernel run: error:", "kernel validate: error:")):
            return line.split("error:", 1)[1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def check(path: Path, exe: str, env: dict[str, str]) -> dict[str, object]:
    """Validate and dry-run one file; return what happened."""
    val = subprocess.run([exe, "validate", str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    dry = subprocess.run([exe, "run", "--no-audit", "--dry-run", "--scenario", "all-pass",
                          str(path)], capture_output=True, text=True, env=env, timeout=120,
                         stdin=subprocess.DEVNULL)
    warnings = sum(1 for line in val.stdout.splitlines() if line.startswith("warning:"))
    walk_error = next((line.split("-> error:", 1)[1].strip()
                       for line in dry.stdout.splitlines() if "-> error:" in line), None)
    dry_ok = dry.returncode == 0 and walk_error is None
    return {"file": str(path), "validates": val.returncode == 0, "warnings": warnings,
            "validate_reason": "" if val.returncode == 0 else first_line(val.stdout),
            "dry_runs": dry_ok, "dry_run_exit": dry.returncode,
            "dry_run_reason": "" if dry_ok else walk_error or first_line(dry.stderr)}


REFERENCE = """
import json, sys
from pathlib import Path
from little_loops.fsm.validation import load_and_validate
out = {}
for name in sys.argv[1:]:
    try:
        load_and_validate(Path(name))
        out[name] = True
    except Exception as exc:
        out[name] = str(exc).splitlines()[0][:200]
print(json.dumps(out))
"""


def reference(files: list[Path], root: Path) -> dict[str, object] | None:
    """little-loops' own verdict per file, or None when its validator cannot be imported."""
    scripts = root / "scripts"
    if not (scripts / "little_loops").is_dir():
        return None
    env = {**os.environ, "PYTHONPATH": str(scripts)}
    proc = subprocess.run([sys.executable, "-c", REFERENCE, *map(str, files)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        return None
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="a little-loops checkout (or its loops directory)")
    ap.add_argument("--list", action="store_true", help="list every file we refuse, and why")
    ap.add_argument("--reference", action="store_true",
                    help="also run little-loops' own validator from the checkout")
    ap.add_argument("--json", action="store_true", help="print the per-file results as JSON")
    args = ap.parse_args(argv)
    loops = catalogue(args.path)
    if loops is None:
        print(f"no little-loops catalogue at {args.path}: nothing to do")
        return 0
    files = sorted(loops.rglob("*.yaml"))
    exe = kernel_exe()
    env = {**os.environ, "NO_COLOR": "1", "KERNEL_DB": os.devnull}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda p: check(p, exe, env), files))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    validated = sum(1 for r in results if r["validates"])
    dry = sum(1 for r in results if r["dry_runs"])
    warnings = sum(int(r["warnings"]) for r in results)  # type: ignore[call-overload]
    print(f"{len(files)} catalogue files: {validated} validate ({warnings} warnings), "
          f"{dry} dry-run (--scenario all-pass)")
    if args.reference:
        ref = reference(files, args.path)
        if ref is None:
            print("little-loops' own validator could not be imported: no reference counts")
        else:
            accepted = [f for f in files if ref.get(str(f)) is True]
            ours = {r["file"]: r for r in results}
            both = [f for f in accepted if ours[str(f)]["validates"]
                    and ours[str(f)]["dry_runs"]]
            print(f"little-loops' validator accepts {len(accepted)}; of those we validate "
                  f"and dry-run {len(both)}")
            for f in accepted:
                r = ours[str(f)]
                if not (r["validates"] and r["dry_runs"]):
                    print(f"  accepted there, not here: {f.relative_to(loops)}: "
                          f"{r['validate_reason'] or r['dry_run_reason']}")
    if args.list:
        for r in results:
            if not r["validates"]:
                print(f"refused: {Path(str(r['file'])).relative_to(loops)}: "
                      f"{r['validate_reason']}")
            elif not r["dry_runs"]:
                print(f"no dry run: {Path(str(r['file'])).relative_to(loops)}: "
                      f"(exit {r['dry_run_exit']}) {r['dry_run_reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
