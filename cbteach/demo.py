"""``python -m cbteach demo``: the whole story of the course in one terminal screen.

Six requests of very different lengths are served by static batching and by the continuous-batching
engine, and the demo tells what each did *as it happens*: which request sat in which slot of which
wave, where the batch barrier made short requests wait, when the engine admitted a request into a
freed slot and when each finished, what one packed row and its block-diagonal mask look like --
then how long each took, and that both produced exactly the same tokens.

Timing honestly on a laptop (or a busy shared machine) takes three precautions:

* **one torch thread on a CPU**, as the notebooks use: bierce is tiny, more threads only add
  contention, and a machine shared with other work then gives steady numbers;
* **a warm-up** of both strategies before anything is timed (the first forward passes pay for
  allocations and kernel selection, and whichever strategy ran first would pay it alone);
* **the median of a few runs** (``--repeat``), each run timing static and continuous back to back,
  so a hiccup of the machine moves one run, not the verdict.
"""
from __future__ import annotations

import statistics
import time

import torch

from .core.modelinfo import max_positions
from .core.request import Request
from .core.validation import validate_request
from .engine.engine import Engine
from .engine.static import static_batching
from .models import load_model

# Headwords whose bierce definitions run from a line to a paragraph (tokens shown when run).
DEMO_PROMPTS = ["EXECUTIVE, n.", "TRUCE, n.", "ABSURDITY, n.", "ALONE, adj.", "LAWYER, n.", "CYNIC, n."]
WARMUP_TOKENS = 8


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def make_requests(max_new_tokens: int) -> list[Request]:
    return [Request(p, max_new_tokens, request_id=f"r{i}") for i, p in enumerate(DEMO_PROMPTS)]


def static_story(model, tok, requests, batch_size, out):
    """Static batching one wave at a time (the same waves, padding and tokens as one call), each wave
    printed as soon as it is done. Returns ``(completions, steps, idle slot-steps, wasted fraction)``."""
    completions, n_steps, idle, useful, wasted = [], 0, 0, 0, 0
    for wave, first in enumerate(range(0, len(requests), batch_size)):
        members = requests[first:first + batch_size]
        res = static_batching(model, tok, members, batch_size)
        w = res.waste()
        out(f"wave {wave}: steps {n_steps}-{n_steps + len(res.steps) - 1}")
        for slot in range(batch_size):
            if slot >= len(members):
                out(f"  slot {slot}: (empty)")
                continue
            c, r = res[slot], members[slot]
            slot_idle = sum(1 for s in res.steps if s.slots[slot].state == "idle")
            out(f"  slot {slot}: {r.request_id:3s} {len(c.output_ids):4d} tokens, then idle {slot_idle:4d} steps  "
                f"{_short(r.prompt + ' ' + c.text, 50)}")
        n_steps += len(res.steps)
        out(f"  -- batch barrier after step {n_steps - 1}: the next wave starts only now --")
        completions += list(res)
        idle, useful, wasted = idle + w["idle"], useful + w["useful_tokens"], wasted + w["wasted_tokens"]
    return completions, n_steps, idle, wasted / (useful + wasted) if useful + wasted else 0.0


def continuous_story(model, tok, requests, batch_size, out):
    """The engine stepped by hand: every admission and finish printed on the step it happens."""
    engine = Engine(model, tok, max_batch_size=batch_size)
    freed_at: dict[int, tuple[str, int]] = {}  # slot -> (request that left it, step)
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        rec = engine.step()
        for rid in rec.admitted:
            slot = next(s.slot for s in rec.seqs if s.request_id == rid)
            gone = freed_at.pop(slot, None)
            out(f"step {rec.step:4d}: admit  {rid} into slot {slot}"
                + (f"  (freed by {gone[0]} on step {gone[1]})" if gone else ""))
        for rid in rec.finished:
            c = engine.completions[rid]
            slot = next(s.slot for s in rec.seqs if s.request_id == rid)
            freed_at[slot] = (rid, rec.step)
            out(f"step {rec.step:4d}: finish {rid} ({c.finish_reason}, {len(c.output_ids)} tokens)")
    return [engine.completions[r.request_id] for r in requests], engine


