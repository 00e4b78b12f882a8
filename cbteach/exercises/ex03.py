"""Notebook 03: one packed step's position ids and attention mask, written by hand.

Compared with :mod:`cbteach.attention.packing` (what the engine calls); a hint names the *kind* of mistake,
never the wrong entries -- a list of coordinates would let a learner flip entries without understanding.
"""
from __future__ import annotations

import torch

from ..attention.packing import block_diagonal_causal_mask, pack, per_sequence_causal_mask
from ..viz.mask import key_groups
from ..viz.style import seq_letter
from . import as_ints, fail, passed, self_check

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
    return answer.tolist() if hasattr(answer, "tolist") else answer  # a tensor, a NumPy array


@self_check
def check_position_ids(cached, new, answer) -> bool:
    """``answer``: the ``position_ids`` of the packed row (a list, or a ``[1, T]`` / ``[T]`` tensor)."""
    cached, new = _lengths(cached, new)
    if answer is None or answer is Ellipsis:
        return fail("not done yet: write position_ids in the cell above, then run this check")
    expected = pack([[0] * n for n in new], cached).position_ids[0].tolist()
    got = _as_list(answer)
    if isinstance(got, (list, tuple)) and len(got) == 1 and isinstance(got[0], (list, tuple)):
        got = got[0]  # a [1, T] answer, like pack() returns
    numbers, got = got, as_ints(got)
    if got is None and isinstance(numbers, (list, tuple)) and numbers and all(isinstance(x, float) for x in numbers):
        return fail("the position ids are floats: a position indexes the model's table of positions, so it is an "
                    "integer (a float tensor: .long(); torch.arange gives integers unless a bound is a float)")
    if got is None:
        return fail(f"answer should be a list of {len(expected)} integers, got {answer!r}")
    if len(got) != len(expected):
        return fail(f"the packed row has {sum(new)} tokens (sum of new = {new}), so it needs "
                    f"{len(expected)} position ids; you gave {len(got)}")
    if got == expected:
        return passed(f"position_ids = {expected}: each sequence counts on from what it already has in the cache")
    hints = []
    if got == list(range(len(expected))):
        hints.append("you numbered the packed row as one long sequence; every sequence has its own positions")
    elif got == [j for n in new for j in range(n)]:
        hints.append("each sequence's new tokens start after the tokens it already has in the cache "
                     "(at num_computed_tokens, not at 0)")
    else:
        starts = [sum(new[:s]) for s in range(len(new))]
        for s, (a, n) in enumerate(zip(starts, new)):
            mine, right = got[a:a + n], expected[a:a + n]
            if mine == right:
                continue
            who = f"sequence {seq_letter(s)}"
            if any(y - x != 1 for x, y in zip(mine, mine[1:])):
                hints.append(f"{who}'s positions do not count up by one from token to token")
            else:
                hints.append(f"{who}'s positions start too {'high' if mine[0] > right[0] else 'low'}: where does "
                             "its first new token sit in its own sequence?")
    return fail("some position ids are wrong" + "".join(f"\nhint: {h}" for h in hints))


def _kinds(cached, new, got, expected) -> list[str]:
    """The kinds of mistake among the wrong entries of a mask: which rule of the block-diagonal causal
    mask each breaks, named without its coordinates."""
    q_seq = [s for s, n in enumerate(new) for _ in range(n)]
    q_pos = [c + j for c, n in zip(cached, new) for j in range(n)]
    keys = [(s, p, "cached") for s, c in enumerate(cached) for p in range(c)]
    keys += [(s, c + j, "new") for s, (c, n) in enumerate(zip(cached, new)) for j in range(n)]
    kinds = []
    for i, j in (got != expected).nonzero().tolist():
        ks, kp, part = keys[j]
        kinds.append(next(kind for wrong, kind in [
            (got[i, j] and ks != q_seq[i], "a query sees a key of another sequence: sequences packed in one row "
                                           "must not see each other"),
            (got[i, j], "a query sees a later key of its own sequence: attention is causal, the future is hidden"),
            (kp == q_pos[i], "a query is kept from its own key: a token attends to itself too"),
            (part == "cached", "a query is kept from an earlier key of its own sequence that sits in the cache"),
            (True, "a query is kept from an earlier key of its own sequence computed in this same step")] if wrong))
    return list(dict.fromkeys(kinds))  # each kind once, in order


@self_check
def check_mask(cached, new, answer) -> bool:
    """``answer``: the boolean ``[queries, keys]`` mask of the concat layout, True = may attend."""
    cached, new = _lengths(cached, new)
    if answer is None or answer is Ellipsis:
        return fail("not done yet: write mask in the cell above, then run this check")
    expected = block_diagonal_causal_mask(cached, new)
    q, k = expected.shape
    try:
        rows = answer if isinstance(answer, (list, tuple)) and answer and all(torch.is_tensor(r) for r in answer) else None
        got = torch.stack(list(rows)) if rows is not None else torch.as_tensor(_as_list(answer))  # (a list of rows)
    except (TypeError, ValueError, RuntimeError):
        return fail(f"answer should be a boolean tensor (or nested lists) of shape ({q}, {k})")
    if got.dtype.is_floating_point:
        ones = bool(((got == 0) | (got == 1)).all())  # 1.0 / 0.0: the right pattern, the wrong type
        return fail("give the boolean mask (True = may attend)" + (
            ": your 1.0 / 0.0 entries are numbers -- build it with dtype=torch.bool (or compare: x > 0)" if ones
            else "; additive_mask() makes the 0 / -inf form the model receives out of it"))
    while got.dim() > 2 and got.shape[0] == 1:  # [1, 1, q, k] as the model takes it, or [1, q, k]
        got = got[0]
    if tuple(got.shape) != (q, k):
        hint = ""
        if got.dim() == 2 and tuple(got.shape) == (k, q):
            hint = " -- transposed: rows are queries, columns keys"
        elif got.dim() == 2 and got.shape[0] == q and got.shape[1] == sum(new):
            hint = f" -- the keys include the {sum(cached)} cached ones, not only this step's {sum(new)}"
        return fail(f"the mask should have one row per query (sum(new) = {q}) and one column per key (sum(cached) + "
                    f"sum(new) = {k}): shape ({q}, {k}), got {tuple(got.shape)}{hint}")
    got = got.to(torch.bool)
    if torch.equal(got, expected):
        return passed(f"all {q} x {k} entries match block_diagonal_causal_mask({cached}, {new})")
    hints = []
    if torch.equal(got, torch.ones(q, k, dtype=torch.bool).tril(k - q)):
        hints.append("that is a plain causal mask over the packed row: it lets sequences see each other")
    if torch.equal(got, per_sequence_causal_mask(cached, new)):
        hints.append("that is the per-sequence layout ([A all | B all]); the concat cache puts every cached key first")
    c = sum(cached)
    if c and torch.equal(got, torch.cat([expected[:, c:], expected[:, :c]], dim=1)):
        hints.append("the keys are in the order [all new | all cached]; the concat cache puts every cached key first")
    if torch.equal(got, ~expected):
        hints.append("that is the mask inverted: True means the query *may* attend to the key")
    if not hints:
        hints = _kinds(cached, new, got, expected)
    return fail("the mask is not the block-diagonal causal mask" + "".join(f"\nhint: {h}" for h in hints))
