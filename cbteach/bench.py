"""``python -m cbteach bench``: serving engines on one workload, one process, same tokens -- throughput and latency.

**Workloads** (:mod:`cbteach.workloads`, seeded and offline): ``headwords`` (the model stops at
EOS), ``length_variance`` (Anyscale's: exponential output lengths clipped at ``--cap``, EOS
ignored), ``poisson`` (headwords arriving at ``--rate`` requests/s) and ``chat`` (a synthetic
long-tailed mix shaped like ShareGPT). Every prompt is token ids; ``--requests`` of them.

**Engines**, all on the same requests in one process, at most ``--max-batch-size`` sequences at once:

* ``hf_generate`` -- transformers' ``model.generate``, one request at a time (the ground truth);
* ``hf_batch_generate`` -- ``model.generate`` on left-padded batches of ``--max-batch-size``
  (a batch runs until its longest request is done: static batching, as transformers does it);
* ``static`` -- :func:`cbteach.static_batching`: the same, in this package;
* ``cbteach_concat`` / ``cbteach_paged`` -- our continuous-batching engine with each KV cache;
* ``cbteach_paged_budget`` -- the paged engine with a ``--token-budget`` (chunked prefill);
* ``transformers_cb`` -- transformers' own continuous batching (``generate_batch``'s manager),
  sized like ours: 16-token pages, the same batch size, a pool just big enough.

With arrival times (``poisson``), the continuous engines admit a request once it has arrived;
the batch engines (``hf_*``, ``static``) serve in waves: a wave takes up to a batch of the
requests that have arrived when the previous wave ends (waiting for the first if none has).

**Hygiene.** One process, one thread (``--threads``), every engine warmed up first (the whole
workload, untimed: lazy imports, allocator growth, kernel selection), then ``--repeat`` timed runs
interleaved across engines, the run of median wall time reported. Greedy fp32: every engine must
produce the tokens of per-prompt ``generate`` (``matched``), else a speed-up is meaningless.

**Metrics** per engine (vLLM's definitions, :mod:`cbteach.metrics`, times in seconds): TTFT,
TPOT, ITL, E2E (mean, p50, p90, p99); output tokens/s and requests/s over first arrival -> last
finish; goodput (requests/s meeting ``--ttft-target`` and ``--tpot-target``); for our engines the
forward steps, preemptions and largest batch, and for paged ones the KV utilisation of the warm-up
run (tokens stored / slots set aside, beside what a contiguous ``prompt + max_new_tokens``
reservation would give).

**Ideal vs measured speed-up.** A step produces one token per busy slot. Static batching keeps a
slot until the wave's longest request is done, so it needs ``sum over waves of the longest output``
steps; continuous batching refills a slot as soon as it frees, so it needs about
``max(total tokens / batch size, longest output)``. *Ideal speed-up* = static steps / continuous
steps, what slot arithmetic predicts if every step cost the same. *Measured* = static seconds /
continuous seconds. The gap is what the engine's steps cost beyond static's: packing, metadata,
paged attention's gather, a bigger prefill mixed into a decode step.

**Step time vs history** (``--history``). A fixed batch decodes long outputs (``ignore_eos``). Per
step: forward time, ``kv_bytes_copied`` (concat: the history gathered and scattered every step --
it grows) and ``kv_bytes_read`` (paged: what attention reads through the block tables).

**Targets** (CPU, reference configuration ``--reference`` = 64 headwords, 300 new tokens, batch 16):
``cbteach_paged`` measured speed-up >= 0.9 x ideal, and ``cbteach_paged`` >= 1.5 x
``transformers_cb`` tokens/s. Printed as met / not met, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from . import workloads as wl
from .bierce.corpus import headword_prompts
from .engine import Engine
from .memory import accounting, summary
from .metrics import summarize
from .modelinfo import eos_ids_for
from .models import load_model
from .request import Completion, Request
from .static import static_batching

ENGINES = ("static", "cbteach_concat", "cbteach_paged", "transformers_cb")  # what tools/gpu_check.py compares
ALL_ENGINES = ("hf_generate", "hf_batch_generate", "static", "cbteach_concat", "cbteach_paged",
               "cbteach_paged_budget", "transformers_cb")
REFERENCE = {"requests": 64, "max_new_tokens": 300, "batch_size": 16}
TARGET_VS_IDEAL = 0.9  # cbteach_paged measured speed-up over static >= this x the ideal one
TARGET_VS_TRANSFORMERS = 1.5  # cbteach_paged tokens/s >= this x transformers_cb's
PAGE = 16  # tokens per KV block, ours and transformers'
TOKEN_BUDGET = 64  # cbteach_paged_budget's default token budget
METRICS = ("ttft", "tpot", "itl", "e2e")
MEMORY_KEYS = ("paged_utilisation", "paged_internal_fraction", "contiguous_reserved_fraction",
               "contiguous_internal_fraction", "contiguous_utilisation", "peak_paged_slots", "peak_contiguous_slots")


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


# -- the engines: each serves ``requests`` and returns (extra row fields, completions, steps) -------
# Every completion's times are seconds since the start of the run; a request's arrival_time (None:
# at once) counts from there too.
def _arrival(r) -> float:
    return float(r.arrival_time or 0.0)


def _prompt_ids(tok, r) -> list[int]:
    return list(tok(r.prompt)["input_ids"]) if isinstance(r.prompt, str) else [int(t) for t in r.prompt]


def _serve_in_waves(requests, batch_size, run_wave):
    """A batch server: each wave takes up to ``batch_size`` requests that have arrived when the previous
    wave ends (in arrival order; waiting for the next arrival if none has) and runs them to the end.
    ``run_wave(reqs)`` returns ``(completions, steps)`` with times relative to its own start."""
    t0 = time.perf_counter()
    order = sorted(range(len(requests)), key=lambda i: (_arrival(requests[i]), i))
    done: dict = {}
    steps = pos = 0
    while pos < len(order):
        wait = _arrival(requests[order[pos]]) - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter() - t0
        wave = [order[pos]]
        while len(wave) < batch_size and pos + len(wave) < len(order) and \
                _arrival(requests[order[pos + len(wave)]]) <= now:
            wave.append(order[pos + len(wave)])
        pos += len(wave)
        start = time.perf_counter() - t0
        comps, n = run_wave([requests[i] for i in wave])
        steps += n
        for i, c in zip(wave, comps):
            done[i] = replace(c, arrival_time=_arrival(requests[i]), first_token_time=c.first_token_time + start,
                              token_times=[t + start for t in c.token_times], finish_time=c.finish_time + start)
    return [done[i] for i in range(len(requests))], steps


def run_static(model, tok, requests, batch_size, **_):
    """:func:`cbteach.static_batching`, one wave at a time as requests arrive."""
    def wave(reqs):
        res = static_batching(model, tok, [replace(r, arrival_time=None) for r in reqs], batch_size)
        return list(res), len(res.steps)
    comps, steps = _serve_in_waves(requests, batch_size, wave)
    return {}, comps, steps


class _Stamps:
    """A ``generate`` streamer that only notes when each step's tokens were ready (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt = True

    def put(self, value):
        if self._prompt:
            self._prompt = False
        else:
            self.times.append(time.perf_counter())

    def end(self):
        pass


