"""The experiments of notebook 07 and the step-time-vs-history sweep, on top of the bench's engines."""
from __future__ import annotations

import math
import platform
import statistics
from collections import deque
from dataclasses import replace

from ..bierce.corpus import headword_prompts
from ..engine.engine import Engine
from ..core.request import Request


# -- experiments of notebook 07 --------------------------------------------------------------------
def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token, all layers (what a KV memory budget is divided by)."""
    from ..core.modelinfo import describe

    return describe(model).kv_bytes_per_token


def contiguous_batch_size(kv_tokens: int, workload, reserve_new_tokens: int) -> int:
    """How many requests a contiguous KV cache of ``kv_tokens`` admits at once when each reserves its
    worst case, ``prompt + reserve_new_tokens`` (the longest prompt of ``workload``: every slot must fit any)."""
    return max(1, kv_tokens // (max(workload.prompt_lengths) + reserve_new_tokens))


# -- queueing, counted in steps ------------------------------------------------------------------
def serve_in_steps(model, workload, batch_size: int, engine: str = "cbteach_paged") -> list[dict]:
    """Serve ``workload`` with its arrival times read as **steps**, not seconds; per request (in
    workload order): ``arrival``, ``first`` (the step whose end brought its first token), ``finish`` and
    ``tokens``. Time moves one unit per forward step and jumps over idle gaps, so the result is a count
    that machine noise cannot move: queueing, without the clock.

    ``cbteach_paged``: the real :class:`~cbteach.Engine`, a request added once its arrival step has
    come. ``static``: waves -- when a wave ends, the next takes up to ``batch_size`` of the requests
    that have arrived (waiting for the first if none has); a wave lasts its longest output's steps, as
    :func:`~cbteach.static_batching` takes for outputs of forced length (``ignore_eos``; tested)."""
    if any(not r.ignore_eos for r in workload.requests()):
        raise ValueError("serve_in_steps needs outputs of known length: a workload whose requests ignore EOS")
    reqs = [replace(r, arrival_time=None) for r in workload.requests()]
    arrival = [float(t) for t in (workload.arrival_times or [0.0] * len(reqs))]
    pending = deque(sorted(range(len(reqs)), key=lambda i: (arrival[i], i)))
    first, finish, t = {}, {}, 0
    if engine == "static":  # a wave of forced lengths takes its longest output's steps (static_batching's count)
        while pending:
            t = max(t, math.ceil(arrival[pending[0]]))
            wave = [pending.popleft() for _ in range(batch_size) if pending and arrival[pending[0]] <= t]
            for i in wave:
                first[i], finish[i] = t + 1, t + reqs[i].max_new_tokens
            t += max(reqs[i].max_new_tokens for i in wave)
    elif engine == "cbteach_paged":
        eng, index = Engine(model, None, max_batch_size=batch_size, kv="paged", keep_records=False), {}
        while pending or eng.has_unfinished():
            if not eng.has_unfinished():
                t = max(t, math.ceil(arrival[pending[0]]))  # idle: jump to the next arrival
            while pending and arrival[pending[0]] <= t:
                i = pending.popleft()
                index[reqs[i].request_id] = i
                eng.add_request(reqs[i])
            record, t = eng.step(), t + 1
            for s in record.seqs:
                if s.new_token_ids:
                    first.setdefault(index[s.request_id], t)
            for rid in record.finished:
                finish[index[rid]] = t
    else:
        raise ValueError(f"engine must be 'static' or 'cbteach_paged', got {engine!r}")
    return [{"arrival": arrival[i], "first": first[i], "finish": finish[i], "tokens": reqs[i].max_new_tokens}
            for i in range(len(reqs))]


def latency_vs_load_in_steps(model, workload, loads, batch_size: int, ttft_target: float,
                             engines=("static", "cbteach_paged"), seed: int = 0) -> list[dict]:
    """The knee, in steps: ``workload`` with Poisson arrivals at each load (requests **per step**), served
    by each engine (:func:`serve_in_steps`). Points shaped like :func:`~cbteach.bench.sweep`'s
    (``{"workload": {"params": {"rate": load}}, "engines": {name: row}}``); a row holds TTFT and E2E
    (p50, p99) in steps, and goodput: requests per step whose TTFT met ``ttft_target`` steps."""
    from ..serving.workloads import with_poisson_arrivals

    points = []
    for load in loads:
        w, rows = with_poisson_arrivals(workload, load, seed), {}
        for name in engines:
            served = serve_in_steps(model, w, batch_size, name)
            ttft = [r["first"] - r["arrival"] for r in served]
            e2e = [r["finish"] - r["arrival"] for r in served]
            span = max(r["finish"] for r in served) - min(r["arrival"] for r in served)
            good = sum(x <= ttft_target for x in ttft)
            rows[name] = {"ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "e2e_p50": _pct(e2e, 50),
                          "num_good": good, "num_requests": len(served), "goodput": good / span}
        points.append({"workload": {"params": {"rate": load}}, "engines": rows})
    return points


def _pct(values, q: float) -> float:
    """The q-th percentile, linearly interpolated (NumPy's default, as vLLM's client reports)."""
    import numpy as np

    return float(np.percentile(values, q))


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
