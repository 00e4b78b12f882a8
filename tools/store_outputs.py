#!/usr/bin/env python
"""Store the course's outputs: execute notebooks in place, one at a time, on a quiet machine.

    .venv/bin/python tools/store_outputs.py                    # every notebooks/[0-9][0-9]*_*.ipynb (05b too)
    .venv/bin/python tools/store_outputs.py notebooks/07_*.ipynb --timeout 900
    .venv/bin/python tools/store_outputs.py --force            # even when the machine is busy

Why one command: the stored outputs are what a learner reads before running anything, and the prose
beside them compares timings. Outputs stored on a busy machine (another job, another notebook running
beside this one) show timings that contradict the prose. So this refuses to start when the 1-minute
load average is 1 or more (``--force`` overrides), and runs the notebooks strictly one after another,
each with ``jupyter nbconvert --execute --inplace`` in its own subprocess and a time limit per cell.
It prints each notebook's wall time and the load average after it, and every claim line
(:mod:`cbteach.perf.claims`) the stored outputs report did not hold; the exit status is 1 when any
notebook failed, timed out, stored a failed claim, or the machine was busy.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # cbteach from this checkout, even outside the venv
from cbteach.perf.claims import stored_failed_claims  # noqa: E402
MAX_LOAD = 1.0  # the 1-minute load average above which timings are not worth storing


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def jupyter() -> str:
    """The ``jupyter`` beside this Python (the project's .venv), else whichever is on PATH."""
    here = Path(sys.executable).parent / "jupyter"
    return str(here) if here.exists() else "jupyter"


def store(path: Path, timeout: int) -> tuple[bool, float]:
    """Execute one notebook in place; return whether it succeeded and its wall time in seconds."""
    cmd = [jupyter(), "nbconvert", "--to", "notebook", "--execute", "--inplace",
           f"--ExecutePreprocessor.timeout={timeout}", str(path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the course runs offline
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, check=False)
    return done.returncode == 0, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path,
                   help="notebooks to execute (default: every notebooks/[0-9][0-9]*_*.ipynb)")
    p.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: 600)")
    p.add_argument("--force", action="store_true", help="run even when the 1-minute load average is >= 1")
    a = p.parse_args(argv)
    paths = a.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    missing = [str(x) for x in paths if not x.is_file()]
    if missing or not paths:
        print(f"no such notebook: {', '.join(missing) or 'notebooks/[0-9][0-9]*_*.ipynb matched nothing'}")
        return 1
    if a.timeout < 1:
        print("--timeout must be a positive number of seconds")
        return 1
    load = load_average()
    if load is not None and load >= MAX_LOAD and not a.force:
        print(f"the 1-minute load average is {load:.2f} (>= {MAX_LOAD:g}): timings stored now would say more about "
              "the other jobs than about the course. Wait for a quiet machine, or add --force.")
        return 1
    print(f"load average before: {'unknown' if load is None else f'{load:.2f}'}; {len(paths)} notebook(s)")
    failed = []
    for path in paths:
        ok, seconds = store(path, a.timeout)
        after = load_average()
        print(f"{path.name}: {seconds:6.1f} s{'' if ok else '  FAILED'}"
              + ("" if after is None else f"  (load average {after:.2f})"), flush=True)
        if not ok:
            failed.append(path.name)
            continue
        broken = stored_failed_claims(path)  # stored outputs must not contradict the prose beside them
        for cell, text in broken:
            print(f"  cell {cell}: a claim did not hold: {text}")
        if broken:
            failed.append(f"{path.name} (claims that did not hold; re-run it on a quieter machine, or fix them)")
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
