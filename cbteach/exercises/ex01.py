"""Notebook 01: one wave of static batching -- the padded prefill, then decode to the barrier.

The learner's ``static_wave`` runs with its passes recorded and ``model.generate`` barred; each request's tokens
must be greedy ``generate``'s on that prompt alone, and the passes those of :func:`cbteach.static_batching`.
A wave on a GPT-2 (learned positions) catches position ids that do not count from a row's first real token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.request import Request
from ..engine.static import static_batching
from . import as_ints, fail, need_function, passed, raised, self_check
from .ex00 import run_barred


def _pass(ids, cached, kwargs, model):
    """One pass as the checks read it: rows, positions fed and cached, the mask's width (None: no mask), whether
    position ids were given, and the attention mask (to see the padding side)."""
    mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
    mask = mask if torch.is_tensor(mask) and mask.dim() == 2 else None
    return None if ids.dim() != 2 else {
        "rows": ids.shape[0], "fed": ids.shape[1], "cached": cached,
        "mask_width": None if mask is None else mask.shape[1], "positions": pos is not None,
        "position_ids": pos.tolist() if torch.is_tensor(pos) and pos.shape == ids.shape else None,
        "mask": None if mask is None else mask.tolist()}


def reference(model, prompt, max_new_tokens, eos_id) -> list[int]:
    """Greedy ``model.generate`` on one prompt alone: the ground truth (``eos_id=None``: no stop token)."""
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0 if eos_id is not None else max_new_tokens,
                             eos_token_id=eos_id, pad_token_id=eos_id if eos_id is not None else 0)
    return out[0, ids.shape[1]:].tolist()


def engine_passes(model, prompts, max_new_tokens, eos_id) -> list[tuple[int, int]]:
    """``(rows, positions fed per row)`` of each step :func:`cbteach.static_batching` takes for this wave."""
    gen = model.generation_config
    saved = gen.eos_token_id
    gen.eos_token_id = eos_id  # the engine stops on the model's EOS; the case picks its own, for this run only
    try:
        reqs = [Request(list(p), max_new_tokens, request_id=i) for i, p in enumerate(prompts)]
        result = static_batching(model, None, reqs, batch_size=len(prompts))
    finally:
        gen.eos_token_id = saved
    return [(len(st.slots), max(s.num_tokens + s.num_pad for s in st.slots)) for st in result.steps]


def _as_outputs(got, n):
    """The learner's answer as ``n`` lists of ints, or None if it is not that."""
    if torch.is_tensor(got) and got.dim() == 2:
        got = list(got)  # one row per prompt
    got = list(got) if hasattr(got, "__iter__") and not isinstance(got, (str, bytes, dict)) else None
    if got is None or len(got) != n:
        return None
    rows = [as_ints(row.reshape(-1) if torch.is_tensor(row) else row) for row in got]
    return None if any(row is None for row in rows) else rows


def _position_hint(calls) -> str | None:
    """Whether a pass's position ids fail to count each row's real tokens from 0 (the mask says which are real)."""
    for k, c in enumerate(calls):
        if c["position_ids"] is None or c["mask"] is None:
            continue
        for pos, mask in zip(c["position_ids"], c["mask"]):
            seen = [sum(mask[:j + 1]) - 1 for j in range(len(mask))][-len(pos):]  # real tokens up to each column
            real = [(p, s) for p, s, m in zip(pos, seen, mask[-len(pos):]) if m]
            if real and all(p == s + 1 for p, s in real):
                return "the position ids count from 1: a row's first real token is its position 0"
            if any(p != s for p, s in real):
                return ("the prefill's position ids count from the pads: a row's first real token is its position 0"
                        if k == 0 else "a decode pass's position id is not the count of the row's real tokens "
                        "before the one it feeds")
    return None


