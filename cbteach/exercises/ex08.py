"""Notebook 08: what the prefix cache reuses (against the engine's ``num_cached_prompt_tokens``), and speculative
decoding's acceptance rule (against the engine's, then inside a speculative run that must equal a plain one).
"""
from __future__ import annotations

import os
import random
from typing import NamedTuple
from unittest import mock

from ..worker import spec_runner
from ..engine.engine import Engine
from ..core.request import Request
from ..engine.speculative import accept as engine_accept
from . import as_ints, ask, fail, first_mistake, is_int, need_function, passed, self_check

# ---------------------------------------------------------------- prefix reuse ----------------

def _ids(seed: int, n: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(10, 90) for _ in range(n)]


_S = _ids(1, 10)  # a shared "system prompt" of 10 tokens
_L = _ids(2, 13)


class PrefixCase(NamedTuple):
    what: str  # what the case is about
    prompts: list  # in arrival order
    block_size: int = 4


PREFIX_CASES = [
    PrefixCase(what="two prompts sharing 10 tokens, blocks of 4", prompts=[_S + _ids(3, 3), _S + _ids(4, 2)]),
    PrefixCase(what="the same 16-token prompt twice, blocks of 4", prompts=[_ids(5, 16), _ids(5, 16)]),
    PrefixCase(what="the same 17-token prompt twice, blocks of 4", prompts=[_ids(6, 17), _ids(6, 17)]),
    PrefixCase(what="a prompt that matches the first one, not the previous one",
               prompts=[_S + _ids(7, 4), _ids(8, 9), _S + _ids(9, 3)]),
    PrefixCase(what="equal tokens after a first block that differs", prompts=[_ids(10, 4) + _S, _ids(11, 4) + _S]),
    PrefixCase(what="a prompt shorter than one block", prompts=[_ids(12, 3), _ids(12, 3)]),
    PrefixCase(what="a prompt that extends an earlier one", prompts=[_L, _L + _ids(13, 6)]),
    PrefixCase(what="a prompt that is the start of an earlier one", prompts=[_L, _L[:9], _L[:8]]),
    PrefixCase(what="the same prompts, blocks of 2", prompts=[_S + _ids(3, 3), _S + _ids(4, 2), _S[:5]], block_size=2),
    PrefixCase(what="a prompt that extends an earlier one of whole blocks", prompts=[_ids(14, 16), _ids(14, 16) + _ids(15, 4)]),
    PrefixCase(what="an earlier prompt's blocks in another order", prompts=[_ids(20, 4) + _S[:4] + [7], _S[:4] + _ids(20, 4) + [8]]),
    PrefixCase(what="a longer prompt in between that shares nothing",
               prompts=[_ids(16, 16) + _ids(17, 1), _ids(18, 24), _ids(16, 16) + _ids(19, 5)]),
]


def engine_cached_tokens(model, prompts, block_size: int) -> list[int]:
    """Prompt tokens the prefix cache supplied to each request, served one at a time in order."""
    engine = Engine(model, None, max_batch_size=1, kv="paged", block_size=block_size, prefix_caching=True)
    reqs = [Request(list(p), 1, request_id=i, ignore_eos=True) for i, p in enumerate(prompts)]
    return [c.num_cached_prompt_tokens for c in engine.run(reqs)]


