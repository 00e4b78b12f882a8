"""Notebook 03: the position ids and the attention mask of one packed step, written by hand.

Both checks compare the learner's answer with :mod:`cbteach.attention.packing` -- the functions the engine
itself calls -- and name every wrong entry by its sequence and position, so a mistake can be
found in the picture (``cbteach.viz.mask_ascii(cached=..., new=...)``).
"""
from __future__ import annotations

import torch

from ..attention.packing import block_diagonal_causal_mask, pack, per_sequence_causal_mask
from ..viz.mask import key_groups, query_labels
from ..viz.style import seq_letter
from . import is_int, report, self_check

MAX_LISTED = 8  # wrong entries named one by one; the rest are counted


def _lengths(cached, new):
    cached, new = [int(c) for c in cached], [int(n) for n in new]
    if len(cached) != len(new) or any(n < 1 for n in new) or any(c < 0 for c in cached):
        raise ValueError("give one cached length (>= 0) and one new length (>= 1) per sequence")
    return cached, new


def key_labels(cached, new) -> list[str]:
    """``"B p3 (cached)"`` for each key column of the concat layout ``[all cached | all new]``."""
    out = []
    for s, part, start, stop in key_groups(cached, new, "concat"):
        first = 0 if part == "cached" else cached[s]
        out += [f"{seq_letter(s)} p{first + k - start} ({part})" for k in range(start, stop)]
    return out


def _as_list(answer):
    if isinstance(answer, torch.Tensor):
        answer = answer.tolist()
    elif hasattr(answer, "tolist"):  # numpy
        answer = answer.tolist()
    return answer


@self_check
def check_position_ids(cached, new, answer) -> bool:
    """``answer``: the ``position_ids`` of the packed row (a list, or a ``[1, T]`` / ``[T]`` tensor)."""
    cached, new = _lengths(cached, new)
    expected = pack([[0] * n for n in new], cached).position_ids[0].tolist()
    got = _as_list(answer)
    if isinstance(got, list) and len(got) == 1 and isinstance(got[0], list):
        got = got[0]  # a [1, T] answer, like pack() returns
    if not isinstance(got, list) or not all(is_int(x) for x in got):
        return report(False, "", f"answer should be a list of {len(expected)} integers, got {answer!r}")
    if len(got) != len(expected):
        return report(False, "", f"the packed row has {sum(new)} tokens (sum of new = {new}), so it needs "
                                 f"{len(expected)} position ids; you gave {len(got)}")
    if got == expected:
        return report(True, f"position_ids = {expected}: each sequence counts on from what it already has "
                            "in the cache", "")
    labels = query_labels(cached, new)
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    lines = [f"  row index {i} (a token of sequence {labels[i].split()[0]}): you wrote {got[i]}, "
             f"which is {'too high' if got[i] > expected[i] else 'too low'}" for i in wrong[:MAX_LISTED]]
    if len(wrong) > MAX_LISTED:
        lines.append(f"  ... and {len(wrong) - MAX_LISTED} more")
    hints = []
    if got == list(range(len(expected))):
        hints.append("you numbered the packed row as one long sequence; every sequence has its own positions")
    if got == [j for n in new for j in range(n)]:
        hints.append("each sequence's new tokens start after the tokens it already has in the cache "
                     "(position num_computed_tokens, not 0)")
    msg = f"{len(wrong)} of {len(expected)} position ids are wrong:\n" + "\n".join(lines)
    return report(False, "", msg + "".join(f"\nhint: {h}" for h in hints))


@self_check
def check_mask(cached, new, answer) -> bool:
    """``answer``: the boolean ``[queries, keys]`` mask of the concat layout, True = may attend."""
    cached, new = _lengths(cached, new)
    expected = block_diagonal_causal_mask(cached, new)
    q, k = expected.shape
    try:
        got = torch.as_tensor(_as_list(answer))
    except (TypeError, ValueError):
        return report(False, "", f"answer should be a boolean tensor (or nested lists) of shape ({q}, {k})")
    if got.dtype.is_floating_point:
        return report(False, "", "give the boolean mask (True = may attend); additive_mask() makes the "
                                 "0 / -inf form the model receives out of it")
    if got.dim() == 4 and got.shape[:2] == (1, 1):
        got = got[0, 0]
    if tuple(got.shape) != (q, k):
        hint = ""
        if got.dim() == 2 and got.shape[0] == q and got.shape[1] == sum(new):
            hint = f" -- the keys include the {sum(cached)} cached ones, not only this step's {sum(new)}"
        return report(False, "", f"the mask should have one row per query (sum(new) = {q}) and one column per "
                                 f"key (sum(cached) + sum(new) = {k}): shape ({q}, {k}), "
                                 f"got {tuple(got.shape)}{hint}")
    got = got.to(torch.bool)
    if torch.equal(got, expected):
        return report(True, f"all {q} x {k} entries match block_diagonal_causal_mask({cached}, {new})", "")
    rows, cols = query_labels(cached, new), key_labels(cached, new)
    wrong = (got != expected).nonzero().tolist()
    lines = [f"  query {rows[i]} x key {cols[j]}: you "
             + ("allowed it, but it must be blocked" if got[i, j] else "blocked it, but it may attend")
             for i, j in wrong[:MAX_LISTED]]
    if len(wrong) > MAX_LISTED:
        lines.append(f"  ... and {len(wrong) - MAX_LISTED} more")
    hints = []
    if torch.equal(got, torch.ones(q, k, dtype=torch.bool).tril(k - q)):
        hints.append("that is a plain causal mask over the packed row: it lets sequences see each other")
    if torch.equal(got, per_sequence_causal_mask(cached, new)):
        hints.append("that is the per-sequence layout ([A all | B all]); the concat cache puts every cached key "
                     "first ([A cached | B cached | A new | B new])")
    msg = f"{len(wrong)} of {q * k} entries are wrong:\n" + "\n".join(lines)
    return report(False, "", msg + "".join(f"\nhint: {h}" for h in hints))