def _timed(fn) -> tuple[float, list]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run_demo(model_name: str = "bierce", batch_size: int = 3, max_new_tokens: int = 160, out=None,
             repeat: int = 3, device=None) -> bool:
    """Tell the story, time both strategies, and return whether their tokens were identical."""
    from .viz.mask import mask_ascii

    def say(msg=""):
        (out or (lambda m: print(m, flush=True)))(msg)

    model, tok = load_model(model_name, device=device)  # device None: cuda, mps, else cpu; fp32
    threads = torch.get_num_threads()
    if model.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        requests = make_requests(max_new_tokens)
        for r in requests:  # (refused now, not after the warm-up and the first story)
            validate_request(r, tokenizer=tok, vocab_size=model.config.vocab_size, max_pos=max_positions(model.config))
        say(f"cbteach demo: {len(requests)} requests on {model_name!r} (device {model.device.type}, "
            f"{str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} CPU thread(s)), "
            f"batch size {batch_size}, max_new_tokens {max_new_tokens}")
        say("warming up both strategies (a short untimed run of each) ...")
        static_batching(model, tok, make_requests(WARMUP_TOKENS), batch_size)
        Engine(model, tok, max_batch_size=batch_size).run(make_requests(WARMUP_TOKENS))

        say(f"\n== Static batching: waves of {batch_size}, each decoded until its longest request is done ==")
        t_static, (static, n_static, idle, wasted) = _timed(lambda: static_story(model, tok, requests, batch_size, say))
        n_tokens = sum(len(c.output_ids) for c in static)
        say(f"static: {n_static} steps, {idle} idle slot-steps, {wasted:.0%} of computed tokens wasted, "
            f"{t_static:.2f} s\n")

        say("== Continuous batching: a freed slot is refilled on the very next step ==")
        t_cont, (cont, engine) = _timed(lambda: continuous_story(model, tok, make_requests(max_new_tokens),
                                                                 batch_size, say))
        say(f"continuous: {len(engine.records)} steps, {t_cont:.2f} s\n")

        first = engine.records[0]
        fused = next((r for r in engine.records if r.is_fused), None)
        for title, rec in (("step 0 (all prefill)", first),
                           (f"step {fused.step if fused else '?'} (a prefill fused with decodes)", fused)):
            if rec is None:
                continue
            say(f"== Packed row of {title}: {rec.num_tokens} tokens, no padding ==")
            say("  " + " ".join(f"{s.request_id}:{s.kind}×{s.num_scheduled_tokens}@{s.num_computed_tokens}"
                                for s in rec.seqs))
            say(mask_ascii(rec) + "\n")

        want = [c.output_ids for c in static]
        same = want == [c.output_ids for c in cont]
        say(f"== Timing: {repeat} run(s) of each, static then continuous back to back, without the printing ==")
        times = {"static": [], "continuous": []}
        for i in range(repeat):
            ts, res_s = _timed(lambda: static_batching(model, tok, make_requests(max_new_tokens), batch_size))
            tc, res_c = _timed(lambda: Engine(model, tok, max_batch_size=batch_size).run(make_requests(max_new_tokens)))
            same = same and [c.output_ids for c in res_s] == want == [c.output_ids for c in res_c]
            times["static"].append(ts)
            times["continuous"].append(tc)
            say(f"run {i + 1}: static {ts:.2f} s ({n_tokens / ts:.0f} tokens/s), continuous {tc:.2f} s "
                f"({n_tokens / tc:.0f} tokens/s), {ts / tc:.2f}x")
        speedup = statistics.median(s / c for s, c in zip(times["static"], times["continuous"]))
        say(f"speed-up: {speedup:.2f}x wall time (median of {repeat}), "
            f"{n_static / len(engine.records):.2f}x fewer steps")
        say("identical tokens from static and continuous batching: " + ("YES" if same else "NO -- this is a bug"))
        return same
    finally:
        torch.set_num_threads(threads)