def _hf_wave(model, tok, reqs, eos):
    """One ``model.generate`` call on left-padded ``reqs``; per-row caps stop rows, EOS as each request asks."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    prompts = [_prompt_ids(tok, r) for r in reqs]
    width = max(len(p) for p in prompts)
    pad = min(eos) if eos else 0
    dev = model.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    caps = torch.tensor([r.max_new_tokens for r in reqs], device=dev)

    class Caps(StoppingCriteria):  # a row is done at its own max_new_tokens (generate has one for all)
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - width) >= caps

    any_ignore = any(r.ignore_eos for r in reqs)
    stamps = _Stamps()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # eos_token_id=[-1] ("never stop at EOS") is warned about, on purpose
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(r.max_new_tokens for r in reqs),
                             eos_token_id=[-1] if any_ignore or not eos else sorted(eos), pad_token_id=pad,
                             stopping_criteria=StoppingCriteriaList([Caps()]), streamer=stamps)
    finally:
        hf_logging.set_verbosity(verbosity)
    comps = []
    for i, r in enumerate(reqs):
        o = out[i, width:].tolist()[:r.max_new_tokens]
        reason = "length"
        if not r.ignore_eos:
            stop = next((k for k, t in enumerate(o) if t in eos), None)
            if stop is not None:
                o, reason = o[:stop + 1], "eos"
        times = [t - t0 for t in stamps.times[:len(o)]]
        comps.append(Completion(request_id=r.request_id, prompt_ids=prompts[i], output_ids=o, finish_reason=reason,
                                first_token_time=times[0], token_times=times, finish_time=times[-1]))
    return comps, len(stamps.times)


def run_hf_generate(model, tok, requests, batch_size, **_):
    """Per-prompt greedy ``model.generate``: one request at a time, in arrival order."""
    eos = eos_ids_for(model)
    comps, steps = _serve_in_waves(requests, 1, lambda reqs: _hf_wave(model, tok, reqs, eos))
    return {}, comps, steps


def run_hf_batch_generate(model, tok, requests, batch_size, **_):
    """``model.generate`` on left-padded waves of ``batch_size``: transformers' static batching."""
    eos = eos_ids_for(model)
    comps, steps = _serve_in_waves(requests, batch_size, lambda reqs: _hf_wave(model, tok, reqs, eos))
    return {}, comps, steps


