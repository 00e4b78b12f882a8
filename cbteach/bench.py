"""``python -m cbteach bench``: the speed and memory goals, measured (never asserted in tests).

Two experiments on the embedded model, both written to ``benchmarks/results/`` as JSON:

* **throughput** -- the same headword workload served by static batching, the engine with the
  concatenating cache, and the engine with the paged cache: wall time, generated tokens per
  second, number of forward steps, and (paged) KV utilisation against a contiguous reservation.
* **step time vs history** -- a fixed batch decoding long outputs (``ignore_eos``); per step, the
  forward time and the KV bytes copied, for ``kv="concat"`` and ``kv="paged"``. The concat
  cache's copies grow with the history; the paged cache writes only the new token's K/V.

Goals (checked by eye here, in the notebooks' plots, never in timed tests): continuous batching
beats static on throughput for a skewed workload; paged KV utilisation > 90%; paged step time
grows no faster than attention itself while concat step time grows with history.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .bierce.corpus import headword_prompts
from .engine import Engine
from .memory import accounting, summary
from .models import load_model
from .request import Request
from .static import static_batching


def throughput(model, tok, num_requests=32, batch_size=8, max_new_tokens=256) -> dict:
    reqs = lambda: [Request(p, max_new_tokens) for p in headword_prompts(num_requests)]  # noqa: E731
    rows = {}
    t0 = time.perf_counter()
    st = static_batching(model, tok, reqs(), batch_size)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.output_ids) for c in st)
    rows["static"] = {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": len(st.steps)}
    for kv in ("concat", "paged"):
        eng = Engine(model, tok, max_batch_size=batch_size, kv=kv)
        t0 = time.perf_counter()
        out = eng.run(reqs())
        wall = time.perf_counter() - t0
        tokens = sum(len(c.output_ids) for c in out)
        rows[kv] = {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": len(eng.records),
                    "identical_to_static": [c.output_ids for c in out] == [c.output_ids for c in st]}
        if kv == "paged":
            rows[kv].update(summary(accounting(eng)))
    return rows


def step_time_vs_history(model, tok, batch_size=8, steps=512, prompt="CYNIC, n.") -> dict:
    """Per-step forward time and KV copy volume while ``batch_size`` sequences decode ``steps`` tokens."""
    out = {}
    for kv in ("concat", "paged"):
        eng = Engine(model, tok, max_batch_size=batch_size, kv=kv)
        eng.run([Request(prompt, steps, ignore_eos=True) for _ in range(batch_size)])
        decode = [r for r in eng.records if r.seqs and all(s.kind == "decode" for s in r.seqs)]
        out[kv] = {"history": [r.seqs[0].num_cached for r in decode],
                   "step_seconds": [r.duration for r in decode],
                   "forward_seconds": [r.forward_time for r in decode],
                   "kv_bytes_copied": [r.kv_bytes_copied for r in decode]}
    return out


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bierce")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--history", type=int, default=512, help="decode steps for the step-time experiment")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args(argv)
    model, tok = load_model(a.model, device="cpu")
    print(f"throughput: {a.requests} headwords, batch size {a.batch_size}, max_new_tokens {a.max_new_tokens}")
    tp = throughput(model, tok, a.requests, a.batch_size, a.max_new_tokens)
    for name, r in tp.items():
        extra = f"  KV utilisation {r['paged_utilisation']:.1%} (contiguous {r['contiguous_utilisation']:.1%})" \
            if "paged_utilisation" in r else ""
        same = "" if "identical_to_static" not in r else f"  same tokens as static: {r['identical_to_static']}"
        print(f"  {name:7s} {r['seconds']:7.2f} s  {r['tokens_per_s']:7.0f} tok/s  {r['steps']:5d} steps{extra}{same}")
    print(f"step time vs history: {a.batch_size} sequences decoding {a.history} tokens")
    sh = step_time_vs_history(model, tok, a.batch_size, a.history)
    for kv, r in sh.items():
        n = len(r["history"])
        head, tail = slice(0, max(1, n // 10)), slice(n - max(1, n // 10), n)
        avg = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"  {kv:7s} step {avg(r['step_seconds'][head]) * 1e3:6.2f} ms -> {avg(r['step_seconds'][tail]) * 1e3:6.2f} ms"
              f"   KV copied {avg(r['kv_bytes_copied'][head]) / 1e6:7.2f} MB -> "
              f"{avg(r['kv_bytes_copied'][tail]) / 1e6:7.2f} MB per step")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"bench-{a.model.replace('/', '_')}.json"
    path.write_text(json.dumps({"throughput": tp, "step_time_vs_history": sh}, indent=1))
    print(f"wrote {path}")
    return 0
