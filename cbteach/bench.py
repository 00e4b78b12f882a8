"""``python -m cbteach bench``: the speed goals, measured (printed as met / not met, never asserted in tests).

**Throughput.** One workload -- ``--requests`` headword prompts, each generating until EOS or
``--max-new-tokens``, at most ``--batch-size`` sequences at a time -- served by four engines:

* ``static`` -- padded waves behind a batch barrier (:func:`cbteach.static_batching`);
* ``cbteach_concat`` / ``cbteach_paged`` -- our continuous-batching engine with each KV cache;
* ``transformers_cb`` -- transformers' own continuous batching (``generate_batch``'s manager), sized
  like ours: 16-token pages, the same batch size, a pool just big enough, no token budget in the way.

Each engine runs the workload once untimed (first-run effects: lazy imports, allocator growth,
kernel selection), then once timed. Reported: seconds, generated tokens per second, forward steps,
and whether every engine produced the same tokens (greedy fp32 must: batching changes nothing).

**Ideal vs measured speed-up.** A step produces one token per busy slot. Static batching keeps a
slot until the wave's longest request is done, so it needs ``sum over waves of the longest output``
steps; continuous batching refills a slot as soon as it frees, so it needs about
``max(total tokens / batch size, longest output)``. *Ideal speed-up* = static steps / continuous
steps, what slot arithmetic predicts if every step cost the same. *Measured* = static seconds /
continuous seconds. The gap is what the engine's steps cost beyond static's: packing, metadata,
paged attention's gather, a bigger prefill mixed into a decode step.

**Step time vs history.** A fixed batch decodes long outputs (``ignore_eos``). Per step: forward
time, ``kv_bytes_copied`` (concat: the history gathered and scattered every step -- it grows) and
``kv_bytes_read`` (paged: what attention reads through the block tables; nothing is copied).

**Targets** (CPU, reference configuration ``--reference`` = 64 headwords, 300 new tokens, batch 16):
``cbteach_paged`` measured speed-up >= 0.9 x ideal, and ``cbteach_paged`` >= 1.5 x
``transformers_cb`` tokens/s.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from .bierce.corpus import headword_prompts
from .engine import Engine
from .memory import accounting, summary
from .modelinfo import eos_ids_for
from .models import load_model
from .request import Request
from .static import static_batching

ENGINES = ("static", "cbteach_concat", "cbteach_paged", "transformers_cb")
REFERENCE = {"requests": 64, "max_new_tokens": 300, "batch_size": 16}
TARGET_VS_IDEAL = 0.9  # cbteach_paged measured speed-up over static >= this x the ideal one
TARGET_VS_TRANSFORMERS = 1.5  # cbteach_paged tokens/s >= this x transformers_cb's
PAGE = 16  # tokens per KV block, ours and transformers'


# -- slot arithmetic and targets (pure; tested on hand-made numbers) ---------------------------
def ideal_speedup(static_steps: int, continuous_steps: int) -> float:
    """Static steps / continuous steps: the speed-up if every step cost the same."""
    return static_steps / continuous_steps if continuous_steps else math.nan


def slot_steps(lengths: list[int], batch_size: int) -> dict:
    """Steps each strategy needs for outputs of ``lengths`` (prefill makes the first token).

    Static: each wave of ``batch_size`` runs as long as its longest output. Continuous: at least
    ``ceil(total / batch_size)`` steps (one token per slot per step), and at least the longest output.
    """
    waves = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    static = sum(max(w) for w in waves)
    continuous = max(math.ceil(sum(lengths) / batch_size), max(lengths, default=0))
    return {"static": static, "continuous": continuous, "ideal_speedup": ideal_speedup(static, continuous)}


def targets(rows: dict) -> dict:
    """The two targets on a throughput result: value, goal and met (None when not measurable)."""
    st, pg, tf = (rows.get(k, {}) for k in ("static", "cbteach_paged", "transformers_cb"))
    ideal = ideal_speedup(st.get("steps") or 0, pg.get("steps") or 0)
    measured = st["seconds"] / pg["seconds"] if st.get("seconds") and pg.get("seconds") else math.nan
    vs_tf = pg["tokens_per_s"] / tf["tokens_per_s"] if pg.get("tokens_per_s") and tf.get("tokens_per_s") else math.nan
    out = {"paged_vs_ideal": {"value": measured / ideal if ideal == ideal else math.nan, "goal": TARGET_VS_IDEAL,
                              "measured_speedup": measured, "ideal_speedup": ideal},
           "paged_vs_transformers_cb": {"value": vs_tf, "goal": TARGET_VS_TRANSFORMERS}}
    for t in out.values():
        t["met"] = None if t["value"] != t["value"] else bool(t["value"] >= t["goal"])
    return out


# -- the engines -------------------------------------------------------------------------------
def _row(seconds: float, outputs: list[list[int]], steps) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else math.nan,
            "steps": steps}


def run_static(model, tok, requests, batch_size):
    t0 = time.perf_counter()
    res = static_batching(model, tok, requests, batch_size)
    return _row(time.perf_counter() - t0, [c.output_ids for c in res], len(res.steps)), [c.output_ids for c in res]


def run_cbteach(model, tok, requests, batch_size, kv, keep_records=False, **options):
    """Our engine, stepped by hand (so steps are counted without keeping records)."""
    t0 = time.perf_counter()
    eng = Engine(model, tok, max_batch_size=batch_size, kv=kv, keep_records=keep_records, **options)
    for r in requests:
        eng.add_request(r)
    steps = 0
    with eng.serving():  # attention switched once for the run, as Engine.run does
        while eng.has_unfinished():
            steps += bool(eng.step().seqs)
    outs = [eng.completions[r.request_id].output_ids for r in requests]
    row = _row(time.perf_counter() - t0, outs, steps)
    if keep_records and kv == "paged":
        row.update(summary(accounting(eng)))
    return row, outs


def transformers_cb_config(batch_size: int, prompt_lens: list[int], max_new_tokens: int, num_blocks=None):
    """Settings comparable to ours. With its defaults on a CPU, transformers sizes the KV cache to 60%
    of free RAM (~200k tokens in 256-token pages) with 8,192 batch tokens, and before the first step
    fills an attention-mask buffer of ``[8192, cache + 8192]`` -- 6.6 GiB on a 24 GB machine, ~30 s,
    while the steps themselves take milliseconds. Here: 16-token pages, a pool just big enough for
    ``batch_size`` of the longest requests, ``batch_size`` requests per step, and a token budget as
    large as one step of full prompts (our engine has none)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if num_blocks is None:
        num_blocks = batch_size * math.ceil((max(prompt_lens) + max_new_tokens) / PAGE) + batch_size
    widest = sum(sorted(prompt_lens)[-batch_size:]) + batch_size
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_requests_per_batch=batch_size,
                                    max_batch_tokens=max(widest, 64))


