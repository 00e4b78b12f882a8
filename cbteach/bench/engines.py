"""The engines ``python -m cbteach bench`` compares, each behind one function of the same shape.

``run_<engine>(model, tok, requests, batch_size)`` serves ``requests`` and returns ``(extra row
fields, completions, steps)``, every completion's times in seconds since the start of the run:
per-prompt and padded-batch ``generate`` (transformers), cbteach's static batching, cbteach's engine
with either KV cache, and transformers' own continuous batching. :func:`runners` names them all.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from ..engine.engine import Engine
from ..kv.memory import accounting, summary
from ..core.modelinfo import eos_ids_for
from ..core.request import Completion
from ..engine.static import static_batching

PAGE = 16  # tokens per KV block, ours and transformers'
TOKEN_BUDGET = 64  # cbteach_paged_budget's default token budget
MEMORY_KEYS = ("paged_utilisation", "paged_internal_fraction", "contiguous_reserved_fraction",
               "contiguous_internal_fraction", "contiguous_utilisation", "peak_paged_slots", "peak_contiguous_slots")


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
    t_loop = time.perf_counter()
    while eng.has_unfinished():
        rec = eng.step()
        if not rec.idle:
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
    loop = time.perf_counter() - t_loop
    extra = {"preemptions": sum(s.num_preemptions for s in eng.sequences.values()), "peak_batch": peak,
             # the share of the serving loop the model was not computing: scheduling, packing, sampling, updates
             "host_fraction": max(0.0, 1 - eng.forward_seconds / loop) if loop > 0 else 0.0}
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
        "cbteach_paged_async": lambda rs, first: run_cbteach(model, tok, rs, batch_size, "paged", keep_records=first,
                                                             async_scheduling=True, **pool),
        "transformers_cb": lambda rs, first: run_transformers_cb(model, tok, rs, batch_size, num_blocks),
    }
