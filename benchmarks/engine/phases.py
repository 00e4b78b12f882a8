"""Where a step's time goes, phase by phase, for any version of cbteach (issue 44's before and after).

One process, one thread, bierce, the reference workload (64 headword prompts, at most 300 new tokens,
the model stops at EOS), the paged engine with ``keep_records=False``, at each batch size: a warm-up
run, then ``--repeat`` timed runs, the median run reported. Each phase is timed by wrapping the
function that does it, whichever version is imported (``PYTHONPATH`` picks it):

* plan -- ``Scheduler.schedule`` without the message; message -- ``Scheduler.make_output``;
* prepare -- the worker applying the message and building the step's inputs
  (``update_states`` + ``prepare_inputs``; before issue 44: ``update_states`` + ``prepare``);
* forward -- the model's own forward pass, timed by hooks on the model (public torch API);
* sample -- the worker's sampling and its host copy (``sample`` + ``finish``; before: ``finish``);
* update -- ``EngineCore.apply_output`` (``update_from_output`` and the step's record);
* other -- the rest of the loop. "Host" is everything but the forward pass; "host / forward" divides it
  by the forward pass of the same run, which neither version changes: a measure the machine's drift
  (a third within minutes here) moves less.

    git worktree add /tmp/before 10bd805
    for i in 1 2 3; do
      PYTHONPATH=/tmp/before python benchmarks/engine/phases.py --label before --out results/phases-before-$i.json
      python benchmarks/engine/phases.py --label after --out results/phases-after-$i.json
    done
    python benchmarks/engine/phases.py --table results/phases-*.json
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import statistics
import time

# What the phases are timed with: wall time (time.perf_counter), or with --clock cpu this thread's CPU
# time (time.thread_time), which another process on a busy machine does not inflate -- the synchronous
# engine runs every phase in this one thread.
CLOCK = [time.perf_counter]

PHASES = ("plan", "message", "prepare", "forward", "sample", "update", "other")


def _wrap(owner, name: str, label: str, acc: collections.Counter) -> bool:
    fn = getattr(owner, name, None)
    if fn is None:
        return False

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = CLOCK[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += CLOCK[0]() - t0

    setattr(owner, name, timed)
    return True


def instrument(acc: collections.Counter) -> str:
    """Wrap this version's phases; returns which layout it found."""
    from cbteach.engine import engine_core, scheduler

    _wrap(scheduler.Scheduler, "schedule", "schedule", acc)
    _wrap(scheduler.Scheduler, "make_output", "message", acc)
    _wrap(engine_core.EngineCore, "apply_output", "update", acc)
    import importlib.util

    if importlib.util.find_spec("cbteach.engine.model_runner") is not None:  # before issue 44
        from cbteach.engine import model_runner as mr
        layout = "engine"
        for name in ("update_states", "prepare"):
            _wrap(mr.ModelRunner, name, "prepare", acc)
        _wrap(mr.ModelRunner, "finish", "sample", acc)
    else:  # after: the worker below the engine
        from cbteach.worker import model_runner as mr
        layout = "worker"
        for name in ("update_states", "prepare_inputs"):
            _wrap(mr.ModelRunner, name, "prepare", acc)
        for name in ("sample", "finish"):
            _wrap(mr.ModelRunner, name, "sample", acc)
    return layout


def measure(batch: int, repeat: int, n: int, max_new: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from cbteach.engine.engine import Engine
    from cbteach.models import load_model
    from cbteach.serving import workloads as wl

    model, tok = load_model()
    reqs = wl.headwords(tok, n=n, max_new_tokens=max_new).requests()
    acc: collections.Counter = collections.Counter()
    layout = instrument(acc)
    starts: list = []
    model.register_forward_pre_hook(lambda *a: starts.append(CLOCK[0]()))
    model.register_forward_hook(lambda *a: acc.update(forward=CLOCK[0]() - starts.pop()))
    runs = []
    for i in range(repeat + 1):
        eng = Engine(model, tok, kv="paged", max_batch_size=batch, keep_records=False)
        acc.clear()
        t0 = CLOCK[0]()
        out = eng.run(reqs)
        wall = CLOCK[0]() - t0
        steps = eng.num_steps
        eng.close()
        if i == 0:
            continue  # warm-up
        phases = dict(acc)
        phases["plan"] = phases.pop("schedule", 0.0) - phases.get("message", 0.0)
        phases["other"] = wall - sum(phases.get(p, 0.0) for p in PHASES if p != "other")
        runs.append({"wall": wall, "steps": steps, "tokens": sum(len(c.output_ids) for c in out),
                     "ms_per_step": {p: 1e3 * phases.get(p, 0.0) / steps for p in PHASES},
                     "host_ms_per_step": 1e3 * (wall - phases.get("forward", 0.0)) / steps})
    runs.sort(key=lambda r: r["wall"])
    return {"batch": batch, "layout": layout, "median": runs[len(runs) // 2], "walls": [r["wall"] for r in runs]}


def table(paths: list[str]) -> None:
    rows = collections.defaultdict(list)
    for path in paths:
        data = json.load(open(path))
        for m in data["results"]:
            rows[(data["label"], m["batch"])].append(m["median"])
    print("| version | batch | runs | wall s (median) | host ms/step | host / forward | " + " | ".join(PHASES) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(PHASES))
    for (label, batch), meds in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mid = sorted(meds, key=lambda m: m["wall"])[len(meds) // 2]
        ph = " | ".join(f"{statistics.median(m['ms_per_step'][p] for m in meds):.3f}" for p in PHASES)
        ratio = statistics.median(m["host_ms_per_step"] / m["ms_per_step"]["forward"] for m in meds)
        print(f"| {label} | {batch} | {len(meds)} | {mid['wall']:.2f} | "
              f"{statistics.median(m['host_ms_per_step'] for m in meds):.3f} | {ratio:.3f} | {ph} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time phases by wall time, or by this thread's CPU time (steadier on a busy machine)")
    p.add_argument("--out")
    p.add_argument("--table", nargs="*")
    a = p.parse_args()
    if a.table is not None:
        table(sorted(path for pattern in a.table for path in glob.glob(pattern)))
        return
    CLOCK[0] = time.thread_time if a.clock == "cpu" else time.perf_counter
    load_before = os.getloadavg()[0]
    results = [measure(int(b), a.repeat, a.requests, a.max_new_tokens) for b in a.batches.split(",")]
    out = {"label": a.label, "clock": a.clock, "load_before": load_before, "results": results, "time": time.time()}
    for m in results:
        med = m["median"]
        print(f"{a.label} batch {m['batch']} ({m['layout']}): wall {med['wall']:.2f} s, host {med['host_ms_per_step']:.3f} "
              f"ms/step ({med['host_ms_per_step'] / med['ms_per_step']['forward']:.3f} of the forward pass): "
              + ", ".join(f"{k} {v:.3f}" for k, v in med["ms_per_step"].items()))
    out["load_after"] = os.getloadavg()[0]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