def run_transformers_cb(model, tok, requests, batch_size, num_blocks=None):
    """transformers' continuous batching on the same requests (per-request max_new_tokens; ignore_eos
    becomes an EOS id of -1, which no token has). Timed from start of the manager to the last result;
    building and stopping it (thread, cache, gc) is reported apart as ``setup_seconds``."""
    from transformers import GenerationConfig

    ids = [list(tok(r.prompt)["input_ids"]) if isinstance(r.prompt, str) else list(r.prompt) for r in requests]
    eos = sorted(eos_ids_for(model)) or [-1]
    pad = model.generation_config.pad_token_id
    gen = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False,
                           eos_token_id=eos, pad_token_id=eos[0] if pad is None else pad)
    cfg = transformers_cb_config(batch_size, [len(i) for i in ids], gen.max_new_tokens, num_blocks)
    t_setup = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    results = {}
    try:
        t0 = time.perf_counter()
        manager.start()
        for i, (r, p) in enumerate(zip(requests, ids)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=r.max_new_tokens,
                                eos_token_id=[-1] if r.ignore_eos else eos)
        while len(results) < len(requests):
            res = manager.get_result(timeout=1)
            if res is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped before every request finished")
            if res is not None and res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"transformers_cb request {res.request_id}: {res.error}")
                results[res.request_id] = res
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
    outs = [list(results[f"r{i}"].generated_tokens) for i in range(len(requests))]
    row = _row(seconds, outs, None)
    row["setup_seconds"] = time.perf_counter() - t_setup - seconds
    return row, outs


