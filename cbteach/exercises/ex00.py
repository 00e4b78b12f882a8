"""Notebook 00: greedy decoding with a KV cache, checked against what the model really does.

The learner's ``greedy_decode`` runs with a forward pre-hook recording each pass (positions fed, positions
cached); its tokens must be transformers' greedy ``model.generate``'s, fed as ``generate`` feeds with its
cache: the prompt once, then one position per decode step.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch

from . import Fail, as_ints, fail, first_mistake, need_function, passed, raised, self_check

CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5 renamed past_key_values to cache


@contextmanager
def recorded(model, record=lambda ids, cached, kwargs, model: (int(ids.shape[-1]), cached, ids.device == model.device)):
    """The list of ``record(input_ids, positions already cached, kwargs, model)`` for every ``model(...)`` call
    inside the block (None left out); by default ``(fed, cached, on_model_device)``."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None and kwargs.get("inputs_embeds") is not None:
            ids = kwargs["inputs_embeds"][..., 0]
        cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
        cached = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0  # positions it holds
        got = record(ids, cached, kwargs, model) if torch.is_tensor(ids) else None
        if got is not None:
            calls.append(got)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def run_barred(fn, model, args: tuple, name: str, record=None):
    """``fn(model, *args)`` with its forward passes recorded (:func:`recorded`) and ``model.generate`` barred:
    (what it returned or raised, the passes); :class:`Fail` if it called generate."""
    barred = []

    def no_generate(*_, **__):
        barred.append(True)
        raise RuntimeError(f"the check does not let {name} call model.generate")

    model.generate = no_generate  # on this instance only; removed below
    try:
        with recorded(model, *([record] if record else [])) as calls, torch.no_grad():
            try:
                got = fn(model, *args)
                if not isinstance(got, (list, tuple)) and not torch.is_tensor(got) and hasattr(got, "__next__"):
                    got = list(got)  # a generator runs only when consumed: while its forward passes are recorded
            except Exception as err:  # the learner's code: say what failed
                got = err
    finally:
        model.__dict__.pop("generate", None)  # the learner's code may have deleted it already
    if barred:
        raise Fail(f"write {name} yourself: it called model.generate")
    return got, calls


def generate_with_work(model, input_ids, max_new_tokens: int, eos_id: int, use_cache: bool = True):
    """Greedy ``model.generate``'s new tokens and its recorded forward passes (the reference)."""
    with recorded(model) as calls, torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id,
                             use_cache=use_cache)
    return out[0, input_ids.shape[1]:].tolist(), calls


def _work_hint(calls) -> str | None:
    """What the decode passes, ``(positions fed, positions cached)``, say about the cache's use (None: all right)."""
    hints = [(lambda fed, cached: fed > 1 and cached == 0,
              "you ran the whole sequence through the model again at every step, recomputing every earlier token's "
              "keys and values: pass back the cache the model returns, and feed only the newest token"),
             (lambda fed, cached: fed > 1 and cached > 0,
              "you fed earlier tokens again together with the cache: feed only the token chosen in the step before"),
             (lambda fed, cached: fed == 1 and cached == 0,
              "a decode step fed the new token without the cache, so the model saw it with no context; pass the "
              "cache from the previous step's output (out.cache) back in as cache=")]
    return first_mistake(hints, lambda wrong: any(wrong(*c) for c in calls[1:]))


def _record(ids, cached, kwargs, model):
    """A pass as the check reads it: positions fed and cached, on the model's device, the last position id given
    (None: none) and the attention mask's width (None: none)."""
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    vocab = model.get_input_embeddings().num_embeddings
    return (int(ids.shape[-1]), cached, ids.device == model.device,
            int(pos.reshape(-1)[-1]) if torch.is_tensor(pos) and pos.numel() else None,
            int(mask.shape[-1]) if torch.is_tensor(mask) and mask.dim() >= 1 else None,
            ids.dim() != 2, bool(ids.numel()) and not ids.is_floating_point() and int(ids.max()) >= vocab,
            torch.is_tensor(mask) and bool((mask == 0).any()))


def _input_hint(calls) -> str | None:
    """What a pass's position ids or attention mask get wrong (None: nothing)."""
    for fed, cached, _, last, width, not_2d, past_vocab, masked in calls:
        if not_2d:
            return "a step's input_ids were not 2-D: the model takes [batch, tokens], here [1, tokens]"
        if past_vocab:
            return ("a step fed a token id past the vocabulary: an argmax over the flattened logits gives a position "
                    "in them, not a token id -- over which axis is the next token chosen?")
        if last is not None and last != cached + fed - 1:
            return ("a step's position_ids do not give its token's position in the sequence: the tokens before it "
                    "count, the prompt's included (or pass none: the model counts them from its cache)")
        if width is not None and width != cached + fed:
            return ("a step's attention_mask does not cover the cache plus the token fed: it has one entry for every "
                    "position the step attends to (or pass none)")
        if masked:
            return ("a step's attention_mask has a 0: a 0 hides that position from attention, and every position here "
                    "is a real token")
    return None


