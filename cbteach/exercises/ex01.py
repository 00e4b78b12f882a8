"""Notebook 01: how many slot-steps does one static wave spend idle, waiting at the batch barrier?"""
from __future__ import annotations

from . import report


def _wave_steps(result, wave):
    if not (hasattr(result, "steps") and hasattr(result, "batch_size")):
        raise ValueError(f"expected the StaticResult of cbteach.static_batching, got {type(result).__name__}")
    steps = [st for st in result.steps if st.wave == wave]
    if not steps:
        waves = sorted({st.wave for st in result.steps})
        raise ValueError(f"this run has no wave {wave!r}; its waves are {waves}")
    return steps


def _wave_lengths(result, wave: int) -> list[int]:
    """New tokens (EOS included) of every request in ``wave`` of a static run, in slot order."""
    steps = _wave_steps(result, wave)
    ids = [slot.request_id for slot in steps[0].slots if slot.request_id is not None]
    by_id = {c.request_id: len(c.output_ids) for c in result}
    return [by_id[rid] for rid in ids]


def check_idle_slot_steps(result, wave: int, answer) -> bool:
    """``answer`` should be the number of ``"idle"`` slot-steps of ``wave`` in the static run ``result``.

    The expected value is counted from the run's own step records, not from a formula.
    """
    steps = _wave_steps(result, wave)
    expected = sum(slot.state == "idle" for st in steps for slot in st.slots)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return report(False, "", f"answer should be a whole number of slot-steps, got {type(answer).__name__}")
    lengths = _wave_lengths(result, wave)
    longest = max(lengths)
    if answer == expected:
        return report(True, f"{expected} idle slot-steps: the wave runs {longest} steps (its longest answer), "
                            f"and each request idles for {longest} minus its own length", "")
    n = len(lengths)
    empty = sum(slot.state == "empty" for st in steps for slot in st.slots)
    pad = sum(slot.num_pad for st in steps for slot in st.slots if slot.state == "prefill")
    hints = []
    if empty and answer == expected + empty:
        hints.append(f"you counted the {empty} empty slot-steps too: this wave has only {n} requests for "
                     f"{result.batch_size} slots, and a slot nobody holds is empty, not idle")
    if answer in (expected + n, expected - n):
        hints.append("you are off by one step per request: the prefill step already produces the first token, "
                     f"so a request with L new tokens is busy for exactly L steps, and the wave lasts {longest}")
    if answer == longest - min(lengths) and n > 1:
        hints.append("that is how long the shortest request idles; add up the idle time of every request")
    if answer == sum(lengths):
        hints.append("that is the useful (decoded) slot-steps; the question asks for the idle ones")
    if answer == longest or answer == len(steps):
        hints.append("that is the number of steps the wave takes; each slot idles for part of them")
    if pad and answer in (expected + pad, expected + pad + empty):
        hints.append("you added the prompt padding; it is wasted too, but it is not an idle slot-step")
    if not hints:
        hints.append(f"the wave's answer lengths are {lengths}: each request idles for max(lengths) minus its own "
                     "length")
    return report(False, "", f"{answer!r} is not right ({'; '.join(hints)})")
