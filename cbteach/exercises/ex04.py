"""Notebook 04: predict how many bytes the concatenating KV cache copies over a whole run.

The check serves the learner's requests on a fresh :class:`cbteach.Engine` (``kv="concat"``) and
adds up what the engine measured on every step (``StepRecord.kv_bytes_copied``), so the answer is
compared with what really happened, not with a formula.
"""
from __future__ import annotations

import numbers

from ..core.engine import Engine
from ..core.modelinfo import describe
from ..core.request import Request
from . import report, self_check


def measure_total_bytes_copied(model, tokenizer, requests, max_batch_size: int):
    """Serve fresh copies of ``requests`` and return ``(total bytes copied, the step records)``."""
    fresh = [Request(r.prompt, r.max_new_tokens, request_id=r.request_id, ignore_eos=r.ignore_eos)
             for r in requests]
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, kv="concat")
    engine.run(fresh)
    return sum(r.kv_bytes_copied for r in engine.records), engine.records


@self_check
def check_total_bytes_copied(model, tokenizer, requests, max_batch_size: int, answer) -> bool:
    """``answer``: the K/V bytes copied over every step of serving ``requests`` -- our gather, the
    ``DynamicCache``'s copy of it, the model's own append, and our scatter."""
    if not isinstance(answer, numbers.Real) or isinstance(answer, bool):
        return report(False, "", f"answer should be a number of bytes, got {type(answer).__name__}")
    if not all(r.ignore_eos for r in requests):
        return report(False, "", "give every request ignore_eos=True: only then is its length known in advance")
    total, records = measure_total_bytes_copied(model, tokenizer, requests, max_batch_size)
    if answer == total:
        return report(True, f"{total:,} bytes over {len(records)} steps, exactly what the engine measured", "")
    info = describe(model)
    per_token = info.kv_bytes_per_token
    cached = sum(sum(r.num_computed_tokens) for r in records)
    new = sum(sum(r.num_scheduled_tokens) for r in records)
    near = [  # (a tempting wrong total, what it means); several can coincide, so all that match are named
        (per_token * cached, "that is cbteach's gather alone; three more copies follow it"),
        (per_token * (2 * cached + new), "that is cbteach's own gather and scatter; transformers' DynamicCache "
                                         "copies too -- once when it takes the gathered history, once when the "
                                         "model appends the new tokens"),
        (per_token * (cached + new), "that is one copy of the packed cache; count every copy of it"),
        (per_token * 4 * cached, "the model's update and the scatter also copy this step's new keys and values"),
        (per_token * (4 * cached + new), "both the model's update and the scatter include the new tokens"),
        (total // info.num_layers, "that is one layer; every layer has its own cache"),
        (total // 2, "count keys and values, both"),
        (total // info.dtype.itemsize, "those are elements; multiply by the bytes per element"),
    ]
    hints = [hint for value, hint in near if answer == value]
    if not hints and answer > 0 and total and abs(answer - total) / total < 0.2:
        hints.append("close: check the number of steps each request runs (its prefill step, then one per "
                     "further token)")
    detail = (" -- " + " -- or ".join(hints)) if hints else "; check the formula step by step"
    side = "too high" if answer > total else "too low"
    return report(False, "", f"{answer:,} is {side} for the bytes the engine copied{detail}")