def _token_hint(got, expected, prompt, n, eos_id) -> str:
    ended = len(expected) < n or (expected and expected[-1] == eos_id)
    longer = len(got) > len(expected) and got[:len(expected)] == expected
    shorter = len(got) < len(expected) and expected[:len(got)] == got
    hints = [(got[:len(prompt)] == prompt and got[len(prompt):] == expected,
              "you returned the prompt too; return only the new tokens"),
             (ended and longer, "you kept going after EOS: stop right after appending eos_id"),
             (ended and got == expected[:-1], "you left out the EOS token; generate keeps it in its output: append "
                                              "it, then stop"),
             (not got, "you returned no tokens; even max_new_tokens=1 makes one (the prefill's argmax)"),
             (longer, f"you made {len(got)} tokens; max_new_tokens={n} counts every new token, the prefill's included"),
             (shorter, f"you stopped after {len(got)} tokens; go on until max_new_tokens={n} tokens or until you "
                       "append eos_id"),
             (got[:1] != expected[:1], "the first new token already differs: it is the argmax of the prefill's logits "
                                       "at the last position")]
    k = next(i for i, (a, b) in enumerate(zip(got + [None], expected + [None])) if a != b)
    return next((hint for wrong, hint in hints if wrong), f"tokens 0-{k - 1} agree but token {k} differs: at each "
                "step take the argmax at the last position, and feed back the token you just chose, with the cache")


class Case(NamedTuple):
    max_new_tokens: int
    eos_id: int | None


def _cases(model, input_ids, max_new_tokens, eos_id) -> list[Case]:
    """The notebook's case, a prefill-only case, a case without EOS, and one that stops on a token the
    model really produces (picked live, so every model, even a random one, gets an EOS case) half-way:
    a loop that ignores ``eos_id`` -- or stops on the model's own EOS instead -- makes more tokens."""
    base, _ = generate_with_work(model, input_ids, 12, eos_id)
    firsts = [j for j, t in enumerate(base) if t not in base[:j] and t != eos_id and j < len(base) - 1]
    stop = min(firsts, key=lambda j: abs(j - len(base) // 2)) if firsts else None  # where it first appears
    return [Case(max_new_tokens, eos_id), Case(1, eos_id),
            *([Case(12, eos_id)] if base[-1] != eos_id and max_new_tokens != 12 else []),
            *([Case(len(base), base[stop])] if stop is not None else [])]


@self_check
def check_greedy_decode(greedy_decode, model, input_ids, max_new_tokens: int, eos_id: int) -> bool:
    """``greedy_decode(model, input_ids, max_new_tokens, eos_id)`` -> greedy ``model.generate``'s new tokens, fed
    as ``generate`` feeds with its cache; the notebook's case (``input_ids``: ``[1, P]``) first, then a few more."""
    need_function(greedy_decode, "greedy_decode")
    cases = _cases(model, input_ids, max_new_tokens, eos_id)
    references = [generate_with_work(model, input_ids, n, eos) for n, eos in cases]  # (tokens, passes)
    for (n, eos), (expected, ref_calls) in zip(cases, references):
        got, calls = run_barred(greedy_decode, model, (input_ids.clone(), n, eos), "greedy_decode", _record)
        where = f"greedy_decode(model, <{input_ids.shape[1]}-token prompt>, max_new_tokens={n}, eos_id={eos})"
        hint, ids = _work_hint([c[:2] for c in calls]) or _input_hint(calls), as_ints(got)
        if isinstance(got, Exception):
            return fail(f"{where} raised {raised(got)}" + (f" -- {hint}" if hint else ""))
        if got is None and not calls:
            return fail("not done yet: greedy_decode returned None -- write it in the cell above")
        if ids is None:
            return fail(f"{where} returned {type(got).__name__}; it should return the new token ids, a list of ints")
        if not calls:
            return fail("the check saw no forward pass; call the model itself, model(input_ids=..., "
                        "cache=..., use_cache=True), not model.forward")
        if not all(c[2] for c in calls):
            return fail("a forward pass got its input on another device; make every tensor with device=model.device")
        if hint or ids != expected:
            return fail(f"{where}: {hint}" if hint else f"{where} gave other tokens than model.generate "
                        f"({_token_hint(ids, expected, input_ids[0].tolist(), n, eos)})")
        fed, ref_fed = sum(c[0] for c in calls), sum(c[0] for c in ref_calls)
        if len(calls) == len(ref_calls) + 1 and fed == ref_fed + 1:
            return fail(f"{where}: right tokens, but one forward pass too many: the token chosen in "
                        "the last step is returned, it needs no forward pass of its own")
        if fed != ref_fed:
            return fail(f"{where}: right tokens, but your loop fed the model {fed} positions in {len(calls)} forward "
                        f"passes, and generate with its cache fed {'fewer' if fed > ref_fed else 'more'}")
    _, no_cache = generate_with_work(model, input_ids, max_new_tokens, eos_id, use_cache=False)
    p, n_new = input_ids.shape[1], len(references[0][0])
    return passed(f"same tokens as model.generate in all {len(cases)} cases, and the same work: for the "
                  f"notebook's prompt your loop fed {p} + {n_new - 1} = {p + n_new - 1} positions "
                  f"(P + N - 1); without a cache generate fed {sum(c[0] for c in no_cache)}")