def compare(model, tok, make_requests, batch_size, engines=ENGINES, full_warmup=ENGINES, num_blocks=None,
            bar=None) -> dict:
    """Warm up and time each engine on ``make_requests()``; one row per engine.

    Engines in ``full_warmup`` run the whole workload untimed first (its seconds: ``first_run_seconds``);
    the others warm up on one short wave. A failing engine gets ``{"error": ...}`` and the rest still run.
    """
    runners = {"static": lambda rs, first: run_static(model, tok, rs, batch_size),
               "cbteach_concat": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "concat"),
               "cbteach_paged": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "paged", keep_records=first,
                                                              num_blocks=num_blocks),
               "transformers_cb": lambda rs, first: run_transformers_cb(model, tok, rs, batch_size, num_blocks)}
    rows, outputs = {}, {}
    for name in engines:
        bar is not None and bar.set_postfix_str(name)
        try:
            if name in full_warmup:
                first, _ = runners[name](make_requests(), True)
            else:
                short = [Request(r.prompt, min(r.max_new_tokens, 8), ignore_eos=r.ignore_eos)
                         for r in make_requests()[:batch_size]]
                first, _ = runners[name](short, False)
            rows[name], outputs[name] = runners[name](make_requests(), False)
            rows[name]["first_run_seconds"] = first["seconds"]
            rows[name].update({k: v for k, v in first.items() if "utilisation" in k or "fraction" in k or "peak" in k})
        except Exception as err:  # noqa: BLE001  (a benchmark reports a broken engine and goes on)
            rows[name] = {"error": f"{type(err).__name__}: {err}", "tokens_per_s": None, "seconds": None, "steps": None}
        bar is not None and bar.update(1)
    ref = outputs.get("static")
    for name in set(outputs) - {"static"} if ref is not None else ():
        rows[name]["identical_to_static"] = outputs[name] == ref
    if "transformers_cb" in outputs:
        ours = outputs.get("cbteach_paged", ref)
        rows["transformers_cb"]["matched"] = None if ours is None else outputs["transformers_cb"] == ours
    return rows


def headword_requests(n: int, max_new_tokens: int):
    prompts = headword_prompts(n)
    return lambda: [Request(p, max_new_tokens) for p in prompts]


def step_time_vs_history(model, tok, batch_size=8, steps=512, prompt="CYNIC, n.") -> dict:
    """Per decode step: history length, step and forward seconds, ``kv_bytes_copied`` (concat) and
    ``kv_bytes_read`` (paged) while ``batch_size`` sequences decode ``steps`` tokens."""
    out = {}
    for kv in ("concat", "paged"):
        eng = Engine(model, tok, max_batch_size=batch_size, kv=kv)
        eng.run([Request(prompt, steps, ignore_eos=True) for _ in range(batch_size)])
        decode = [r for r in eng.records if r.seqs and all(s.kind == "decode" for s in r.seqs)]
        out[kv] = {"history": [r.seqs[0].num_computed_tokens for r in decode],
                   "step_seconds": [r.duration for r in decode],
                   "forward_seconds": [r.forward_time for r in decode],
                   "kv_bytes_copied": [r.kv_bytes_copied for r in decode],
                   "kv_bytes_read": [r.kv_bytes_read for r in decode]}
    return out