def _pass_hint(calls, prompts, outputs=None, want=None):
    """What the recorded passes say is wrong (None: nothing): their shapes, and their number against
    the longest answer, the learner's or generate's (a wave takes one pass per token of its longest answer)."""
    first, later = calls[0], calls[1:]
    steps = max(map(len, [*(outputs or []), *(want or [])])) if outputs else len(calls)
    # (a RoPE model sees only distances, so a pad's -1 harms nothing there: named where a pass raised)
    negative = outputs is None and any(min(map(min, c["position_ids"])) < 0 for c in calls if c["position_ids"])
    hints = [
        (negative, "a position id is negative (a pad's count of real tokens before it, minus one): a model with "
                   "learned positions looks each one up in a table that starts at 0"),
        (first["rows"] != len(prompts), "the prefill ran the prompts in separate passes, not one padded rectangle"),
        (first["fed"] != max(map(len, prompts)),
         "the prefill rectangle has the wrong width: it holds the longest prompt whole, and no column more"),
        (first["mask"] is None, "the prefill got no attention mask: the short prompts attended to their pads"),
        (any(row[-1] == 0 for row in first["mask"] or []), "a row ends in padding: pad on the left"),
        (any(c["fed"] > 1 for c in later), "a decode pass fed more than one token per row: with the cache, feed only "
                                           "the token each row chose"),
        (any(c["cached"] == 0 for c in later), "a decode pass got no cache: pass back the one the last pass returned"),
        (any(c["rows"] != len(prompts) for c in later), "a decode pass dropped rows: a static batch keeps every row, "
                                                        "finished ones included"),
        (any(c["mask_width"] is None for c in later), "a decode pass got no attention mask: the pads are still in the "
                                                      "cache"),
        (any(c["mask_width"] != c["cached"] + c["fed"] for c in later),
         "a decode pass's mask does not cover the cache plus the new token: it must grow with every step"),
        (any(c["mask"] and not any(row[-1] for row in c["mask"]) for c in later),
         "a decode pass's mask hides the token it feeds (its new column is all 0): that token is real"),
        (len(calls) == steps + 1 and any(o[:1] != w[:1] for o, w in zip(outputs or [], want or [])),
         "one forward pass too many, and first tokens that differ: the prefill's logits already give each first "
         "new token"),
        (len(calls) == steps + 1, "one forward pass too many: the last step's token needs no pass of its own"),
        (len(calls) > steps, "the wave kept stepping after its longest request was done"),
    ]
    return next((hint for wrong, hint in hints if wrong), None)


def _token_hint(got, want, calls, eos_id=None) -> str:
    stop = f" -- and a row finishes on eos_id={eos_id}, the id it is given (here not the model's own EOS)" \
        if eos_id is not None else ""
    hints = [
        (len(got) > len(want) and got[:len(want)] == want, "it goes on after its request finished: a finished row's "
                                                           f"tokens are thrown away{stop}"),
        (got == want[:-1], "it ends one token early: generate keeps the EOS token, and max_new_tokens counts every "
                           "new token"),
        (got and want[:len(got)] == got, "it stops before its request is done: only its own stop ends it, the others "
                                         "wait at the barrier"),
        (not got, "it has no tokens; even max_new_tokens=1 makes one: the prefill's argmax"),
        (not all(c["positions"] for c in calls), "position_ids were not passed on every pass: count each row's "
                                                 "positions from its first real token, not from the pads"),
        (_position_hint(calls) is not None, _position_hint(calls)),
        (got[:1] != want[:1], "its first token already differs: the argmax at the last column of the prefill's logits"),
    ]
    return next((hint for wrong, hint in hints if wrong), "its later tokens differ: check the position id each row "
                "gets on each decode step, and the token each row is fed")