def _model(prompts, bs, *, last_rule=True, full_blocks=True, earlier="all", chained=True, anywhere=False, ceil=False,
           earlier_short=False, short_by=1, summed=False, by_index=False):
    """The engine's rule, with one part switched off at a time (to recognise a learner's mistake)."""
    out = []
    for j, p in enumerate(prompts):
        j = prompts.index(p) if by_index else j  # (list.index finds a prompt's first copy)
        usable = p[:-short_by] if last_rule else p
        pool = {"all": prompts[:j], "previous": prompts[max(0, j - 1):j], "first": prompts[:1] if j else [],
                "longest": [max(prompts[:j], key=len)] if j else []}[earlier]
        if earlier_short:
            pool = [q[:-1] for q in pool]
        best = 0
        if anywhere:  # blocks from the start whose tokens an earlier prompt holds as a block, wherever it is
            seen = {tuple(q[i:i + bs]) for q in pool for i in range(0, len(q) - bs + 1, bs)}
            pool = [usable[:next((i for i in range(0, len(usable), bs) if tuple(usable[i:i + bs]) not in seen),
                                 len(usable))]]
        for q in pool:
            if chained:
                n = len(os.path.commonprefix([usable, q]))
            else:  # equal blocks at the same index, wherever they are
                n = sum(bs for i in range(0, min(len(usable), len(q)) - bs + 1, bs) if usable[i:i + bs] == q[i:i + bs])
            if full_blocks:
                n = -(-n // bs) * bs if ceil else n // bs * bs
            best = best + n if summed else max(best, n)
        out.append(best)
    return out


# Typical mistakes: the engine's rule with one part switched off (:func:`_model`'s keywords; several: any of them),
# and the hint when the learner's answers are that rule's.
PREFIX_MISTAKES = [
    ([dict(summed=True)], "you added up the matches with several earlier prompts; a prompt reuses one chain of cached "
                          "blocks, so the matches overlap rather than add"),
    ([dict(last_rule=False)], "the prompt's last token is always computed, even when the whole prompt is cached: its "
                              "logits give the first new token -- so the lookup stops one token short of the prompt"),
    ([dict(full_blocks=False, last_rule=False), dict(full_blocks=False)],
     "you counted every shared token; only *full* blocks are cached: whole blocks of {bs}, rounded down"),
    ([dict(earlier_short=True)], "an earlier prompt's blocks are all in the cache, the block holding its last token "
                                 "too once it is full: only the *new* prompt stops one token short"),
    ([dict(earlier="previous"), dict(earlier="first"), dict(earlier="longest")],
     "the cache keeps the full blocks of *every* earlier request, not only one of them"),
    ([dict(chained=False)], "a block is found by a hash of its tokens *and of everything before it*: after the first "
                            "block that differs, nothing more can be reused"),
    ([dict(anywhere=True)], "a block is found by a hash of its tokens *and of everything before it*: the same tokens "
                            "at another place in an earlier prompt are another block"),
    ([dict(ceil=True)], "a partly filled block is never cached: round down to whole blocks, not up"),
    ([dict(short_by=2)], "off by one: the lookup leaves out the prompt's last token only -- its logits give the first "
                         "new token"),
    ([dict(by_index=True)], "a prompt sent twice: its second copy finds the first one's blocks. Find the requests "
                            "before it by position (enumerate), not with prompts.index, which finds the first copy"),
]


def _prefix_hint(prompts, bs, got) -> str:
    if got[0] != 0:
        return "the first request finds an empty cache: nothing can be reused before anything was computed"
    hint = first_mistake(PREFIX_MISTAKES, lambda rules: any(got == _model(prompts, bs, **r) for r in rules))
    if hint:
        return hint.format(bs=bs)
    typed = next((n for n in (16, 8, 4, 32, 2) if n != bs and got == _model(prompts, n)), None)
    if typed is not None:
        return f"the block size is the argument block_size, not a number of your own: here it is not {typed}"
    if [g * bs for g in got] == _model(prompts, bs):
        return f"you counted blocks; the answer is in tokens, {bs} a block"
    if any(g % bs for g in got):
        return f"reuse always comes in whole blocks, so every answer is a multiple of the block size ({bs})"
    return "walk each prompt (less its last token) block by block, and stop at the first block no earlier one computed"


@self_check
def check_prefix_reuse(predict, model, prompts=None, block_size=None) -> bool:
    """``predict(prompts, block_size)`` -> the prompt tokens the prefix cache supplies to each prompt, served one
    at a time in order; the notebook's case first, then :data:`PREFIX_CASES`."""
    need_function(predict, "predict")
    cases = list(PREFIX_CASES)
    if prompts is not None:
        cases.insert(0, PrefixCase("the notebook's prompts", [list(p) for p in prompts], block_size))
    for what, case, bs in cases:
        given = [list(p) for p in case]
        got = ask(predict, given, bs, shown=f"predict_reuse(...) (case: {what})")
        if given != [list(p) for p in case]:
            return fail(f"case {what!r}: predict changed the prompts it was given (a pop, a del, a slice assignment), "
                        "so a later prompt was compared with an earlier one cut short -- leave them as they are")
        got = as_ints(got) or got  # a list, tuple, generator, tensor or NumPy array of ints
        if not isinstance(got, list) or len(got) != len(case) or not all(is_int(g) for g in got):
            return fail(f"predict should return a list of {len(case)} ints, one number per prompt; got {got!r} "
                        f"(case: {what})")
        expected = engine_cached_tokens(model, case, bs)
        if got != expected:
            i = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
            return fail(f"case {what!r}: for request {i} you predicted {got[i]} cached tokens, "
                        f"{'more' if got[i] > expected[i] else 'fewer'} than the engine reused. "
                        f"Hint: {_prefix_hint(case, bs, got)}")
    return passed(f"your predictions match the engine's num_cached_prompt_tokens on all {len(cases)} cases")


# ---------------------------------------------------------------- acceptance rule -------------

class AcceptCase(NamedTuple):
    drafts: list  # the guessed tokens
    targets: list  # the model's prediction after the last real token and after each guess


ACCEPT_CASES = [
    AcceptCase(drafts=[5, 6, 7], targets=[5, 6, 7, 8]),  # every guess right: the bonus token too
    AcceptCase(drafts=[5, 9, 7], targets=[5, 6, 7, 8]),  # second guess wrong (the third would have matched: irrelevant)
    AcceptCase(drafts=[9, 6, 7], targets=[5, 6, 7, 8]),  # first guess wrong
    AcceptCase(drafts=[4], targets=[4, 2]),
    AcceptCase(drafts=[3], targets=[1, 2]),
    AcceptCase(drafts=[], targets=[4]),  # nothing guessed: a plain decode
    AcceptCase(drafts=[1, 1, 1, 1, 1], targets=[1, 1, 2, 1, 1, 1]),
]
NUM_RANDOM_ACCEPT_CASES = 200  # more, drawn from a seeded generator


def _accept_hint(drafts, targets, got, right_at_mismatches: bool = False) -> str:
    """The misconception a wrong answer shows -- never which index to read or what to return
    (``right_at_mismatches``: the rule is right on every case where a guess is wrong)."""
    j = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))  # first mismatch
    if not drafts and not got:
        return "with no guesses the step is a plain decode: it yields exactly one token, the model's own"
    if j == len(drafts) and got == targets[:j]:
        return "when every guess was right, your rule throws away the bonus token: the prediction after the last guess"
    if j == len(drafts) and drafts and 0 < len(got) < j and right_at_mismatches:
        return ("when every guess was right (there is no mismatch at all), every guess is kept, and the bonus token "
                "after them")
    if j < len(drafts) and got == list(drafts[:j + 1]):
        return "at the first mismatch your rule keeps the wrong guess, not the model's own token"
    if j < len(drafts) and got == list(targets[:j]):
        return "a verify step always yields at least one token more than it accepts: the model's own next token"
    if len(got) > j + 1 and got[:j + 1] == list(targets[:j + 1]):
        return "stop at the first mismatch: every later prediction was made after a wrong guess"
    if not drafts:
        return "with no guesses the step is a plain decode: it yields exactly one token, the model's own"
    k = next((i for i, (d, t) in enumerate(zip(drafts, targets[1:])) if d != t), len(drafts))
    if got == list(drafts[:k]) + [targets[k]]:
        return "each guess was compared with the model's prediction one position later than its own"
    return "keep the model's tokens while the guesses agree with them, and no further: follow section 6's picture"