# -- the command -------------------------------------------------------------------------------
def clean(x):
    """NaN -> None, recursively, so the JSON is strict."""
    if isinstance(x, (dict, list, tuple)):
        return {k: clean(v) for k, v in x.items()} if isinstance(x, dict) else [clean(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def _fmt(x, spec):
    return "-" if x is None or x != x else format(x, spec)


def print_throughput(rows: dict, tg: dict) -> None:
    print(f"  {'engine':16s} {'seconds':>8s} {'tok/s':>8s} {'steps':>6s} {'speed-up':>9s}  same tokens")
    st = rows.get("static", {}).get("seconds")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:16s} FAILED: {r['error']}")
            continue
        up = st / r["seconds"] if st else None
        same = {"static": "(reference)", "transformers_cb": f"same tokens as cbteach: {r.get('matched')}"}.get(
            name, f"same tokens as static: {r.get('identical_to_static')}")
        print(f"  {name:16s} {r['seconds']:8.2f} {r['tokens_per_s']:8.0f} {_fmt(r['steps'], '6d'):>6s} "
              f"{_fmt(up, '8.2f')}x  {same}")
    pg = rows.get("cbteach_paged", {})
    if "paged_utilisation" in pg:
        print(f"  paged KV utilisation {pg['paged_utilisation']:.1%} (a contiguous reservation: "
              f"{pg['contiguous_utilisation']:.1%})")
    a, b = tg["paged_vs_ideal"], tg["paged_vs_transformers_cb"]
    print(f"  speed-up of cbteach_paged over static: measured {_fmt(a['measured_speedup'], '.2f')}x, "
          f"ideal (static steps / continuous steps) {_fmt(a['ideal_speedup'], '.2f')}x")
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print(f"  target: paged speed-up >= {a['goal']} x ideal: {_fmt(a['value'], '.2f')} x -> {verdict[a['met']]}")
    print(f"  target: paged >= {b['goal']} x transformers_cb tok/s: {_fmt(b['value'], '.2f')} x -> {verdict[b['met']]}")


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bierce")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reference", action="store_true",
                   help="the targets' configuration: --requests 64 --max-new-tokens 300 --batch-size 16")
    p.add_argument("--history", type=int, default=256, help="decode steps for the step-time experiment (0: skip)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for bench-<model>.json")
    p.add_argument("--json", type=Path, default=None, help="write the results here instead")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: a 2M-parameter model gains nothing from more, "
                        "and timings on a shared machine stay steady)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.reference:
        a.requests, a.max_new_tokens, a.batch_size = (REFERENCE[k] for k in ("requests", "max_new_tokens", "batch_size"))
    engines = [e for e in a.engines.split(",") if e]
    if set(engines) - set(ENGINES):
        p.error(f"unknown engine(s) {sorted(set(engines) - set(ENGINES))}; choose from {', '.join(ENGINES)}")
    import torch

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, device="cpu")
    ref = all(getattr(a, k) == v for k, v in REFERENCE.items())
    print(f"throughput: {a.requests} headwords, batch size {a.batch_size}, max_new_tokens {a.max_new_tokens}"
          f"{' (the reference configuration)' if ref else ' (targets are set for --reference)'}")
    from tqdm.auto import tqdm

    with tqdm(total=len(engines), desc="engines", unit="engine", disable=a.no_progress, leave=False) as bar:
        rows = compare(model, tok, headword_requests(a.requests, a.max_new_tokens), a.batch_size, engines,
                       bar=bar)
    tg = targets(rows)
    print_throughput(rows, tg)
    result = {"config": {"model": a.model, "requests": a.requests, "batch_size": a.batch_size,
                         "max_new_tokens": a.max_new_tokens, "reference": ref},
              "throughput": rows, "targets": tg}
    if a.history:
        print(f"step time vs history: {a.batch_size} sequences decoding {a.history} tokens")
        sh = result["step_time_vs_history"] = step_time_vs_history(model, tok, a.batch_size, a.history)
        for kv, r in sh.items():
            n = len(r["history"])
            head, tail = slice(0, max(1, n // 10)), slice(n - max(1, n // 10), n)
            avg = statistics.median  # a step now and then is slowed by something else on the machine
            key, verb = ("kv_bytes_copied", "copied") if kv == "concat" else ("kv_bytes_read", "read")
            print(f"  {kv:7s} step {avg(r['step_seconds'][head]) * 1e3:6.2f} ms -> "
                  f"{avg(r['step_seconds'][tail]) * 1e3:6.2f} ms   KV {verb} {avg(r[key][head]) / 1e6:7.2f} MB -> "
                  f"{avg(r[key][tail]) / 1e6:7.2f} MB per step ({key})")
    path = a.json or a.out / f"bench-{a.model.replace('/', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(result), indent=1))
    print(f"wrote {path}")
    return 0
