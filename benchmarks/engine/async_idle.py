"""How long the model waits between forward passes, synchronous and async, for any version of cbteach.

One process, one thread for torch, bierce, the reference workload (64 headword prompts, at most 300 new
tokens), the paged engine with ``keep_records=False``, at each batch size: a warm-up run, then
``--repeat`` timed runs of each mode, alternated. Hooks on the model (public torch API) stamp each
forward pass's start and end with ``time.perf_counter``; the model's **idle time** is the gap from one
forward's end to the next one's start -- in the synchronous engine the whole host side of a step
(sampling, the update, planning, the next inputs), under async scheduling what the overlap does not
hide. Reported per run: the median gap, the mean gap, and tokens per second.

Wall time: on a busy machine the gaps grow with the load -- the result records the load, and the two
versions should be alternated process by process::

    git worktree add /tmp/before 370438b
    for i in 1 2; do
      PYTHONPATH=/tmp/before python benchmarks/engine/async_idle.py --label before --out results/idle-before-$i.json
      python benchmarks/engine/async_idle.py --label after --out results/idle-after-$i.json
    done
    python benchmarks/engine/async_idle.py --table results/idle-*.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import time


def run(model, tok, reqs, batch: int, async_scheduling: bool, stamps: list) -> dict:
    from cbteach.engine.engine import Engine

    eng = Engine(model, tok, kv="paged", max_batch_size=batch, keep_records=False, async_scheduling=async_scheduling)
    stamps.clear()
    t0 = time.perf_counter()
    out = eng.run(reqs)
    wall = time.perf_counter() - t0
    eng.close()
    gaps = [b[0] - a[1] for a, b in zip(stamps, stamps[1:])]
    return {"wall": wall, "forwards": len(stamps), "tokens_per_s": sum(len(c.output_ids) for c in out) / wall,
            "idle_ms_median": 1e3 * statistics.median(gaps), "idle_ms_mean": 1e3 * statistics.fmean(gaps),
            "forward_ms_median": 1e3 * statistics.median(b - a for a, b in stamps)}


def measure(batch: int, repeat: int, n: int, max_new: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    from cbteach.models import load_model
    from cbteach.serving import workloads as wl

    model, tok = load_model()
    reqs = wl.headwords(tok, n=n, max_new_tokens=max_new).requests()
    stamps: list = []
    model.register_forward_pre_hook(lambda *a: stamps.append([time.perf_counter(), None]))
    model.register_forward_hook(lambda *a: stamps[-1].__setitem__(1, time.perf_counter()))
    out = []
    for i in range(repeat + 1):
        for mode in (False, True):
            r = run(model, tok, reqs, batch, mode, stamps)
            if i:  # the first round warms up
                out.append({"batch": batch, "async": mode, **r})
    return out


def table(paths: list[str]) -> None:
    rows = collections.defaultdict(list)
    loads = collections.defaultdict(list)
    for path in paths:
        data = json.load(open(path))
        loads[data["label"]].append(data["load_before"])
        for r in data["runs"]:
            rows[(r["batch"], r["async"], data["label"])].append(r)
    print("| batch | engine | version | runs | idle between forwards, ms (median of runs) | tokens/s (median) | "
          "forward ms |")
    print("|---|---|---|---|---|---|---|")
    for (batch, mode, label), runs in sorted(rows.items()):
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        print(f"| {batch} | {'async' if mode else 'sync'} | {label} | {len(runs)} | {med('idle_ms_median'):.3f} | "
              f"{med('tokens_per_s'):.0f} | {med('forward_ms_median'):.2f} |")
    print("\n1-minute load at each start: " + "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)}"
                                                      for k, v in loads.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--out")
    p.add_argument("--table", nargs="*")
    a = p.parse_args()
    if a.table is not None:
        table(sorted(path for pattern in a.table for path in glob.glob(pattern)))
        return
    load_before = os.getloadavg()[0]
    runs = [r for b in a.batches.split(",") for r in measure(int(b), a.repeat, a.requests, a.max_new_tokens)]
    for r in runs:
        print(f"{a.label} batch {r['batch']} {'async' if r['async'] else 'sync '}: idle {r['idle_ms_median']:.3f} ms "
              f"(mean {r['idle_ms_mean']:.3f}), {r['tokens_per_s']:.0f} tok/s, forward {r['forward_ms_median']:.2f} ms")
    out = {"label": a.label, "load_before": load_before, "load_after": os.getloadavg()[0], "runs": runs,
           "time": time.time()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