def run_cbteach(model, tok, requests, batch_size, kv="paged", keep_records=False, **options):
    """Our engine, stepped by hand: forward steps, the largest batch and preemptions are counted without
    keeping records. Requests are added at once with their arrival times on the engine's clock; the
    clock of the run starts after the engine (and its pool) is built."""
    eng = Engine(model, tok, max_batch_size=batch_size, kv=kv, keep_records=keep_records, **options)
    t_run = eng.now()
    arrivals = sorted(t_run + _arrival(r) for r in requests)
    for r in requests:
        eng.add_request(replace(r, arrival_time=t_run + _arrival(r)))
    steps = peak = 0
    with eng.serving():  # attention switched once for the run, as Engine.run does
        while eng.has_unfinished():
            rec = eng.step()
            if rec.seqs:
                steps += 1
                peak = max(peak, len(rec.seqs))
                continue
            now = eng.now()
            later = [t for t in arrivals if t > now]
            if not later:
                raise RuntimeError("the engine made no progress with every request arrived")
            time.sleep(later[0] - now)
    comps = [replace(c, arrival_time=c.arrival_time - t_run, first_token_time=c.first_token_time - t_run,
                     token_times=[t - t_run for t in c.token_times], finish_time=c.finish_time - t_run)
             for c in (eng.completions[r.request_id] for r in requests)]
    extra = {"preemptions": sum(s.num_preemptions for s in eng.sequences.values()), "peak_batch": peak}
    if kv == "paged":
        extra["num_blocks"] = eng.kv.num_blocks
        if keep_records:
            extra.update(summary(accounting(eng)))
    return extra, comps, steps


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