def loop_model():
    """:func:`cbteach.exercises.ex09.small_model`'s ``"gqa"`` Llama: its greedy output falls into loops within a few
    tokens, so prompt lookup guesses right often."""
    from .ex09 import small_model

    return small_model("gqa")


def _accept_cases() -> list[AcceptCase]:
    """:data:`ACCEPT_CASES`, then random ones on small alphabets: guesses often right, as with a good proposer."""
    g, cases = random.Random(0), list(ACCEPT_CASES)
    for _ in range(NUM_RANDOM_ACCEPT_CASES):
        targets = [g.randrange(3) for _ in range(g.randint(0, 6) + 1)]
        cases.append(AcceptCase([t if g.random() < 0.7 else g.randrange(3) for t in targets[:-1]], targets))
    return cases


def _gives(accept, drafts, targets) -> bool:
    """Whether ``accept`` gives the engine's tokens on this case (what it raises counts as no)."""
    try:
        return [int(t) for t in accept(list(drafts), list(targets))] == engine_accept(drafts, targets)
    except Exception:  # noqa: BLE001  (the learner's code; the case it failed on is reported already)
        return False


@self_check
def check_accept(accept) -> bool:
    """``accept(drafts, targets)`` -> the tokens a verify step yields (``targets`` has one more entry
    than ``drafts``: the model's prediction after the last real token and after each guess)."""
    need_function(accept, "accept")
    cases = _accept_cases()
    for drafts, targets in cases:
        given = (list(drafts), list(targets))
        got = ask(accept, *given, shown=f"accept({drafts}, {targets})")
        if given != (list(drafts), list(targets)):
            return fail(f"accept({drafts}, {targets}) changed the lists it was given: the engine reads them again "
                        "after your rule returns -- leave drafts and targets as they are")
        if not isinstance(got, (list, tuple)) or not all(is_int(t) for t in got):
            return fail(f"accept({drafts}, {targets}) returned {got!r}; it should return a list of token ids (ints)")
        if [int(t) for t in got] != engine_accept(drafts, targets):
            at_mismatches = all(_gives(accept, d, t) for d, t in cases if engine_accept(d, t) != t)
            return fail(f"accept({drafts}, {targets}) returned {list(got)}, which is not what the engine "
                        f"keeps. Hint: {_accept_hint(drafts, targets, [int(t) for t in got], at_mismatches)}")
    # In the engine: a speculative run with the learner's rule must equal a run without speculation.
    requests = lambda: [Request(_ids(100 + i, 6), 24, request_id=i, ignore_eos=True) for i in range(4)]  # noqa: E731
    plain = [c.output_ids for c in Engine(loop_model(), None, max_batch_size=4, kv="paged").run(requests())]
    engine = Engine(loop_model(), None, max_batch_size=4, kv="paged", speculative="ngram", num_speculative_tokens=3)
    with mock.patch.object(spec_runner, "accept", accept):
        spec = [c.output_ids for c in engine.run(requests())]
    if spec != plain:
        return fail("inside the engine your rule changed the generated tokens; speculation must give "
                    "exactly what plain greedy decoding gives")
    s = engine.spec_stats
    return passed(f"your rule matches the engine's on {len(cases)} cases, and inside the engine it kept the output "
                  f"exact ({s['accepted']} of {s['drafted']} guesses accepted in {s['verify_steps']} verify steps)")
