"""A randomized test of failure isolation over every feature the engine combines.

Each case is a case of :mod:`test_engine_fuzz` (architecture, KV cache, pool, budget, prefix caching,
policy, preemption, parallel sampling, async scheduling, speculative decoding) with a poison token put
into some prompts, and a model that fails on it: its forward pass raises whenever the token is fed, or
its embedding is NaN at the token's position. Every poisoned request must end with an error; every other
request (and sample) must still equal per-prompt ``model.generate`` (a seeded sample: the same request run
alone), and no KV block may be left in use -- the rule that a failure in one request ends that request
only. A request that generates the poison token itself fails too, rightly, and is not compared. Cases are
seeded: a failure names its seed (``CBTEACH_FAILURE_FUZZ_CASES`` runs more).
"""
from __future__ import annotations

import os
import random

import pytest

from cbteach import Engine
from conftest import reference, sim_clock
from test_engine_fuzz import MODELS, _alone, case_pieces, draw_case
from test_v1_contract import _nan_at, _refuse_token

POISON = 95


def _poisoning(model, mode: str):
    """A hook (public torch API) that makes ``model`` fail on :data:`POISON`: raise, or NaN at its position."""
    return _refuse_token(model, POISON) if mode == "raise" else _nan_at(model, POISON)


@pytest.mark.parametrize("seed", range(int(os.environ.get("CBTEACH_FAILURE_FUZZ_CASES", "30"))))
def test_a_failing_request_ends_alone_in_every_feature_combination(seed):
    opts, reqs, label = draw_case(1000 + seed)
    g = random.Random(seed)
    mode = g.choice(["raise", "nan"])
    for r in reqs:
        r.prompt = [t for t in r.prompt if t != POISON]  # (a drawn prompt may hold it already)
        if g.random() < 0.35:
            r.prompt.insert(g.randint(len(r.prompt) // 2, len(r.prompt)), POISON)
    if isinstance(opts.get("num_blocks"), int):
        opts["num_blocks"] += 1  # (the poison made a prompt one token longer)
    model = MODELS[label.split("+")[0]]
    hook = _poisoning(model, mode)
    try:
        eng = Engine(model, clock=sim_clock(0.01), **opts, **case_pieces(label, opts))
        got = eng.run(reqs)
    finally:
        hook.remove()
    for r, c in zip(reqs, got):
        for i, s in enumerate(c.samples or [c]):
            where = f"seed {seed} ({mode}, {label}, {opts}): request {r.request_id} sample {i}"
            if POISON in r.prompt:
                assert s.finish_reason == "error", where
                continue
            want = (reference(model, r.prompt, r.max_new_tokens, eos_id=-1 if r.ignore_eos else 5)
                    if r.sampling_params.greedy else _alone(model, r, i))
            if POISON in want[:-1]:
                continue  # it feeds the poison itself, and fails then
            assert s.error is None and s.output_ids == want, where
    assert not eng.has_unfinished()
    if opts.get("kv") == "paged":
        assert eng.kv_usage()["num_used_blocks"] == 0, f"seed {seed}: blocks leaked ({opts})"
