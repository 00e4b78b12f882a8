"""Claims the prose makes, printed with whether they held: the stored outputs back the text.

A notebook that says "a step of 16 sequences costs about as much as a step of one" must show it.
Every such comparison is computed in the cell beside the prose and printed as one line::

    claim: a batch of 16 costs less than 2x a batch of 1 per step -- holds
    claim: a batch of 16 costs less than 2x a batch of 1 per step -- DID NOT HOLD on this machine

The format is fixed (:data:`CLAIM_LINE`) so that a test can read every notebook's stored outputs
and fail when one of them reports a claim that did not hold (:func:`failed_claims`). A claim that rests on
the learner's own code is not computed while that code is still the student copy's stub (or fails its
check): :func:`not_checked` prints the line without a verdict, and says what to write first::

    claim: your scheduler scores what the engine's own does -- not checked: write MyScheduler in notebook 06 first

rather than a "DID NOT HOLD" that would blame the machine for a piece not written yet. A claim whose
verdict depends on the machine (a timing) goes in a cell marked ``# NBVAL_IGNORE_OUTPUT``; a claim
that is a count (steps, tokens, bytes) holds everywhere and can be compared by nbval.

Timings behind a claim are medians of repeats after a warm-up (:func:`timeit`): the median ignores
the few repeats another program on the machine happened to slow down, where the mean would not.
"""
from __future__ import annotations

import re
import statistics
import time

HOLDS = "holds"
FAILED = "DID NOT HOLD on this machine"
NOT_CHECKED = "not checked"
CLAIM_LINE = re.compile(rf"^claim: (?P<text>.+) -- (?P<verdict>{HOLDS}|{FAILED})$", re.MULTILINE)


def claim(text: str, holds) -> None:
    """Print ``claim: <text> -- holds`` (or ``-- DID NOT HOLD on this machine``). Returns nothing, so a
    notebook cell that ends with a claim shows only the line.

    ``text`` states the claim as the prose does, on one line; ``holds`` is the computed comparison
    (a bool, or a NumPy/torch boolean scalar)."""
    if not isinstance(text, str) or not text.strip() or "\n" in text:
        raise ValueError(f"a claim is one non-empty line of text, got {text!r}")
    try:
        ok = bool(holds)
    except (TypeError, RuntimeError, ValueError) as err:  # a tensor of several values has no truth value
        raise ValueError(f"holds must be one truth value, got {holds!r}") from err
    print(f"claim: {text.strip()} -- {HOLDS if ok else FAILED}")


def not_checked(text: str, first: str) -> None:
    """Print ``claim: <text> -- not checked: <first> first``: the claim rests on the learner's code, which
    is not written yet or does not pass its check, so no verdict is computed. ``first`` names what to do
    (``"write MyScheduler in notebook 06"``)."""
    for what in (text, first):
        if not isinstance(what, str) or not what.strip() or "\n" in what:
            raise ValueError(f"a claim and what it waits for are each one non-empty line of text, got {what!r}")
    print(f"claim: {text.strip()} -- {NOT_CHECKED}: {first.strip()} first")


def failed_claims(output: str) -> list[str]:
    """The texts of the claims in ``output`` (a cell's printed text) that did not hold."""
    return [m["text"] for m in CLAIM_LINE.finditer(output) if m["verdict"] == FAILED]


def stored_failed_claims(notebook) -> list[tuple[int, str]]:
    """``(cell index, claim text)`` for every claim a notebook's *stored* outputs report did not hold.

    Run after storing outputs (``tools/store_outputs.py`` does): outputs that say a claim failed
    contradict the prose beside them, and must not be committed."""
    import json
    from pathlib import Path

    cells = json.loads(Path(notebook).read_text(encoding="utf-8"))["cells"]
    found = []
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            found += [(i, t) for t in failed_claims("".join(text) if isinstance(text, list) else text)]
    return found


def timeit(fn, repeats: int = 15, warmup: int = 3, sync=None) -> float:
    """Median wall time of ``fn()`` in seconds, over ``repeats`` calls after ``warmup`` calls.

    ``sync``: a function called after each ``fn()`` before the clock stops -- on a GPU, which runs
    asynchronously, ``torch.cuda.synchronize``; otherwise the clock would time only the launch."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    for name, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    for _ in range(warmup):  # first calls pay for allocation, caches, lazy initialisation
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