def positions_model(device="cpu"):
    """A 2-layer random GPT-2 (learned position embeddings) whose positions and output weights are scaled up
    so that a wrong position id changes the argmax -- a plain random model barely notices."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=63,
                         bos_token_id=63, tie_word_embeddings=False)
        m = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        m.transformer.wte.weight.mul_(5)
        m.transformer.wpe.weight.mul_(20)
        m.lm_head.weight.mul_(10)
    return m.to(device)


RAGGED = [[11, 12, 13, 14, 15, 16, 17], [21, 22], [31, 32, 33, 34]]


class Wave(NamedTuple):
    what: str
    model: object
    prompts: list
    max_new_tokens: int
    eos_id: int | None  # the token that ends a request


def _cases(model, prompts, n, eos_id):
    """The notebook's wave; a one-token wave (the prefill alone); a ragged wave on a model with learned
    positions, stopping on a token (picked live) that every request makes, at different steps: some
    requests wait at the barrier, and the wave ends before ``max_new_tokens``."""
    cases = [Wave(what="the notebook's wave", model=model, prompts=prompts, max_new_tokens=n, eos_id=eos_id),
             Wave(what="a one-token wave", model=model, prompts=prompts[:2], max_new_tokens=1, eos_id=eos_id)]
    gpt = positions_model(model.device)
    firsts = [reference(gpt, p, 12, None) for p in RAGGED]
    ends = {t: [f.index(t) for f in firsts] for t in set(firsts[0]) if all(t in f for f in firsts)}
    stop = max(ends, key=lambda t: (max(ends[t]) - min(ends[t]), -t)) if ends else firsts[1][-1]
    cases.append(Wave(what="a ragged wave on a GPT-2 model (learned positions)", model=gpt, prompts=RAGGED,
                      max_new_tokens=12, eos_id=stop))
    return cases


@self_check
def check_static_wave(static_wave, model, prompts, max_new_tokens: int, eos_id: int) -> bool:
    """``static_wave(model, prompts, max_new_tokens, eos_id)`` -> each prompt's greedy tokens, in the static
    batcher's passes; the notebook's wave first, then :func:`_cases`'s."""
    need_function(static_wave, "static_wave")
    cases = _cases(model, prompts, max_new_tokens, eos_id)
    for where, m, ps, n, eos in cases:  # see Wave
        want = [reference(m, p, n, eos) for p in ps]
        got, calls = run_barred(static_wave, m, ([list(p) for p in ps], n, eos), "static_wave", _pass)
        if isinstance(got, Exception):
            hint = _pass_hint(calls, ps) if calls else None
            why = f" (before that, {hint})" if hint else ""
            return fail(f"{where}: static_wave raised {raised(got)}{why}")
        if got is None:
            return fail("not done yet: static_wave returned None -- write it in the cell above")
        outputs = _as_outputs(got, len(ps))
        if outputs is None:
            return fail(f"{where}: static_wave returned {type(got).__name__}; return one list of new "
                        f"token ids (ints) per prompt, {len(ps)} lists in the prompts' order")
        if not calls:
            return fail("the check saw no forward pass: call the model itself, model(input_ids=...)")
        hint = _pass_hint(calls, ps, outputs, want)
        if hint:
            return fail(f"{where}: {hint}")
        if outputs != want and sorted(outputs) == sorted(want):
            return fail(f"{where}: every request's tokens are there, in another order: answer i is prompt i's "
                        "(were the prompts sorted, by length say, and the answers not put back?)")
        i = next((i for i, (g, w) in enumerate(zip(outputs, want)) if g != w), None)
        if i is not None:
            own = getattr(m.generation_config, "eos_token_id", None)
            return fail(f"{where}: request {i}'s tokens are not what generate gives it alone "
                        f"({_token_hint(outputs[i], want[i], calls, eos if eos != own else None)})")
        if [(c["rows"], c["fed"]) for c in calls] != engine_passes(m, ps, n, eos):  # right tokens, other passes
            return fail(f"{where}: right tokens, but not in the static batcher's passes (one padded "
                        "prefill of every row, then one pass per step, every row fed one token)")
    return passed(f"your wave gives generate's tokens in all {len(cases)} cases, in the static batcher's "
                  "passes: one padded prefill, then one step per token until the longest request is done")