def run_transformers_cb(model, tok, requests, batch_size, num_blocks=None, **_):
    """transformers' continuous batching on the same requests (per-request max_new_tokens; ignore_eos
    becomes an EOS id of -1, which no token has). Requests are added from this thread as they arrive;
    token times are transformers' own timestamps. Timed from the start of the manager to the last
    result; building and stopping it (thread, cache, gc) is reported apart as ``setup_seconds``."""
    from transformers import GenerationConfig

    ids = [_prompt_ids(tok, r) for r in requests]
    eos = sorted(eos_ids_for(model)) or [-1]
    pad = model.generation_config.pad_token_id
    gen = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False,
                           eos_token_id=eos, pad_token_id=eos[0] if pad is None else pad)
    cfg = transformers_cb_config(batch_size, [len(i) for i in ids], gen.max_new_tokens, num_blocks)
    t_setup = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    order = sorted(range(len(requests)), key=lambda i: (_arrival(requests[i]), i))
    results, added = {}, {}
    try:
        t0 = time.perf_counter()
        manager.start()
        while len(results) < len(requests):
            now = time.perf_counter() - t0
            while len(added) < len(order) and _arrival(requests[order[len(added)]]) <= now:
                i = order[len(added)]
                added[f"r{i}"] = time.perf_counter() - t0
                manager.add_request(ids[i], request_id=f"r{i}", max_new_tokens=requests[i].max_new_tokens,
                                    eos_token_id=[-1] if requests[i].ignore_eos else eos, record_timestamps=True)
            nxt = _arrival(requests[order[len(added)]]) - now if len(added) < len(order) else 1.0
            res = manager.get_result(timeout=max(1e-4, min(1.0, nxt)))
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
    comps = []
    for i, r in enumerate(requests):
        res = results[f"r{i}"]
        out = list(res.generated_tokens)
        times = [t - t0 for t in res.timestamps] if res.timestamps else [seconds] * len(out)
        comps.append(Completion(request_id=r.request_id, prompt_ids=ids[i], output_ids=out,
                                finish_reason="eos" if out and out[-1] in eos and not r.ignore_eos else "length",
                                arrival_time=added[f"r{i}"], first_token_time=times[0], token_times=times,
                                finish_time=times[-1]))
    return {"setup_seconds": time.perf_counter() - t_setup - seconds}, comps, None


def runners(model, tok, batch_size, *, token_budget=TOKEN_BUDGET, num_blocks=None, kv_memory_bytes=None) -> dict:
    """``{engine name: run(requests, first) -> (extra, completions, steps)}`` for every engine.
    ``num_blocks`` / ``kv_memory_bytes`` size the paged pools (and transformers' pool: ``num_blocks``)."""
    pool = {"num_blocks": num_blocks} if kv_memory_bytes is None else {"kv_memory_bytes": kv_memory_bytes}
    return {
        "hf_generate": lambda rs, first: run_hf_generate(model, tok, rs, batch_size),
        "hf_batch_generate": lambda rs, first: run_hf_batch_generate(model, tok, rs, batch_size),
        "static": lambda rs, first: run_static(model, tok, rs, batch_size),
        "cbteach_concat": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "concat", keep_records=first),
        "cbteach_paged": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "paged", keep_records=first, **pool),
        "cbteach_paged_budget": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "paged", keep_records=first,
                                                              token_budget=token_budget, **pool),
        "transformers_cb": lambda rs, first: run_transformers_cb(model, tok, rs, batch_size, num_blocks),
    }


# -- measuring ---------------------------------------------------------------------------------------
def measure(completions, wall_seconds, steps, ttft_target=None, tpot_target=None) -> dict:
    """One engine's row: :func:`cbteach.metrics.summarize` (tokens, rates, goodput, latency statistics),
    ``seconds`` = its ``duration`` (first arrival -> last finish: the span every rate is over),
    ``wall_seconds`` (the whole call, building the engine included) and forward ``steps``."""
    row = summarize(completions, ttft_target=ttft_target, tpot_target=tpot_target)
    row.update(seconds=row["duration"], wall_seconds=wall_seconds, steps=steps, tokens=row["output_tokens"])
    return row


def run_engine(name, model, tok, workload, batch_size, *, first=False, ttft_target=None, tpot_target=None,
               **pool) -> tuple[dict, list]:
    """Serve ``workload`` (a :class:`~cbteach.workloads.Workload` or a request factory) once with
    engine ``name``; returns ``(row, completions)``. No warm-up: see :func:`compare`."""
    if name not in ALL_ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ALL_ENGINES)}")
    run = runners(model, tok, batch_size, **pool)[name]
    reqs = workload()
    t0 = time.perf_counter()
    extra, comps, steps = run(reqs, first)
    row = measure(comps, time.perf_counter() - t0, steps, ttft_target, tpot_target)
    row.update(extra)
    return row, comps


def _offline(make_requests, n=None, max_new=None):
    """The requests without arrival times (warm-ups do not wait for arrivals), optionally the first
    ``n`` of them with outputs capped at ``max_new``."""
    reqs = make_requests()[:n]
    return [replace(r, arrival_time=None, max_new_tokens=min(r.max_new_tokens, max_new or r.max_new_tokens))
            for r in reqs]


