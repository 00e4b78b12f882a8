"""``python -m cbteach demo``: the whole story of the course in one terminal screen.

Six requests of very different lengths are served twice -- by static batching and by the
continuous-batching engine -- and the demo prints what each did: which request sat in which slot,
where the batch barrier made short requests wait, when the engine admitted a request into a freed
slot, what one packed row and its block-diagonal mask look like, how long each took, and finally
that both produced exactly the same tokens.
"""
from __future__ import annotations

import time

from .core.engine import Engine
from .models import load_model
from .core.request import Request
from .core.static import static_batching

# Headwords whose bierce definitions run from a line to a paragraph (tokens shown when run).
DEMO_PROMPTS = ["EXECUTIVE, n.", "TRUCE, n.", "ABSURDITY, n.", "ALONE, adj.", "LAWYER, n.", "CYNIC, n."]


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def run_demo(model_name: str = "bierce", batch_size: int = 3, max_new_tokens: int = 160, out=print) -> bool:
    from .viz.mask import mask_ascii

    model, tok = load_model(model_name)  # this machine's best device (cuda, mps, else cpu), fp32
    requests = [Request(p, max_new_tokens, request_id=f"r{i}") for i, p in enumerate(DEMO_PROMPTS)]
    out(f"cbteach demo: {len(requests)} requests on {model_name!r} (device {model.device.type}, "
        f"{str(model.dtype).removeprefix('torch.')}), batch size {batch_size}, max_new_tokens {max_new_tokens}\n")

    # --- static batching ------------------------------------------------------------------
    t0 = time.perf_counter()
    static = static_batching(model, tok, requests, batch_size)
    t_static = time.perf_counter() - t0
    out("== Static batching: waves of %d, each decoded until its longest request is done ==" % batch_size)
    for wave in sorted({s.wave for s in static.steps}):
        steps = [s for s in static.steps if s.wave == wave]
        out(f"wave {wave}: steps {steps[0].step}-{steps[-1].step}")
        for slot in range(batch_size):
            rid = steps[0].slots[slot].request_id
            if rid is None:
                out(f"  slot {slot}: (empty)")
                continue
            c = next(c for c in static if c.request_id == rid)
            idle = sum(1 for s in steps if s.slots[slot].state == "idle")
            out(f"  slot {slot}: {rid:3s} {len(c.output_ids):4d} tokens, then idle {idle:4d} steps  "
                f"{_short(requests[int(rid[1:])].prompt + ' ' + c.text, 50)}")
        out(f"  -- batch barrier after step {steps[-1].step}: the next wave starts only now --")
    w = static.waste()
    n_tokens = sum(len(c.output_ids) for c in static)
    out(f"static: {len(static.steps)} steps, {w['idle']} idle slot-steps, "
        f"{w['wasted_fraction']:.0%} of computed tokens wasted, {t_static:.2f} s, {n_tokens / t_static:.0f} tokens/s\n")

    # --- continuous batching --------------------------------------------------------------
    engine = Engine(model, tok, max_batch_size=batch_size)
    t0 = time.perf_counter()
    cont = engine.run(requests)
    t_cont = time.perf_counter() - t0
    out("== Continuous batching: a freed slot is refilled on the very next step ==")
    for r in engine.records:
        for rid in r.admitted:
            slot = next(s.slot for s in r.seqs if s.request_id == rid)
            prev = engine.records[r.step - 1].seqs if r.step else []
            freed = next((s.request_id for s in prev if s.slot == slot and s.finish_reason), None)
            out(f"step {r.step:4d}: admit  {rid} into slot {slot}" + (f"  (freed by {freed} on step {r.step - 1})"
                                                                       if freed else ""))
        for rid in r.finished:
            c = engine.completions[rid]
            out(f"step {r.step:4d}: finish {rid} ({c.finish_reason}, {len(c.output_ids)} tokens)")
    out(f"continuous: {len(engine.records)} steps, {t_cont:.2f} s, {n_tokens / t_cont:.0f} tokens/s\n")

    # --- one packed row and its mask --------------------------------------------------------
    first = engine.records[0]
    fused = next((r for r in engine.records if r.is_fused), None)
    for title, rec in (("step 0 (all prefill)", first), (f"step {fused.step if fused else '?'} (a prefill "
                                                          "fused with decodes)", fused)):
        if rec is None:
            continue
        out(f"== Packed row of {title}: {rec.num_tokens} tokens, no padding ==")
        out("  " + " ".join(f"{s.request_id}:{s.kind}×{s.num_scheduled_tokens}@{s.num_computed_tokens}"
                            for s in rec.seqs))
        out(mask_ascii(rec) + "\n")

    same = [c.output_ids for c in static] == [c.output_ids for c in cont]
    out(f"speed-up: {t_static / t_cont:.2f}x wall time, {len(static.steps) / len(engine.records):.2f}x fewer steps")
    out("identical tokens from static and continuous batching: " + ("YES" if same else "NO -- this is a bug"))
    return same
