#!/usr/bin/env python
"""Time the course's notebooks: run each one top to bottom and report its wall time.

    .venv/bin/python tools/time_notebooks.py notebooks/0*.ipynb
    .venv/bin/python tools/time_notebooks.py notebooks/*.ipynb --json timings.json --markdown

Each notebook is executed with nbclient in a fresh ``python3`` kernel, in memory (the files are not
touched), from its own folder, offline, with a time limit per cell (``--timeout``). The table gives
per notebook: the wall time from kernel start to the last cell, the number of code cells, the
slowest cell, and the reading time its first cell promises ("Expected time"). The machine's load
average is recorded before and after: timings from a busy machine say little, so run this on a
quiet one and keep the load in the report (``INSTRUCTOR.md``'s "run time" column comes from here).

``--json FILE`` writes everything, per-cell times included; ``--markdown`` also prints the rows as
a Markdown table. The exit status is 1 when any notebook raised or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the kernels inherit it: the course runs offline
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in tracebacks
EXPECTED = re.compile(r"Expected time:\*{0,2}\s*(?:about\s+)?(\d+)\s*min", re.IGNORECASE)


def stated_minutes(nb) -> int | None:
    """The reading time a notebook's first cell promises ("**Expected time:** about 20 minutes")."""
    if not nb.cells:
        return None
    m = EXPECTED.search(nb.cells[0].source)
    return int(m.group(1)) if m else None


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def time_notebook(path: Path, timeout: int, kernel: str) -> dict:
    """Execute one notebook in memory; return its wall time, per-cell times and any error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    starts, cells = {}, []

    def on_start(cell, cell_index, **_):
        starts[cell_index] = time.perf_counter()

    def on_done(cell, cell_index, **_):
        first = cell.source.splitlines()[0] if cell.source.strip() else ""
        cells.append({"index": cell_index, "seconds": round(time.perf_counter() - starts[cell_index], 3),
                      "first_line": first[:80]})

    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel, allow_errors=False,
                            resources={"metadata": {"path": str(path.parent.resolve())}},
                            on_cell_start=on_start, on_cell_executed=on_done)
    entry = {"notebook": path.name, "stated_minutes": stated_minutes(nb), "ok": True}
    t0 = time.perf_counter()
    try:
        client.execute()
    except Exception as err:  # noqa: BLE001  (a cell that raised, a timeout, a dead kernel: report it, go on)
        entry["ok"] = False
        text = ANSI.sub("", str(err)).strip()
        entry["error"] = f"{type(err).__name__}: {text.splitlines()[-1][:300] if text else ''}"
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["code_cells"] = sum(c.cell_type == "code" for c in nb.cells)
    entry["cells_run"] = len(cells)
    entry["cells"] = cells
    return entry


def slowest(entry: dict) -> dict | None:
    return max(entry["cells"], key=lambda c: c["seconds"], default=None)


def print_table(rows: list[dict]) -> None:
    width = max([len("notebook")] + [len(r["notebook"]) for r in rows])
    print(f"{'notebook':{width}s}  {'run time':>9s}  {'cells':>5s}  {'slowest cell':>18s}  {'stated':>7s}  status")
    for r in rows:
        s = slowest(r)
        cell = f"[{s['index']}] {s['seconds']:.1f} s" if s else "-"
        stated = f"{r['stated_minutes']} min" if r["stated_minutes"] else "-"
        status = "ok" if r["ok"] else r.get("error", "failed")
        print(f"{r['notebook']:{width}s}  {r['seconds']:7.1f} s  {r['code_cells']:5d}  {cell:>18s}  {stated:>7s}  "
              f"{status}")
    total = sum(r["seconds"] for r in rows)
    print(f"{'total':{width}s}  {total:7.1f} s  ({total / 60:.1f} min)")


def print_markdown(rows: list[dict], cores) -> None:
    print(f"\n| notebook | run time ({cores}-core CPU) | slowest cell | stated reading time |")
    print("|---|---|---|---|")
    for r in rows:
        s = slowest(r)
        run = f"{r['seconds']:.0f} s" if r["ok"] else f"failed ({r.get('error', '')[:40]})"
        cell = f"{s['seconds']:.0f} s (cell {s['index']})" if s else "-"
        stated = f"{r['stated_minutes']} min" if r["stated_minutes"] else "-"
        print(f"| `{Path(r['notebook']).stem}` | {run} | {cell} | {stated} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="+", type=Path, help="notebook files, e.g. notebooks/0*.ipynb")
    p.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results, per-cell times included")
    p.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    a = p.parse_args(argv)
    missing = [str(n) for n in a.notebooks if not n.is_file()]
    if missing:
        p.error(f"no such notebook: {', '.join(missing)}")
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        p.error("nbclient and nbformat are needed: pip install 'cbteach[lab]' (or nbclient ipykernel)")

    report = {"machine": machine(), "timeout_per_cell": a.timeout, "load_average_before": load_average(),
              "notebooks": []}
    for path in a.notebooks:
        print(f"running {path.name} ...", file=sys.stderr, flush=True)
        entry = time_notebook(path, a.timeout, a.kernel)
        report["notebooks"].append(entry)
        if a.json:  # rewritten after each notebook: a run cut short keeps what it measured
            a.json.write_text(json.dumps(report, indent=1) + "\n")
    report["load_average_after"] = load_average()
    report["total_seconds"] = round(sum(r["seconds"] for r in report["notebooks"]), 2)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")

    m = report["machine"]
    print(f"{m['cpu_count']} CPUs, {m['platform']}, python {m['python']}, torch {m.get('torch', '?')}"
          + (f", GPU {m['cuda']}" if m.get("cuda") else "")
          + f"; load average before {report['load_average_before']}, after {report['load_average_after']}")
    print_table(report["notebooks"])
    if a.markdown:
        print_markdown(report["notebooks"], m["cpu_count"])
    return 0 if all(r["ok"] for r in report["notebooks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