def compare(model, tok, make_requests, batch_size, engines=ENGINES, full_warmup=ENGINES, num_blocks=None,
            bar=None, *, repeat=1, ttft_target=None, tpot_target=None, token_budget=TOKEN_BUDGET,
            kv_memory_bytes=None, outputs=None) -> dict:
    """Warm up and time each engine on ``make_requests()`` (a workload or any request factory); one row each.

    Engines in ``full_warmup`` first run the whole workload untimed (without arrival times; its seconds:
    ``first_run_seconds``); the others warm up on one short wave. Then ``repeat`` timed runs,
    interleaved across engines; the run of median wall time is reported (``repeats``: every run's
    seconds). ``matched``: the engine's tokens equal the reference engine's (``hf_generate`` when it
    ran, else ``static``; ``reference_engine`` in every row); ``identical_to_static`` as well.
    A failing engine gets ``{"error": ...}`` and the rest still run. Pass a dict as ``outputs`` to
    get every engine's completions (of the reported run) back in it.
    """
    run = runners(model, tok, batch_size, token_budget=token_budget, num_blocks=num_blocks,
                  kv_memory_bytes=kv_memory_bytes)
    unknown = set(engines) - set(run)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ALL_ENGINES)}")
    rows, first, runs = {}, {}, {name: [] for name in engines}
    for name in engines:  # warm-up: first-run effects stay out of the timed runs
        bar is not None and bar.set_postfix_str(f"{name} (warm-up)")
        try:
            reqs = _offline(make_requests) if name in full_warmup else _offline(make_requests, batch_size, 8)
            t0 = time.perf_counter()
            extra, _, _ = run[name](reqs, True)
            first[name] = {"first_run_seconds": time.perf_counter() - t0,
                           **{k: v for k, v in extra.items() if k in MEMORY_KEYS}}
        except Exception as err:  # noqa: BLE001  (a benchmark reports a broken engine and goes on)
            rows[name] = _failed(err)
        bar is not None and bar.update(1)
    for _ in range(repeat):
        for name in engines:
            if name in rows:
                continue
            bar is not None and bar.set_postfix_str(name)
            try:
                reqs = make_requests()
                t0 = time.perf_counter()
                extra, comps, steps = run[name](reqs, False)
                runs[name].append((time.perf_counter() - t0, extra, comps, steps))
            except Exception as err:  # noqa: BLE001
                rows[name] = _failed(err)
            bar is not None and bar.update(1)
    outs = {}
    for name in engines:
        if name in rows:
            continue
        measured = []
        for wall, extra, comps, steps in runs[name]:
            row = measure(comps, wall, steps, ttft_target, tpot_target)
            row.update(extra)
            measured.append((row, comps))
        row, comps = sorted(measured, key=lambda x: x[0]["seconds"])[(len(measured) - 1) // 2]  # the median run
        row.update(first[name])  # the warm-up's memory figures (it kept records) win over the timed run's
        row["repeats"] = [m[0]["seconds"] for m in measured]
        rows[name] = row
        outs[name] = [c.output_ids for c in comps]
        if outputs is not None:
            outputs[name] = comps
    ref = "hf_generate" if "hf_generate" in outs else "static" if "static" in outs else None
    for name in outs:
        rows[name]["reference_engine"] = ref
        rows[name]["matched"] = None if ref is None else outs[name] == outs[ref]
        if "static" in outs and name != "static":
            rows[name]["identical_to_static"] = outs[name] == outs["static"]
    return {name: rows[name] for name in engines}


def _failed(err) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "tokens_per_s": None, "seconds": None, "steps": None}


