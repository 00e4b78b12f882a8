"""Issue 26's engine targets, measured the same way on two versions of cbteach (run once per version).

    PYTHONPATH=/path/to/old/checkout python benchmarks/engine/before_after.py --label before --out before.json
    python benchmarks/engine/before_after.py --label after --out after.json
    python benchmarks/engine/before_after.py --table before.json after.json

For each batch size: bierce, 128 headword prompts (max 300 new tokens), one thread, every engine
warmed up, then ``--repeat`` interleaved runs, the median reported. The forward pass is timed by a
forward hook on the model (a public torch hook; the engine's view of the model shares it), the same
for every version, so "outside the forward" is the serving loop minus the model's own time.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def timed_forwards(model):
    """Seconds spent inside ``model``'s forward, summed (a pre and a post hook)."""
    box = {"t": 0.0, "start": 0.0}
    model.register_forward_pre_hook(lambda m, a: box.__setitem__("start", time.perf_counter()))
    model.register_forward_hook(lambda m, a, o: box.__setitem__("t", box["t"] + time.perf_counter() - box["start"]))
    return box


def run_once(name, model, tok, requests, batch):
    from cbteach import Engine, static_batching

    box = timed_forwards.box
    box["t"] = 0.0
    t0 = time.perf_counter()
    if name == "static":
        res = static_batching(model, tok, requests, batch_size=batch)
        steps = len(res.steps)
    else:
        opts = {"async_scheduling": True} if name == "paged_async" else {}
        eng = Engine(model, tok, max_batch_size=batch, kv="paged", keep_records=False, **opts)
        t0 = time.perf_counter()
        eng.run(requests)
        steps = eng.num_steps
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "forward": box["t"], "steps": steps}


def measure(label: str, repeat: int, engines: list[str], batches=(8, 16)) -> dict:
    import cbteach
    from cbteach import Request, load_model
    from cbteach.bierce.corpus import headword_prompts  # noqa: F401  (exists in every version measured)

    torch.set_num_threads(1)
    model, tok = load_model("bierce", device="cpu")
    timed_forwards.box = timed_forwards(model)
    prompts = headword_prompts(128)
    out = {"label": label, "version": getattr(cbteach, "__version__", "?"), "runs": {}}
    for batch in batches:
        make = lambda: [Request(p, 300) for p in prompts]  # noqa: E731
        for name in engines:
            run_once(name, model, tok, make(), batch)  # warm-up
        rows = {name: [] for name in engines}
        for _ in range(repeat):
            for name in engines:
                rows[name].append(run_once(name, model, tok, make(), batch))
        out["runs"][str(batch)] = {name: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]  # the median run
                                   for name, rs in rows.items()}
    return out


def table(paths: list[str]) -> str:
    lines = ["| version | batch | paged vs static (wall) | ideal (static steps / paged steps) | paged / ideal | "
             "outside the forward: paged | ... async |", "|---|---|---|---|---|---|---|"]
    for path in paths:
        d = json.load(open(path))
        for batch, r in d["runs"].items():
            if "static" not in r:  # paged only: tokens per second
                pg = r["paged"]
                lines.append(f"| {d['label']} | {batch} | paged only: {pg['steps']} steps in {pg['seconds']:.2f} s | - | - | "
                             f"{1 - pg['forward'] / pg['seconds']:.1%} | - |")
                continue
            st, pg = r["static"], r["paged"]
            speed, ideal = st["seconds"] / pg["seconds"], st["steps"] / pg["steps"]
            host = 1 - pg["forward"] / pg["seconds"]
            asy = r.get("paged_async")
            asy_host = f"{1 - asy['forward'] / asy['seconds']:.1%} ({st['seconds'] / asy['seconds']:.2f}x static)" \
                if asy else "-"
            lines.append(f"| {d['label']} | {batch} | {speed:.2f}x | {ideal:.2f}x | {speed / ideal:.2f} | "
                         f"{host:.1%} | {asy_host} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label")
    p.add_argument("--out")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--engines", default="static,paged,paged_async")
    p.add_argument("--batches", default="8,16", help="batch sizes, comma-separated (default: 8,16)")
    p.add_argument("--table", nargs="*")
    a = p.parse_args()
    if a.table:
        print(table(a.table))
        return
    data = measure(a.label, a.repeat, a.engines.split(","), [int(b) for b in a.batches.split(",")])
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
    print(table([a.out]))


if __name__ == "__main__":
    main()