def sweep(model, tok, workloads, batch_size, engines=ALL_ENGINES, bar=None, outputs=None, **kw) -> list[dict]:
    """:func:`compare` on each workload in turn (a cap sweep, a rate sweep): ``[{"workload", "engines"}]``.
    Only the first point warms up on the whole workload; the engines are warm after it. Pass a list
    as ``outputs`` to get each point's completions (``{engine: completions}``) appended to it."""
    out = []
    for k, w in enumerate(workloads):
        got: dict = {}
        rows = compare(model, tok, w, batch_size, engines, full_warmup=engines if k == 0 else (), bar=bar,
                       outputs=got, **kw)
        out.append({"workload": w.summary(), "engines": rows})
        if outputs is not None:
            outputs.append(got)
    return out


# -- experiments of notebook 07 --------------------------------------------------------------------
def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token, all layers (what a KV memory budget is divided by)."""
    from .modelinfo import describe

    return describe(model).kv_bytes_per_token


def contiguous_batch_size(kv_tokens: int, workload, reserve_new_tokens: int) -> int:
    """How many requests a contiguous KV cache of ``kv_tokens`` admits at once when each reserves its
    worst case, ``prompt + reserve_new_tokens`` (the longest prompt of ``workload``: every slot must fit any)."""
    return max(1, kv_tokens // (max(workload.prompt_lengths) + reserve_new_tokens))


def memory_bound(model, tok, workload, kv_tokens: int, reserve_new_tokens: int, max_batch_size: int = 64,
                 block_size: int = PAGE) -> dict:
    """vLLM's memory-bound comparison on one KV budget of ``kv_tokens`` tokens.

    ``contiguous`` emulates a system that reserves ``prompt + reserve_new_tokens`` per request at
    admission (Orca with a maximum-length reservation): our paged engine with the same pool, its batch
    capped at the number of reservations that fit (:func:`contiguous_batch_size`), so the pool is never
    the limit -- the reservation arithmetic is. ``paged`` is the same pool handed out block by block,
    up to ``max_batch_size`` sequences (preempting when it runs out). Returns ``{"contiguous": row,
    "paged": row}`` (rows of :func:`run_engine`, with ``kv_tokens`` and ``max_batch_size`` added)."""
    budget = kv_tokens * kv_bytes_per_token(model)
    out = {}
    for label, b in (("contiguous", contiguous_batch_size(kv_tokens, workload, reserve_new_tokens)),
                     ("paged", max_batch_size)):
        row, _ = run_engine("cbteach_paged", model, tok, workload, b, kv_memory_bytes=budget)
        out[label] = {**row, "kv_tokens": kv_tokens, "max_batch_size": b}
    return out


def decode_step_times(model, batch_sizes=(1, 2, 4, 8, 16, 32), steps: int = 24, prompt_len: int = 8) -> list[float]:
    """Median seconds of a decode-only step with ``b`` sequences, for each ``b`` in ``batch_sizes``."""
    out = []
    for b in batch_sizes:
        eng = Engine(model, None, max_batch_size=b, kv="paged")
        eng.run([Request([1 + (i + k) % 50 for k in range(prompt_len)], steps, ignore_eos=True) for i in range(b)])
        decode = [r.duration for r in eng.records if len(r.seqs) == b and all(s.kind == "decode" for s in r.seqs)]
        out.append(statistics.median(decode))
    return out


def random_llama(device="cuda", dtype=None, **shape):
    """A random-weight ``LlamaForCausalLM`` of TinyLlama-1.1B's shape (or ``shape``), built from a config:
    nothing is downloaded. Greedy outputs of random weights are gibberish, but their cost is real."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = {**dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                   intermediate_size=5632), **shape}
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **dims)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model.to(dtype or torch.float32).eval()


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


def machine_info(model=None) -> dict:
    """Where the numbers come from: processor, threads, versions, the model's device and dtype."""
    import os

    import torch
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    if model is not None:
        p = next(model.parameters())
        info.update(device=str(p.device), dtype=str(p.dtype).replace("torch.", ""),
                    parameters=sum(q.numel() for q in model.parameters()))
        if p.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(p.device)
    return info


# -- the command -------------------------------------------------------------------------------
def clean(x):
    """NaN -> None, recursively, so the JSON is strict."""
    if isinstance(x, (dict, list, tuple)):
        return {k: clean(v) for k, v in x.items()} if isinstance(x, dict) else [clean(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def _fmt(x, spec):
    return "-" if x is None or x != x else format(x, spec)


def _ms(row, key):
    v = row.get(key)
    return "-" if v is None else f"{1e3 * v:.0f}" if v >= 0.1 else f"{1e3 * v:.1f}"


def print_table(rows: dict, ttft_target=None, tpot_target=None) -> None:
    """The short table: rates, latency p50/p99 (ms), goodput, steps, same tokens."""
    ref = next((r.get("reference_engine") for r in rows.values() if "reference_engine" in r), None)
    print(f"  {'engine':20s} {'tok/s':>7s} {'req/s':>6s} {'TTFT p50/p99':>13s} {'TPOT p50/p99':>13s} "
          f"{'ITL p50/p99':>12s} {'E2E p50/p99':>13s} {'goodput':>7s} {'steps':>6s}  same tokens as {ref}")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:20s} FAILED: {r['error']}")
            continue
        lat = [f"{_ms(r, m + '_p50')}/{_ms(r, m + '_p99')}" for m in METRICS]
        print(f"  {name:20s} {_fmt(r['tokens_per_s'], '7.0f')} {_fmt(r['requests_per_s'], '6.1f')} {lat[0]:>13s} "
              f"{lat[1]:>13s} {lat[2]:>12s} {lat[3]:>13s} {_fmt(r['goodput'], '7.1f')} {_fmt(r['steps'], '6d'):>6s}  "
              f"{'(reference)' if name == ref else r.get('matched')}")
    wanted = " and ".join(f"{k} <= {v:g} s" for k, v in (("TTFT", ttft_target), ("TPOT", tpot_target)) if v is not None)
    print(f"  (latencies in ms; goodput: requests/s {'with ' + wanted if wanted else 'of every request: no targets'})")
    for name, r in rows.items():
        if "paged_utilisation" in r:
            print(f"  {name}: KV utilisation {r['paged_utilisation']:.1%} (a contiguous prompt + max_new_tokens "
                  f"reservation: {r['contiguous_utilisation']:.1%}), {r['preemptions']} preemption(s), "
                  f"largest batch {r['peak_batch']}")


def print_targets(rows: dict, tg: dict, lengths=None, batch_size=None) -> None:
    a, b = tg["paged_vs_ideal"], tg["paged_vs_transformers_cb"]
    print(f"  speed-up of cbteach_paged over static: measured {_fmt(a['measured_speedup'], '.2f')}x, "
          f"ideal (static steps / continuous steps) {_fmt(a['ideal_speedup'], '.2f')}x")
    if lengths and batch_size:
        s = slot_steps(lengths, batch_size)
        print(f"  slot arithmetic on the output lengths: static {s['static']} steps, continuous >= {s['continuous']}"
              f" -> ideal speed-up <= {s['ideal_speedup']:.2f}x")
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print(f"  target: paged speed-up >= {a['goal']} x ideal: {_fmt(a['value'], '.2f')} x -> {verdict[a['met']]}")
    print(f"  target: paged >= {b['goal']} x transformers_cb tok/s: {_fmt(b['value'], '.2f')} x -> {verdict[b['met']]}")


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="headwords", choices=wl.WORKLOADS)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch-size", "--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128, help="output cap of headwords and poisson")
    p.add_argument("--cap", type=int, default=64, help="length_variance: the cap on exponential output lengths")
    p.add_argument("--rate", type=float, default=8.0, help="poisson: requests per second")
    p.add_argument("--sweep", type=_floats, default=None, metavar="V1,V2,...",
                   help="run length_variance at each cap, or poisson at each rate ('sweep' in the JSON; "
                        "'engines' holds the last point)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="bierce")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps, or auto (the best there is)")
    p.add_argument("--reference", action="store_true",
                   help="the targets' configuration: headwords, --requests 64 --max-new-tokens 300 --batch-size 16")
    p.add_argument("--engines", default=",".join(ALL_ENGINES),
                   help="comma-separated subset of " + ", ".join(ALL_ENGINES))
    p.add_argument("--token-budget", type=int, default=TOKEN_BUDGET, help="cbteach_paged_budget's token budget")
    p.add_argument("--ttft-target", type=float, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--tpot-target", type=float, default=0.05, help="goodput: TPOT target in seconds")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (the median is reported)")
    p.add_argument("--history", type=int, default=256, help="decode steps for the step-time experiment (0: skip)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for bench-<model>.json")
    p.add_argument("--json", type=Path, default=None, help="write the results here instead")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: a 2M-parameter model gains nothing from more, "
                        "and timings on a shared machine stay steady)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.reference:
        a.workload = "headwords"
        a.requests, a.max_new_tokens, a.batch_size = (REFERENCE[k] for k in ("requests", "max_new_tokens", "batch_size"))
    engines = [e for e in a.engines.split(",") if e]
    if set(engines) - set(ALL_ENGINES):
        p.error(f"unknown engine(s) {sorted(set(engines) - set(ALL_ENGINES))}; choose from {', '.join(ALL_ENGINES)}")
    if a.repeat < 1 or a.requests < 1 or a.batch_size < 1:
        p.error("--repeat, --requests and --max-batch-size must be >= 1")
    if a.sweep and a.workload not in ("length_variance", "poisson"):
        p.error("--sweep needs --workload length_variance (caps) or poisson (rates)")
    import torch

    from .models import pick_device

    device = pick_device(None if a.device == "auto" else a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, device=device)
    build = lambda **kw: wl.build(a.workload, tok, a.requests, max_new_tokens=a.max_new_tokens,  # noqa: E731
                                  seed=a.seed, **{"cap": a.cap, "rate": a.rate, **kw})
    points = [build(**{"cap" if a.workload == "length_variance" else "rate":
                       int(v) if a.workload == "length_variance" else v}) for v in a.sweep] if a.sweep else [build()]
    workload = points[-1]
    ref = a.workload == "headwords" and all(getattr(a, k) == v for k, v in REFERENCE.items())
    print(f"workload: {workload.description}")
    print(f"engines: {', '.join(engines)}; at most {a.batch_size} sequences at a time; model {a.model} on "
          f"{device.type}{' (the reference configuration)' if ref else ''}")
    from tqdm.auto import tqdm

    kw = dict(ttft_target=a.ttft_target, tpot_target=a.tpot_target, token_budget=a.token_budget, repeat=a.repeat)
    total = len(engines) * (len(points) * a.repeat + 1)
    with tqdm(total=total, desc="bench", unit="run", disable=a.no_progress, leave=False) as bar:
        if a.sweep:
            points_out = sweep(model, tok, points, a.batch_size, engines, bar=bar, **kw)
            rows = points_out[-1]["engines"]
        else:
            captured: dict = {}
            rows = compare(model, tok, workload, a.batch_size, engines, full_warmup=engines, bar=bar,
                           outputs=captured, **kw)
    if a.sweep:
        key = "cap" if a.workload == "length_variance" else "rate"
        for pt in points_out:
            cells = "  ".join(f"{n} {_fmt(r.get('tokens_per_s'), '.0f')}" for n, r in pt["engines"].items())
            print(f"  {key} {pt['workload']['params'][key]:g}: tokens/s  {cells}")
        print(f"  at {key} {points_out[-1]['workload']['params'][key]:g}:")
    print_table(rows, a.ttft_target, a.tpot_target)
    tg = targets(rows)
    done = next((captured[e] for e in ("hf_generate", "static", "cbteach_paged") if e in captured), None) \
        if not a.sweep else None
    lengths = [len(c.output_ids) for c in done] if done else None
    print_targets(rows, tg, lengths, a.batch_size)
    result = {"config": {"workload": a.workload, "model": a.model, "device": device.type, "requests": a.requests,
                         "batch_size": a.batch_size, "max_new_tokens": a.max_new_tokens, "engines": engines,
                         "token_budget": a.token_budget, "ttft_target": a.ttft_target, "tpot_target": a.tpot_target,
                         "repeat": a.repeat, "reference": ref},
              "workload": workload.summary(), "machine": machine_info(model), "engines": rows, "targets": tg}
    if a.sweep:
        result["sweep"] = points_out
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
